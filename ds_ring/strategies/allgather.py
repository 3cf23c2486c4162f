"""All-gather exchange: a span's K/V blocks gathered in one collective; dK/dV reduce-scattered home.

Fewer synchronisations than the ring (one per direction), at the price of holding every block of
the span at once: O(w / r) K/V rows per rank for a branch of segment ``w`` and rate ``r``
(O(seq) for dense attention). The backward gathers the blocks again rather than saving them, so
the memory kept between forward and backward stays O(seq/p).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds_ring.comm.collectives import all_gather, reduce_scatter
from ds_ring.comm.groups import global_ranks
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
from ds_ring.strategies.sharded import CommSpec, KVGrads, Options, register_exchange

__all__ = ["AllGatherExchange"]


def _gather_blocks(span: SpanPlan, k: torch.Tensor, v: torch.Tensor, comm: CommSpec, batch: int) -> list[torch.Tensor]:
    head_dim = k.shape[-1]
    numels = [span.block_numel(i, batch, head_dim) for i in range(len(span.members))]
    ranks = global_ranks(comm.group, span.members)
    return all_gather(
        pack_block(span, k, v), ranks, group=comm.group, numels=numels, op="allgather_kv", timeout_s=comm.timeout_s
    )


class AllGatherExchange:
    """``communication="allgather"``: one all-gather forward, one reduce-scatter backward per span."""

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
        batch, head_dim = q.shape[0], q.shape[-1]
        blocks = _gather_blocks(span, k, v, comm, batch)
        if overlap is not None:
            overlap()
        forward_own_(span, q, k, v, out, lse, causal=opts.causal, scale=opts.scale)
        for src, block in enumerate(blocks):
            if src != span.index and block_has_work(span, src, opts.causal):
                kv = unpack_block(span, src, block, batch, head_dim)
                forward_block_(span, src, kv, q, out, lse, causal=opts.causal, scale=opts.scale)

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
        kv_grads: KVGrads,
        comm: CommSpec,
        opts: Options,
    ) -> None:
        batch, head_dim = q.shape[0], q.shape[-1]
        mine = self._reduce_block_grads(span, dout, q, k, v, out, lse, dq, comm, opts)
        dk, dv = kv_grads()
        backward_own_(span, dout, q, k, v, out, lse, dq, dk, dv, causal=opts.causal, scale=opts.scale)
        add_home_grads_(span, unpack_block(span, span.index, mine, batch, head_dim), dk, dv)

    def _reduce_block_grads(
        self,
        span: SpanPlan,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        comm: CommSpec,
        opts: Options,
    ) -> torch.Tensor:
        """Gradients of the other members' blocks (into ``dq`` and reduce-scattered); returns my block's, flat."""
        batch, head_dim = q.shape[0], q.shape[-1]
        blocks = _gather_blocks(span, k, v, comm, batch)
        grads = [new_grad_block(span, i, q, batch, head_dim) for i in range(len(blocks))]
        for src, block in enumerate(blocks):
            if src != span.index and block_has_work(span, src, opts.causal):
                kv = unpack_block(span, src, block, batch, head_dim)
                dkv = unpack_block(span, src, grads[src], batch, head_dim)
                backward_block_(span, src, kv, dkv, dout, q, out, lse, dq, causal=opts.causal, scale=opts.scale)
        ranks = global_ranks(comm.group, span.members)
        return reduce_scatter(grads, ranks, group=comm.group, op="allgather_dkv", timeout_s=comm.timeout_s)


register_exchange("allgather", AllGatherExchange())
