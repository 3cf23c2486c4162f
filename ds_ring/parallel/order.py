"""The order of a sequence's shards over the ranks, and cutting / putting back a sequence in that order.

The *order* is what the public ``layout=`` arguments choose (the rank layout is
:class:`~ds_ring.parallel.layout.RankLayout`):

``contiguous``: rank ``r`` of ``p`` holds chunk ``r`` of ``p``.
``zigzag``: the sequence is cut into ``2p`` chunks and rank ``r`` holds chunks ``r`` and
``2p - 1 - r``, which balances causal attention (every rank gets early and late positions).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_gather
from ds_ring.comm.group_ranks import global_ranks, group_rank, group_size
from ds_ring.parallel.topology import Topology, sequence_group

__all__ = ["ORDERS", "check_order", "order_chunks", "shard_sequence", "gather_sequence"]

ORDERS = ("contiguous", "zigzag")
"""The orders of a sequence's shards over the ranks (the values of the ``layout=`` arguments)."""


def check_order(order: str) -> None:
    """``ValueError`` unless ``order`` is one of :data:`ORDERS` (named ``layout`` as the arguments are)."""
    if order not in ORDERS:
        raise ValueError(f"layout must be one of {ORDERS}, got {order!r}")


def order_chunks(rank: int, world_size: int, order: str) -> tuple[int, ...]:
    """Indices of the chunks rank ``rank`` holds, the sequence cut into ``world_size`` (contiguous) or
    ``2·world_size`` (zigzag) equal chunks."""
    check_order(order)
    return (rank,) if order == "contiguous" else (rank, 2 * world_size - 1 - rank)


def _num_chunks(world_size: int, order: str) -> int:
    return len(order_chunks(0, world_size, order)) * world_size


def shard_sequence(
    x: torch.Tensor, group: ProcessGroup | Topology | None = None, *, layout: str = "contiguous", dim: int = 1
) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` along ``dim`` (no communication) over ``group``: a
    process group (``None``: the world) or a :class:`ds_ring.Topology`'s sequence-parallel group.

    Raises ``ValueError`` when the sequence does not split evenly: nothing is padded or dropped.
    """
    group, _ = sequence_group(group)
    world = group_size(group)
    chunks = _num_chunks(world, layout)
    seq_len = x.shape[dim]
    if seq_len % chunks:
        raise ValueError(
            f"sequence length {seq_len} (dim {dim}) must be divisible by {chunks} to shard it over {world} "
            f"ranks with layout={layout!r}; pad or trim the sequence to a multiple of {chunks}"
        )
    pieces = x.chunk(chunks, dim=dim)
    return torch.cat([pieces[i] for i in order_chunks(group_rank(group), world, layout)], dim=dim)


def gather_sequence(
    x_local: torch.Tensor,
    group: ProcessGroup | Topology | None = None,
    *,
    layout: str = "contiguous",
    dim: int = 1,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """The full sequence from every rank's shard: exact inverse of :func:`shard_sequence`.

    Every rank of ``group`` (as in :func:`shard_sequence`) must call it with shards of one shape. The
    all-gather waits at most ``timeout_s`` seconds (``None``: the topology's; 300 s for a plain group).
    Not differentiable.
    """
    group, timeout_s = sequence_group(group, timeout_s)
    world = group_size(group)
    per_rank = len(order_chunks(0, world, layout))
    if x_local.shape[dim] % per_rank:
        raise ValueError(f"a {layout} shard must split into {per_rank} chunks along dim {dim}, got {x_local.shape}")
    if world == 1:
        return x_local
    flat = x_local.contiguous().reshape(-1)
    shards = all_gather(flat, global_ranks(group, range(world)), group=group, op="gather_sequence", timeout_s=timeout_s)
    ordered: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        parts = shard.view(x_local.shape).chunk(per_rank, dim=dim)
        for index, part in zip(order_chunks(rank, world, layout), parts, strict=True):
            ordered[index] = part
    return torch.cat([ordered[i] for i in range(len(ordered))], dim=dim)
