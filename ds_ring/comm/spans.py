"""Spans: lists of distinct *global* ranks taking part in one transfer (a caller's sub-ring)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from ds_ring.comm.group_ranks import global_ranks, group_rank, group_size

__all__ = ["group_members", "span_position"]


def group_members(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (``None``: the world) in group-rank order; ``[0]`` without a process group."""
    return global_ranks(group, range(group_size(group)))


def span_position(span: Sequence[int], group: dist.ProcessGroup | None) -> int:
    """Index of this rank in ``span``, after checking the span's ranks are distinct members of ``group``."""
    span = list(span)
    rank = group_rank(None)
    if len(set(span)) != len(span):
        raise ValueError(f"ds_ring: span {span} repeats a rank")
    outside = sorted(set(span) - set(group_members(group)))
    if outside:
        raise ValueError(f"ds_ring: ranks {outside} of span {span} are not in the process group")
    if rank not in span:
        raise ValueError(f"ds_ring: rank {rank} called a collective over span {span} it is not part of")
    return span.index(rank)
