"""Where every branch of a dilated attention lives on sequence shards (DESIGN.md §2, LongNet §3.2).

With ``P`` ranks each holding ``L`` rows (total ``S = P·L``):

- a branch with ``w <= L`` and ``L % w == 0`` is *local*: no communication;
- a branch with ``w > L`` and ``w % L == 0`` *spans* the ``w / L`` ranks of each segment (the last
  span may be shorter); only the kept (dilated) K/V rows of a span travel among its members.

Dense attention is the branch ``(S, 1)``: one span of all ranks. The ``zigzag`` layout (rank ``p``
holds chunks ``p`` and ``2P-1-p`` of ``2P``) is supported for dense attention only.

A member's share of a span is described per head group (heads sharing a dilation offset) by the
kept rows of its local shard and by *chunks* of those rows with their position in the causal order,
which decides for every (query chunk, key chunk) pair: full, diagonal (causal) or skipped.

Everything here is checked before any communication, and errors say what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds_ring.kernels.dilation import Branch, HeadGroup, head_groups, kept_rows, make_branches

__all__ = ["Chunk", "Held", "Travel", "SpanPlan", "ShardPlan", "plan_shards", "pieces", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """Rows ``rows`` of a member's kept block, at position ``order`` in the causal order."""

    rows: slice
    order: int


@dataclass(frozen=True)
class Held:
    """What one span member holds of one head group: kept rows of its local shard, and chunks of them."""

    rows: slice
    count: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Travel:
    """The K/V heads that travel for a head group, and how to expand them to its query heads (GQA).

    ``select`` indexes the K/V heads (a strided slice without GQA); ``expand`` maps each query head
    of the group to a travelled head (``None``: one travelled head per query head, in order).
    """

    select: slice | torch.Tensor
    expand: torch.Tensor | None
    num_heads: int


@dataclass(frozen=True)
class SpanPlan:
    """One branch whose segments span several ranks, seen from one member of its span.

    ``members`` are group-local ranks in sequence order (= ring order), ``index`` is this rank's
    position among them, ``held[i][g]`` is member ``i``'s share of head group ``g``.
    """

    branch: Branch
    members: tuple[int, ...]
    index: int
    groups: tuple[HeadGroup, ...]
    travel: tuple[Travel, ...]
    held: tuple[tuple[Held, ...], ...]

    def block_numel(self, member: int, batch: int, head_dim: int) -> int:
        """Elements of member's packed K/V block (K then V, every head group)."""
        rows_heads = sum(h.count * t.num_heads for h, t in zip(self.held[member], self.travel, strict=True))
        return 2 * batch * rows_heads * head_dim


@dataclass(frozen=True)
class ShardPlan:
    """Branches computed locally and branches spanning ranks, for one rank of the group."""

    local: tuple[Branch, ...]
    spans: tuple[SpanPlan, ...]
    seq_len: int


def _travel(group: HeadGroup, num_heads: int) -> Travel:
    if group.kv_index is None:
        return Travel(group.q_heads, None, len(range(group.first, num_heads, group.rate)))
    unique = torch.unique(group.kv_index)
    if unique.numel() == group.kv_index.numel():
        return Travel(group.kv_index, None, unique.numel())
    return Travel(unique, torch.searchsorted(unique, group.kv_index), unique.numel())


def _span_plan(
    branch: Branch,
    members: tuple[int, ...],
    index: int,
    groups: list[HeadGroup],
    travel: list[Travel],
    local_len: int,
    zigzag_world: int | None,
) -> SpanPlan:
    held = []
    for j, member in enumerate(members):
        per_group = []
        for group in groups:
            if zigzag_world is not None:
                half = local_len // 2
                chunks = (Chunk(slice(0, half), member), Chunk(slice(half, local_len), 2 * zigzag_world - 1 - member))
                per_group.append(Held(slice(0, local_len), local_len, chunks))
                continue
            rows = kept_rows(j * local_len, local_len, group.offset, group.rate)
            count = len(range(rows.start, local_len, rows.step))
            per_group.append(Held(rows, count, (Chunk(slice(0, count), j),)))
        held.append(tuple(per_group))
    return SpanPlan(branch, members, index, tuple(groups), tuple(travel), tuple(held))


def plan_shards(
    local_len: int,
    num_heads: int,
    num_kv_heads: int,
    rank: int,
    world_size: int,
    segment_lengths: Sequence[int] | None,
    dilation_rates: Sequence[int] | None,
    *,
    layout: str = "contiguous",
    head_offset: int = 0,
    device: torch.device | str = "cpu",
) -> ShardPlan:
    """Plan one rank's share of a dilated attention over ``world_size`` equal shards of ``local_len``.

    Raises:
        ValueError: a layout, segment or shard combination that cannot be supported, naming the
            constraint and what would satisfy it.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    seq_len = local_len * world_size
    branches = make_branches(seq_len, segment_lengths, dilation_rates)
    dense = segment_lengths is None or all(b == Branch(seq_len, 1) for b in branches)
    zigzag = layout == "zigzag" and world_size > 1
    if zigzag:
        if not dense:
            raise ValueError(
                f"layout='zigzag' supports dense attention only, got segment_lengths={list(segment_lengths)} "
                f"dilation_rates={list(dilation_rates)}; use layout='contiguous' for dilated attention"
            )
        if local_len % 2:
            raise ValueError(
                f"layout='zigzag' splits each shard into two chunks, so the local sequence length must be "
                f"even, got {local_len} (total {seq_len} over {world_size} ranks); make the total sequence "
                f"a multiple of {2 * world_size}"
            )
    device = torch.device(device)
    local, spans = [], []
    for branch in branches:
        w = branch.segment
        if w <= local_len:
            if local_len % w:
                raise ValueError(
                    f"segment length {w} is shorter than the local shard ({local_len} rows = {seq_len} / "
                    f"{world_size} ranks) but does not divide it, so segments would straddle shards; use a "
                    f"segment length that divides {local_len} or a multiple of it"
                )
            local.append(branch)
            continue
        if w % local_len:
            raise ValueError(
                f"segment length {w} spans several shards of {local_len} rows ({seq_len} / {world_size} "
                f"ranks) but is not a multiple of the shard length; use a multiple of {local_len} or a "
                f"divisor of it"
            )
        groups = head_groups(num_heads, num_kv_heads, branch.rate, head_offset, device)
        travel = [_travel(g, num_heads) for g in groups]
        span_ranks = w // local_len
        first = rank // span_ranks * span_ranks
        members = tuple(range(first, min(first + span_ranks, world_size)))
        spans.append(
            _span_plan(branch, members, rank - first, groups, travel, local_len, world_size if zigzag else None)
        )
    return ShardPlan(tuple(local), tuple(spans), seq_len)


def pieces(mine: tuple[Chunk, ...], theirs: tuple[Chunk, ...], causal: bool) -> list[tuple[slice, slice, bool]]:
    """Blocks to compute between my query chunks and a visiting key block's chunks.

    Returns ``(query rows, key rows, causal_diagonal)`` triples; future blocks are left out.
    """
    if not causal:
        return [(slice(None), slice(None), False)]
    out = []
    for a in mine:
        for b in theirs:
            if a.order >= b.order:
                out.append((a.rows, b.rows, a.order == b.order))
    return out
