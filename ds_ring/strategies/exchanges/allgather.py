"""All-gather exchange: a span's K/V blocks gathered in one collective; dK/dV reduce-scattered home.

Fewer synchronisations than the ring (one per direction), at the price of holding every block of
the span at once: O(w / r) K/V rows per rank for a branch of segment ``w`` and rate ``r``
(O(seq) for dense attention). The backward gathers the blocks again rather than saving them, so
the memory kept between forward and backward stays O(seq/p).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ds_ring.comm.collectives import all_gather, reduce_scatter
from ds_ring.comm.group_ranks import global_ranks
from ds_ring.strategies.blocks import (
    KV,
    LazyGrads,
    Options,
    Shard,
    backward_block_,
    block_has_work,
    forward_block_,
    forward_own_,
    new_grad_block,
    pack_block,
    unpack_block,
)
from ds_ring.strategies.plan import SpanPlan
from ds_ring.strategies.sharded import CommSpec, Exchange, register_exchange

__all__ = ["AllGatherExchange"]


def _gather_blocks(span: SpanPlan, shard: Shard, comm: CommSpec) -> list[torch.Tensor]:
    numels = [span.block_numel(i, shard.batch, *shard.dims) for i in range(len(span.members))]
    ranks = global_ranks(comm.group, span.members)
    return all_gather(
        pack_block(span, shard.k, shard.v), ranks, group=comm.group, numels=numels, op="allgather_kv",
        timeout_s=comm.timeout_s,
    )  # fmt: skip


def _visiting(
    span: SpanPlan, blocks: list[torch.Tensor], shard: Shard, opts: Options
) -> Iterator[tuple[int, list[KV]]]:
    """``(member, its block's K/V views)`` for every other member whose block this rank's queries meet."""
    for src, block in enumerate(blocks):
        if src != span.index and block_has_work(span, src, opts):
            yield src, unpack_block(span, src, block, shard.batch, shard.dims)


class AllGatherExchange(Exchange):
    """``communication="allgather"``: one all-gather forward, one reduce-scatter backward per span."""

    def forward(
        self, span: SpanPlan, shard: Shard, comm: CommSpec, opts: Options, overlap: Callable[[], None] | None
    ) -> None:
        blocks = _gather_blocks(span, shard, comm)
        if overlap is not None:
            overlap()
        forward_own_(span, shard, opts)
        for src, kv in _visiting(span, blocks, shard, opts):
            forward_block_(span, src, kv, shard, opts)

    def blocks_backward(
        self, span: SpanPlan, shard: Shard, dout: torch.Tensor, dq: LazyGrads, comm: CommSpec, opts: Options
    ) -> torch.Tensor:
        """Gradients of the other members' blocks (into ``dq`` and reduce-scattered); returns my block's, flat."""
        blocks = _gather_blocks(span, shard, comm)
        grads = [new_grad_block(span, i, shard) for i in range(len(blocks))]
        for src, kv in _visiting(span, blocks, shard, opts):
            dkv = unpack_block(span, src, grads[src], shard.batch, shard.dims)
            backward_block_(span, src, kv, dkv, shard, dout, dq, opts)
        ranks = global_ranks(comm.group, span.members)
        return reduce_scatter(grads, ranks, group=comm.group, op="allgather_dkv", timeout_s=comm.timeout_s)


register_exchange("allgather", AllGatherExchange())
