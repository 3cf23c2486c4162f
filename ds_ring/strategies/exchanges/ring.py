"""Ring exchange: K/V blocks passed rank to rank around each span; dK/dV travel home with them.

Forward: every member posts the transfer of the block it holds to the next member *before*
computing on it, so the transfer hides behind compute; after ``span.hops`` hops (``n - 1`` for a
full turn) every block has visited every member that needs it. Two K/V buffers, allocated once per
call, alternate: the block being computed on and the one arriving; once the last block has arrived, the
other buffer is freed.

Backward (a second ring): K/V blocks rotate again in the same two buffers. Each block's gradient
accumulator travels one step behind it: its first visitor starts it with its own gradient of the
block (the kernel's dK/dV as they are when one call meets the whole block), each later visitor adds
the accumulator it receives (into one receive buffer, allocated once per call) and sends the sum on,
and the last sends it home (for a full turn that is the next member, so the ring simply closes):
``span.hops`` transfers per member, none of them an empty accumulator. dQ stays local. A
member's own runs are computed last, once the ring's buffers are released, so the shard's dK/dV are
allocated only then. Per rank this holds ``Delta = rowsum(dout ∘ out)`` (``out`` itself only where autograd
keeps it: offloaded saved tensors let it go), ``dq``, two K/V blocks, the travelling dK/dV, one block's
gradients and its stand-in output at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_ring.comm.group_ranks import global_ranks
from ds_ring.comm.ring_comm import RingComm
from ds_ring.kernels.merge import accum_dtype
from ds_ring.strategies.blocks import (
    KV,
    BlockBuffers,
    LazyGrads,
    Options,
    Shard,
    block_grad,
    block_has_work,
    forward_block_,
    forward_own_,
    pack_block,
    unpack_block,
)
from ds_ring.strategies.plan import SpanPlan
from ds_ring.strategies.sharded import CommSpec, Exchange, register_exchange

__all__ = ["RingExchange"]


def _ring_comm(span: SpanPlan, comm: CommSpec, op: str, shift: int = 1) -> RingComm:
    """Send to the member ``shift`` places ahead, receive from the one ``shift`` places behind."""
    n, me = len(span.members), span.index
    ranks = global_ranks(comm.group, span.members)
    return RingComm(
        comm.group, send_to=ranks[(me + shift) % n], recv_from=ranks[(me - shift) % n], timeout_s=comm.timeout_s, op=op
    )


def _halves(flat: torch.Tensor, k_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK and dV parts of a flat block gradient whose dK part has ``k_numel`` elements."""
    return flat[:k_numel], flat[k_numel:]


def _add_halves_(grad: tuple[torch.Tensor, torch.Tensor], flat: torch.Tensor) -> None:
    for mine, theirs in zip(grad, _halves(flat, grad[0].numel()), strict=True):
        mine.add_(theirs)


def _send_halves(
    ring: RingComm, grad: tuple[torch.Tensor, torch.Tensor], into: torch.Tensor, k_numel: int, step: int
) -> None:
    """Post a block gradient's dK and dV parts to the ring, receiving a flat one (its dK part ``k_numel``
    elements) into ``into``."""
    for part, buffer in zip(grad, _halves(into, k_numel), strict=True):
        ring.send_recv(part, buffer)
    ring.commit(step)


class _KVTurn:
    """The K/V blocks' turn around a span: this member's block starts in one of two flat buffers
    (allocated once per call); each step the block held goes on while the next arrives in the other.
    The block held at step ``s`` is the one of the member ``s`` places behind."""

    def __init__(self, span: SpanPlan, shard: Shard, comm: CommSpec) -> None:
        self._span, self._batch, self._dims = span, shard.batch, shard.dims
        self._ring = _ring_comm(span, comm, "ring_kv")
        self._buffers = BlockBuffers(span, shard.batch, shard.dims, shard.k.dtype, shard.k.device)
        own = self._buffers.view(0, span.block_numel(span.index, shard.batch, *shard.dims))
        self._block = pack_block(span, shard.k, shard.v, own)
        self._incoming, self._sent = self._block, 0

    def kv(self, member: int) -> list[KV]:
        """Views ``(k_g, v_g)`` per head group into the block held, which is ``member``'s."""
        return unpack_block(self._span, member, self._block, self._batch, self._dims)

    def post(self, step: int) -> None:
        """Post the block held at ``step`` to the next member and the receive of step ``step + 1``'s
        into the other buffer."""
        src = (self._span.index - step - 1) % len(self._span.members)
        numel = self._span.block_numel(src, self._batch, *self._dims)
        self._incoming = self._ring.send_recv(self._block, self._buffers.view((step + 1) % 2, numel))
        self._ring.commit(step)
        self._sent = step % 2

    def arrive(self, last: bool = False) -> None:
        """Wait for the transfers :meth:`post` started; the block received is held from now on. ``last``: no
        block follows it, so the buffer of the one just sent is freed."""
        self._ring.wait()
        self._block = self._incoming
        if last:
            self._buffers.release(self._sent)


class RingExchange(Exchange):
    """``communication="ring"``: O(seq/p) memory per rank, ``n - 1`` hops per span."""

    def forward(
        self, span: SpanPlan, shard: Shard, comm: CommSpec, opts: Options, overlap: Callable[[], None] | None
    ) -> None:
        n, me, hops = len(span.members), span.index, span.hops
        blocks = _KVTurn(span, shard, comm) if hops else None
        for step in range(hops + 1):
            src = (me - step) % n
            if step < hops:
                blocks.post(step)
            if step == 0:
                if overlap is not None:
                    overlap()
                forward_own_(span, shard, opts)
            elif block_has_work(span, src, opts):
                forward_block_(span, src, blocks.kv(src), shard, opts)
            if step < hops:
                blocks.arrive(last=step == hops - 1)

    def blocks_backward(
        self, span: SpanPlan, shard: Shard, dout: torch.Tensor, dq: LazyGrads, comm: CommSpec, opts: Options
    ) -> torch.Tensor | None:
        """The blocks' turn of the backward: accumulates into ``dq``; returns this member's block
        gradient, home (flat, in the receive buffer).

        ``span.hops`` gradient transfers per member: at step ``s`` (1 to hops) this member holds the
        block of the member ``s`` places behind; at step 1 it is that block's first visitor and its
        gradient starts the accumulator, at later steps it adds the accumulator received from the
        previous member, and at the last step the sum goes home (the next member for a full turn,
        ``hops`` places back for a partial one).
        """
        n, me, hops = len(span.members), span.index, span.hops
        if not hops:
            return None
        batch, dims = shard.batch, shard.dims
        blocks = _KVTurn(span, shard, comm)
        forward = _ring_comm(span, comm, "ring_dkv")
        home = forward if hops == n - 1 else _ring_comm(span, comm, "ring_dkv", shift=-hops)
        # dK/dV travel in the accumulation dtype (fp32 for bf16/fp16), knowingly: 2x bf16's bytes on the backward
        # ring, because each block's gradient is a sum over up to p - 1 hops and a bf16 partial sum would lose
        # low bits at every hop (docs/gpu.md, item 10).
        received = BlockBuffers(span, batch, dims, accum_dtype(shard.q.dtype), shard.q.device)
        travelling = None
        blocks.post(0)
        blocks.arrive(last=hops == 1)
        for step in range(1, hops + 1):
            src = (me - step) % n
            if step < hops:
                blocks.post(step)
            if travelling is not None:
                forward.wait()  # before computing: the block gradient sent last step is released first
            grad = block_grad(span, src, blocks.kv(src), shard, dout, dq, opts)
            if travelling is not None:
                _add_halves_(grad, travelling)
            if step < hops:
                blocks.arrive(last=step == hops - 1)
            last = step == hops
            if last:
                del blocks  # the last block is done: its buffer goes before the gradient's transfer buffers exist
            to = me if last else (src - 1) % n
            travelling = received.view(0, span.block_numel(to, batch, *dims))
            _send_halves(home if last else forward, grad, travelling, span.k_numel(to, batch, dims[0]), step)
            del grad
        home.wait()  # the last transfer: my block's gradient, home
        return travelling


register_exchange("ring", RingExchange())
