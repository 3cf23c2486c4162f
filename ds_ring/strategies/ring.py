"""Ring exchange: K/V blocks passed rank to rank around each span; dK/dV travel home with them.

Forward: every member posts the transfer of the block it holds to the next member *before*
computing on it, so the transfer hides behind compute; after ``span.hops`` hops (``n - 1`` for a
full turn) every block has visited every member that needs it. Two K/V buffers, allocated once per
call, alternate: the block being computed on and the one arriving.

Backward (a second ring): K/V blocks rotate again in the same two buffers. Each block's gradient
accumulator travels one step behind it: a member adds the accumulator it receives (into one receive
buffer, allocated once per call) to its own gradient of that block — the kernel's dK/dV as they are
when one call meets the whole block — and sends the sum on; after the last hop it goes home in one
transfer (for a full turn that is the next member, so the ring simply closes). dQ stays local. A
member's own runs are computed last, once the ring's buffers are released, so the shard's dK/dV are
allocated only then. Per rank this holds ``out``, ``dq``, two K/V blocks, the travelling dK/dV and
one block's gradients at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_ring.comm.groups import global_ranks
from ds_ring.comm.ring import RingComm
from ds_ring.kernels.merge import accum_dtype
from ds_ring.strategies.blocks import (
    BlockBuffers,
    Options,
    Shard,
    add_home_grads_,
    backward_own_,
    block_grad,
    block_has_work,
    forward_block_,
    forward_own_,
    new_grad_block,
    pack_block,
    unpack_block,
)
from ds_ring.strategies.plan import SpanPlan
from ds_ring.strategies.sharded import CommSpec, KVGrads, register_exchange

__all__ = ["RingExchange"]


def _ring_comm(span: SpanPlan, comm: CommSpec, op: str, shift: int = 1) -> RingComm:
    """Send to the member ``shift`` places ahead, receive from the one ``shift`` places behind."""
    n, me = len(span.members), span.index
    ranks = global_ranks(comm.group, span.members)
    return RingComm(
        comm.group, send_to=ranks[(me + shift) % n], recv_from=ranks[(me - shift) % n], timeout_s=comm.timeout_s, op=op
    )


def _halves(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dK and dV halves of a flat block gradient."""
    half = flat.numel() // 2
    return flat[:half], flat[half:]


def _add_halves_(grad: tuple[torch.Tensor, torch.Tensor], flat: torch.Tensor) -> None:
    for mine, theirs in zip(grad, _halves(flat), strict=True):
        mine.add_(theirs)


def _send_halves(ring: RingComm, grad: tuple[torch.Tensor, torch.Tensor], into: torch.Tensor, step: int) -> None:
    """Post a block gradient's dK and dV halves to the ring, receiving a flat one into ``into``."""
    for part, buffer in zip(grad, _halves(into), strict=True):
        ring.send_recv(part, buffer)
    ring.commit(step)


class RingExchange:
    """``communication="ring"``: O(seq/p) memory per rank, ``n - 1`` hops per span."""

    def forward(
        self, span: SpanPlan, shard: Shard, comm: CommSpec, opts: Options, overlap: Callable[[], None] | None
    ) -> None:
        n, me, hops = len(span.members), span.index, span.hops
        batch, head_dim = shard.batch, shard.head_dim
        ring = _ring_comm(span, comm, "ring_kv")
        buffers = BlockBuffers(span, batch, head_dim, shard.k.dtype, shard.k.device)
        block = (
            pack_block(span, shard.k, shard.v, buffers.view(0, span.block_numel(me, batch, head_dim))) if hops else None
        )
        for step in range(hops + 1):
            src = (me - step) % n
            if step < hops:
                numel = span.block_numel((src - 1) % n, batch, head_dim)
                incoming = ring.send_recv(block, buffers.view((step + 1) % 2, numel))
                ring.commit(step)
            if step == 0:
                if overlap is not None:
                    overlap()
                forward_own_(span, shard, opts)
            elif block_has_work(span, src, opts.causal):
                forward_block_(span, src, unpack_block(span, src, block, batch, head_dim), shard, opts)
            if step < hops:
                ring.wait()
                block = incoming

    def backward(
        self,
        span: SpanPlan,
        shard: Shard,
        dout: torch.Tensor,
        dq: torch.Tensor,
        kv_grads: KVGrads,
        comm: CommSpec,
        opts: Options,
    ) -> None:
        home = self._ring_backward(span, shard, dout, dq, comm, opts) if span.hops else None
        dk, dv = kv_grads()
        backward_own_(span, shard, dout, dq, dk, dv, opts)
        if home is not None:
            add_home_grads_(span, unpack_block(span, span.index, home, shard.batch, shard.head_dim), dk, dv)

    def _ring_backward(
        self, span: SpanPlan, shard: Shard, dout: torch.Tensor, dq: torch.Tensor, comm: CommSpec, opts: Options
    ) -> torch.Tensor:
        """The blocks' turn of the backward: accumulates into ``dq``; returns this member's block
        gradient, home (flat, in the receive buffer)."""
        n, me, hops = len(span.members), span.index, span.hops
        batch, head_dim = shard.batch, shard.head_dim
        kv_ring, grad_ring = _ring_comm(span, comm, "ring_kv"), _ring_comm(span, comm, "ring_dkv")
        kv_buffers = BlockBuffers(span, batch, head_dim, shard.k.dtype, shard.k.device)
        received = BlockBuffers(span, batch, head_dim, accum_dtype(shard.q.dtype), shard.q.device)
        block = pack_block(span, shard.k, shard.v, kv_buffers.view(0, span.block_numel(me, batch, head_dim)))
        grad = _halves(new_grad_block(span, me, shard))  # my block's accumulator starts empty
        travelling = received.view(0, 0)
        for step in range(hops + 1):
            src = (me - step) % n
            if step < hops:
                numel = span.block_numel((src - 1) % n, batch, head_dim)
                incoming = kv_ring.send_recv(block, kv_buffers.view((step + 1) % 2, numel))
                kv_ring.commit(step)
            if step > 0:
                grad_ring.wait()  # before computing: the block gradient sent last step is released first
                grad = None
                kv = unpack_block(span, src, block, batch, head_dim)
                grad = block_grad(span, src, kv, shard, dout, dq, opts)
                _add_halves_(grad, travelling)
            if step < hops:
                kv_ring.wait()
                block = incoming
            last = step == hops
            ring = grad_ring if not last or hops == n - 1 else _ring_comm(span, comm, "ring_dkv", shift=-hops)
            travelling = received.view(0, span.block_numel(me if last else (src - 1) % n, batch, head_dim))
            _send_halves(ring, grad, travelling, step)
        ring.wait()  # the last transfer: my block's gradient, home
        return travelling


register_exchange("ring", RingExchange())
