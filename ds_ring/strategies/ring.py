"""Ring exchange: K/V blocks passed rank to rank around each span; dK/dV travel home with them.

Forward: every member posts the transfer of the block it holds to the next member *before*
computing on it, so the transfer hides behind compute; after ``span.hops`` hops (``n - 1`` for a
full turn) every block has visited every member that needs it. At most two remote blocks are alive
at once (the one being computed on and the one arriving).

Backward (a second ring): K/V blocks rotate again, and each block's gradient accumulator travels
one step behind it, collecting every member's contribution; after the last hop it goes home in one
transfer (for a full turn that is the next member, so the ring simply closes). dQ stays local.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_ring.comm.groups import global_ranks
from ds_ring.comm.ring import RingComm
from ds_ring.strategies.blocks import (
    add_home_grads_,
    backward_block_,
    backward_own_,
    block_has_work,
    forward_block_,
    forward_own_,
    new_grad_block,
    pack_block,
    unpack_block,
)
from ds_ring.strategies.plan import SpanPlan
from ds_ring.strategies.sharded import CommSpec, Options, register_exchange

__all__ = ["RingExchange"]


def _ring_comm(span: SpanPlan, comm: CommSpec, op: str, shift: int = 1) -> RingComm:
    """Send to the member ``shift`` places ahead, receive from the one ``shift`` places behind."""
    n, me = len(span.members), span.index
    ranks = global_ranks(comm.group, span.members)
    return RingComm(
        comm.group, send_to=ranks[(me + shift) % n], recv_from=ranks[(me - shift) % n], timeout_s=comm.timeout_s, op=op
    )


class RingExchange:
    """``communication="ring"``: O(seq/p) memory per rank, ``n - 1`` hops per span."""

    def forward(
        self,
        span: SpanPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        comm: CommSpec,
        opts: Options,
        overlap: Callable[[], None] | None,
    ) -> None:
        n, me, hops = len(span.members), span.index, span.hops
        batch, head_dim = q.shape[0], q.shape[-1]
        ring = _ring_comm(span, comm, "ring_kv")
        block = pack_block(span, k, v)
        for step in range(hops + 1):
            src = (me - step) % n
            if step < hops:
                incoming = ring.send_recv(block, recv_shape=(span.block_numel((src - 1) % n, batch, head_dim),))
                ring.commit(step)
            if step == 0:
                if overlap is not None:
                    overlap()
                forward_own_(span, q, k, v, out, lse, causal=opts.causal, scale=opts.scale)
            elif block_has_work(span, src, opts.causal):
                kv = unpack_block(span, src, block, batch, head_dim)
                forward_block_(span, src, kv, q, out, lse, causal=opts.causal, scale=opts.scale)
            if step < hops:
                ring.wait()
                block = incoming

    def backward(
        self,
        span: SpanPlan,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        comm: CommSpec,
        opts: Options,
    ) -> None:
        n, me, hops = len(span.members), span.index, span.hops
        batch, head_dim = q.shape[0], q.shape[-1]
        kv_ring, grad_ring = _ring_comm(span, comm, "ring_kv"), _ring_comm(span, comm, "ring_dkv")
        block = pack_block(span, k, v)
        travelling = None  # the gradient accumulator of the block now held, arriving from the previous member
        for step in range(hops + 1):
            src = (me - step) % n
            if step < hops:
                incoming = kv_ring.send_recv(block, recv_shape=(span.block_numel((src - 1) % n, batch, head_dim),))
                kv_ring.commit(step)
            grad = None
            if step == 0:  # own runs straight into dk/dv; the accumulator of my block starts empty
                backward_own_(span, dout, q, k, v, out, lse, dq, dk, dv, causal=opts.causal, scale=opts.scale)
                grad = new_grad_block(span, src, q, batch, head_dim)
            elif block_has_work(span, src, opts.causal):
                grad = new_grad_block(span, src, q, batch, head_dim)
                kv = unpack_block(span, src, block, batch, head_dim)
                dkv = unpack_block(span, src, grad, batch, head_dim)
                backward_block_(span, src, kv, dkv, dout, q, out, lse, dq, causal=opts.causal, scale=opts.scale)
            if step > 0:
                grad_ring.wait()
                grad = travelling if grad is None else grad.add_(travelling)
            if step < hops:
                kv_ring.wait()
                block = incoming
                next_numel = span.block_numel((src - 1) % n, batch, head_dim)
                travelling = grad_ring.send_recv(grad, recv_shape=(next_numel,))
                grad_ring.commit(step)
        if hops:  # the accumulator of block me - hops goes home; mine arrives from member me + hops
            home = grad_ring if hops == n - 1 else _ring_comm(span, comm, "ring_dkv", shift=-hops)
            grad = home.send_recv(grad, recv_shape=(span.block_numel(me, batch, head_dim),))
            home.commit(hops)
            home.wait()
        add_home_grads_(span, unpack_block(span, me, grad, batch, head_dim), dk, dv)


register_exchange("ring", RingExchange())
