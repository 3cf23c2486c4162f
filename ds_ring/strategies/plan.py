"""Where every branch of a dilated attention lives on sequence shards (docs/design.md §Sharding across ranks).

The sequence of ``S = P·L`` rows is held by ``P`` ranks in *pieces*: one per rank (``contiguous``), or
chunks ``p`` and ``2P-1-p`` of ``2P`` (``zigzag``, dense attention only). A branch ``(w, r)`` cuts every
document (the whole sequence, or each document of ``cu_seqlens``) into segments of ``min(w, n)`` rows.

- A segment that lies inside one rank's piece is *local*: computed on the shard, no communication.
  Consecutive local segments of a document form a :class:`~ds_ring.kernels.dilation.Region`.
- A segment that crosses a boundary between ranks *spans* them. Ranks linked by spanning segments
  form a *span* (connected ranks, in rank order = ring order); only the kept (dilated) K/V rows of
  spanning segments travel among the span's members, and ranks outside every span send nothing.

Dense attention is the branch ``(S, 1)``: one segment per document. Without documents and with
``w`` dividing ``L`` (or a multiple of it) this is the classic LongNet picture: local branches and
spans of ``w / L`` ranks.

A member's share of a span is described per head group (heads sharing a dilation offset) by *runs*:
the kept rows of one spanning segment in one of its pieces, with their place in the member's packed
block and their causal position, which decides for every (query run, key run) pair of the same
segment: full, diagonal (causal) or skipped. Runs of different segments (documents) never meet.

Plans are pure functions of their arguments and cached; everything is checked before any
communication, and errors say what to change.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from ds_ring.kernels.dilation import Branch, HeadGroup, Region, check_branches, head_groups
from ds_ring.kernels.spans import Spans, reach, spans_within
from ds_ring.parallel.order import check_order

__all__ = ["Run", "Held", "Travel", "SpanPlan", "ShardPlan", "plan_shards", "pieces"]


@dataclass(frozen=True)
class Run:
    """Kept rows of one spanning segment in one piece of a member, for one head group.

    ``rows``: the member's local rows (step = rate); ``packed``: their place in the member's packed
    block of the group; ``segment``: the segment's first global position (its identity);
    ``position``: the global position where this piece of the segment starts (causal order).
    """

    rows: slice
    packed: slice
    segment: int
    position: int

    @property
    def count(self) -> int:
        """Kept rows in the run."""
        return len(range(self.rows.start, self.rows.stop, self.rows.step or 1))


@dataclass(frozen=True)
class Held:
    """What one span member holds of one head group: its runs, ``count`` kept rows in all."""

    runs: tuple[Run, ...]
    count: int


@dataclass(frozen=True)
class Travel:
    """The K/V heads that travel for a head group, and how to expand them to its query heads (GQA).

    ``select`` indexes the K/V heads (a strided slice without GQA); ``expand`` maps each query head
    of the group to a travelled head (``None``: one travelled head per query head, in order), as host ints.
    """

    select: slice | torch.Tensor
    expand: tuple[int, ...] | None
    num_heads: int


@dataclass(frozen=True)
class SpanPlan:
    """One branch's spanning segments among the ranks they link, seen from one member.

    ``members`` are group-local ranks in ring order, ``index`` is this rank's position among them.
    ``held[i][g]``: the runs of head group ``g`` that member ``i`` sends (its block: only rows another
    member attends to); ``queries[g]``: all of this rank's runs (its queries, and its keys for itself).
    ``hops``: how far a block must travel forward around the ring so every member that needs it has
    seen it (``len(members) - 1`` for a full turn; fewer when causality or documents make the far
    members need nothing).

    With bidirectional ``spans`` (dense causal attention, docs/design.md §Bidirectional spans) a rank's own runs
    meet as the spans say, and the other members' blocks as causal attention does; a second plan of the same
    ranks, ``ahead``, has its members in *descending* order, so its blocks travel backwards: each holds only the
    rows of a span that an earlier member's queries reach into, and meets those queries only (no own runs).
    """

    branch: Branch
    members: tuple[int, ...]
    index: int
    groups: tuple[HeadGroup, ...]
    travel: tuple[Travel, ...]
    held: tuple[tuple[Held, ...], ...]
    queries: tuple[Held, ...]
    hops: int
    spans: Spans | None = None
    ahead: bool = False

    def block_numel(self, member: int, batch: int, head_dim: int, v_head_dim: int | None = None) -> int:
        """Elements of member's packed K/V block (K then V, every head group); K rows have ``head_dim``
        elements, V rows ``v_head_dim`` (``None``: ``head_dim``)."""
        rows_heads = sum(h.count * t.num_heads for h, t in zip(self.held[member], self.travel, strict=True))
        return batch * rows_heads * (head_dim + (head_dim if v_head_dim is None else v_head_dim))

    def k_numel(self, member: int, batch: int, head_dim: int) -> int:
        """Elements of the K part of member's packed block (the V part follows it)."""
        rows_heads = sum(h.count * t.num_heads for h, t in zip(self.held[member], self.travel, strict=True))
        return batch * rows_heads * head_dim


@dataclass(frozen=True)
class ShardPlan:
    """Regions computed on the shard and spans shared with other ranks, for one rank of the group."""

    local: tuple[Region, ...]
    spans: tuple[SpanPlan, ...]
    seq_len: int


@dataclass(frozen=True)
class _Piece:
    """Global rows ``[start, stop)`` held by ``rank`` from its local row ``local`` on."""

    start: int
    stop: int
    rank: int
    local: int


def _travel(group: HeadGroup, num_heads: int) -> Travel:
    if group.kv_index is None:
        return Travel(group.q_heads, None, len(range(group.first, num_heads, group.rate)))
    kv = group.kv_list
    unique = sorted(set(kv))
    if len(unique) == len(kv):
        return Travel(group.kv_index, None, len(unique))
    select = torch.tensor(unique, dtype=torch.long, device=group.kv_index.device)
    return Travel(select, tuple(unique.index(j) for j in kv), len(unique))


def _sequence_pieces(local_len: int, world_size: int, zigzag: bool) -> list[_Piece]:
    """Every rank's pieces in sequence order; adjacent pieces of one rank merged (zigzag's middle)."""
    if not zigzag:
        return [_Piece(r * local_len, (r + 1) * local_len, r, 0) for r in range(world_size)]
    half = local_len // 2
    chunks = [(c, c if c < world_size else 2 * world_size - 1 - c) for c in range(2 * world_size)]
    pieces_: list[_Piece] = []
    for c, rank in chunks:
        local = 0 if c < world_size else half
        if pieces_ and pieces_[-1].rank == rank:
            last = pieces_[-1]
            pieces_[-1] = _Piece(last.start, (c + 1) * half, rank, last.local)
        else:
            pieces_.append(_Piece(c * half, (c + 1) * half, rank, local))
    return pieces_


def _local_regions(
    mine: list[_Piece], start: int, stop: int, segment: int, rate: int, spans: Spans | None = None
) -> list[Region]:
    """Whole segments of document ``[start, stop)`` inside this rank's pieces, as regions of local rows (with the
    bidirectional ``spans`` inside them)."""
    regions = []
    for piece in mine:
        a, b = max(piece.start, start), min(piece.stop, stop)
        if a >= b:
            continue
        a = start + -(-(a - start) // segment) * segment  # first segment start at or after a
        if b != stop:
            b = start + (b - start) // segment * segment  # last segment end at or before b
        if a < b:
            rows = slice(piece.local + a - piece.start, piece.local + b - piece.start)
            regions.append(Region(rows, Branch(segment, rate), spans_within(spans or (), a, b)))
    return regions


def _spanning_segments(cuts: list[int], start: int, stop: int, segment: int) -> list[tuple[int, int]]:
    """Segments of document ``[start, stop)`` that contain a cut between two ranks' pieces."""
    found: list[tuple[int, int]] = []
    for cut in cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, stop)]:
        if (cut - start) % segment:
            first = start + (cut - start) // segment * segment
            if not found or found[-1][0] != first:
                found.append((first, min(first + segment, stop)))
    return found


def _runs(portions: list[tuple[int, int, int, _Piece]], group: HeadGroup) -> list[Run]:
    """Kept rows of a member's portions ``(segment, start, stop, piece)`` of spanning segments."""
    runs = []
    for segment, start, stop, piece in portions:
        first = start + (group.offset - (start - segment)) % group.rate
        if first >= stop:
            continue
        n = (stop - 1 - first) // group.rate + 1
        row = piece.local + first - piece.start
        runs.append(Run(slice(row, row + n * group.rate, group.rate), slice(0, n), segment, start))
    return runs


def _packed(runs: list[Run]) -> Held:
    """``runs`` laid side by side in a block, in order."""
    placed, count = [], 0
    for run in runs:
        n = run.packed.stop
        placed.append(Run(run.rows, slice(count, count + n), run.segment, run.position))
        count += n
    return Held(tuple(placed), count)


def _meets(query: Run, key: Run, causal: bool, window: int | None = None, spans: Spans | None = None) -> bool:
    """Whether any query of ``query`` attends to a key of ``key``: same segment, not in its future (with ``spans``:
    not past the reach of its last query; rate-1 runs), and with a ``window`` (rate-1 runs: consecutive positions)
    the last key within the window of the first query."""
    if query.segment != key.segment:
        return False
    if causal and key.position > (query.position if spans is None else _reach(query, spans)):
        return False
    return window is None or key.position + key.count - 1 > query.position - window


def _reach(query: Run, spans: Spans) -> int:
    """The last key position any query of a rate-1 run sees under ``spans``."""
    return reach(spans, query.position + query.count - 1)


def _ahead(query: Run, key: Run, spans: Spans) -> bool:
    """Whether ``key`` lies in ``query``'s future and a span of ``query`` reaches into it (rate-1 runs)."""
    return query.segment == key.segment and query.position < key.position <= _reach(query, spans)


def _within_reach(key: Run, queries: list[Run], window: int | None) -> Run:
    """``key`` cut to the rows some of ``queries`` attend to (all of it without a ``window``): with a window,
    from the first query's window start to the last query (rate-1 runs)."""
    if window is None:
        return key
    first = max(key.position, min(q.position for q in queries) - window + 1)
    last = min(key.position + key.count, max(q.position + q.count for q in queries))
    start = key.rows.start + first - key.position
    return Run(slice(start, start + last - first), slice(0, last - first), key.segment, first)


def _blocks(
    runs: list[list[list[Run]]], needed: Callable[[int, int, Run], tuple[Run | None, list[int]]]
) -> tuple[tuple[tuple[Held, ...], ...], int]:
    """What each member's block holds, per head group (``runs[i][g]``: member ``i``'s key runs in group ``g``), and
    the hops to the farthest reader: ``needed(i, g, key)`` gives the part of ``key`` that other members read and
    which members read it (none: ``key`` stays home)."""
    n, hops, held = len(runs), 0, []
    for i in range(n):
        sent = []
        for g in range(len(runs[i])):
            parts = []
            for key in runs[i][g]:
                part, users = needed(i, g, key)
                if users:
                    parts.append(part)
                    hops = max([hops] + [(j - i) % n for j in users])
            sent.append(_packed(parts))
        held.append(tuple(sent))
    return tuple(held), hops


@dataclass(frozen=True)
class _Linked:
    """One branch's span as :func:`plan_shards` finds it: its members (rank order), each member's portions of the
    spanning segments, this rank, and the head groups with how each travels."""

    branch: Branch
    members: list[int]
    rank: int
    portions: dict[int, list[tuple[int, int, int, _Piece]]]
    groups: list[HeadGroup]
    travel: list[Travel]

    def runs(self, order: list[int]) -> list[list[list[Run]]]:
        """``[i][g]``: the runs of head group ``g`` in the portions of member ``order[i]``."""
        return [[_runs(self.portions.get(m, []), g) for g in self.groups] for m in order]

    def plan(
        self,
        order: list[int],
        runs: list[list[list[Run]]],
        needed: Callable[[int, int, Run], tuple[Run | None, list[int]]],
        spans: Spans | None,
        ahead: bool = False,
    ) -> SpanPlan:
        """The plan of blocks travelling through the members in ``order`` (:func:`_blocks` with ``needed``)."""
        held, hops = _blocks(runs, needed)
        index = order.index(self.rank)
        queries = tuple(_packed(r) for r in runs[index])
        members, groups, travel = tuple(order), tuple(self.groups), tuple(self.travel)
        return SpanPlan(self.branch, members, index, groups, travel, held, queries, hops, spans, ahead=ahead)


def _span(linked: _Linked, causal: bool, window: int | None, spans: Spans | None = None) -> SpanPlan:
    """Each member's block holds only the runs (and with a window only the rows) another member attends to;
    hops reach the farthest such member (with ``spans``: as causal attention; the look-ahead is
    :func:`_ahead_span`'s)."""
    runs = linked.runs(linked.members)

    def needed(i: int, g: int, key: Run) -> tuple[Run | None, list[int]]:
        readers = {j: [q for q in runs[j][g] if _meets(q, key, causal, window)] for j in range(len(runs)) if j != i}
        users = [j for j, queries in readers.items() if queries]
        return (_within_reach(key, [q for j in users for q in readers[j]], window) if users else None), users

    return linked.plan(linked.members, runs, needed, spans)


def _ahead_span(linked: _Linked, spans: Spans) -> SpanPlan | None:
    """The backward-travelling plan of a span's look-ahead rows (``None`` when no span reaches an earlier member):
    members in descending order; each block holds, of each key run, the rows from its start to the farthest reach
    of an earlier member's query run into it."""
    order = sorted(linked.members, reverse=True)
    runs = linked.runs(order)

    def needed(i: int, g: int, key: Run) -> tuple[Run | None, list[int]]:
        readers = [(j, q) for j in range(len(runs)) if j != i for q in runs[j][g] if _ahead(q, key, spans)]
        if not readers:
            return None, []
        rows = min(key.position + key.count, max(_reach(q, spans) for _, q in readers) + 1) - key.position
        start = key.rows.start
        return Run(slice(start, start + rows), slice(0, rows), key.segment, key.position), [j for j, _ in readers]

    plan = linked.plan(order, runs, needed, spans, ahead=True)
    return plan if plan.hops else None


def _branch_specs(seq_len: int, segment_lengths: Sequence[int] | None, dilation_rates: Sequence[int] | None):
    """The ``(w, r)`` pairs of lists :func:`plan_shards` has checked (dense: one segment of the sequence)."""
    if segment_lengths is None:
        return [(seq_len, 1)]
    return list(zip(segment_lengths, dilation_rates, strict=True))


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
    causal: bool = False,
    documents: tuple[int, ...] | None = None,
    window: int | None = None,
    spans: Spans | None = None,
) -> ShardPlan:
    """Plan one rank's share of a dilated attention over ``world_size`` equal shards of ``local_len``.

    ``documents``: checked ``cu_seqlens`` over the global sequence (:func:`ds_ring.kernels.dilation.
    check_cu_seqlens`), ``None`` for one document. ``causal`` only trims how far blocks travel; a sliding
    ``window`` (dense attention) trims them further, to the previous ranks within reach and the rows a
    window reaches into them. ``spans``: checked bidirectional spans (dense causal attention,
    :func:`ds_ring.kernels.spans.resolve_spans`): a span crossing into a later rank adds a plan of its look-ahead
    rows, travelling backwards (:class:`SpanPlan`).

    Raises:
        ValueError: a layout or branch combination that cannot be supported, naming the constraint
            and what would satisfy it.
    """
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    return _plan(
        local_len, num_heads, num_kv_heads, rank, world_size, segment_lengths, dilation_rates, layout, head_offset,
        torch.device(device), causal, documents, window, spans,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _plan(
    local_len: int,
    num_heads: int,
    num_kv_heads: int,
    rank: int,
    world_size: int,
    segment_lengths: tuple[int, ...] | None,
    dilation_rates: tuple[int, ...] | None,
    layout: str,
    head_offset: int,
    device: torch.device,
    causal: bool,
    documents: tuple[int, ...] | None,
    window: int | None,
    spans: Spans | None = None,
) -> ShardPlan:
    check_order(layout)
    seq_len = local_len * world_size
    specs = _branch_specs(seq_len, segment_lengths, dilation_rates)
    zigzag = layout == "zigzag" and world_size > 1
    if zigzag:
        if any(w < seq_len or r != 1 for w, r in specs):
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
    sequence = _sequence_pieces(local_len, world_size, zigzag)
    starts = [p.start for p in sequence]
    cuts = starts[1:]
    mine = [p for p in sequence if p.rank == rank]
    bounds = documents or (0, seq_len)
    local: list[Region] = []
    plans: list[SpanPlan] = []
    for w, r in specs:
        spanning: list[tuple[int, int]] = []
        for start, stop in pairwise(bounds):
            segment = min(w, stop - start)
            local += _local_regions(mine, start, stop, segment, r, spans)
            spanning += _spanning_segments(cuts, start, stop, segment)
        span = _span_of(rank, spanning, sequence, starts)
        if span is None:
            continue
        members, portions = span
        groups = head_groups(num_heads, num_kv_heads, r, head_offset, device)
        travel = [_travel(g, num_heads) for g in groups]
        linked = _Linked(Branch(min(w, seq_len), r), members, rank, portions, groups, travel)
        plans.append(_span(linked, causal, window, spans))
        if spans:
            ahead = _ahead_span(linked, spans)
            if ahead is not None:
                plans.append(ahead)
    return ShardPlan(tuple(local), tuple(plans), seq_len)


def _span_of(
    rank: int, spanning: list[tuple[int, int]], sequence: list[_Piece], starts: list[int]
) -> tuple[list[int], dict[int, list[tuple[int, int, int, _Piece]]]] | None:
    """The ranks linked to ``rank`` by spanning segments, and each one's portions of them (``None``: none)."""
    parent = list(range(len({p.rank for p in sequence})))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    touched = []
    for first, stop in spanning:
        lo, hi = bisect.bisect_right(starts, first) - 1, bisect.bisect_left(starts, stop)
        parts = [(first, max(first, p.start), min(stop, p.stop), p) for p in sequence[lo:hi]]
        touched.append(parts)
        for part in parts[1:]:
            parent[root(part[3].rank)] = root(parts[0][3].rank)
    mine = root(rank)
    members = sorted(r for r in range(len(parent)) if root(r) == mine)
    if len(members) < 2:
        return None
    portions: dict[int, list[tuple[int, int, int, _Piece]]] = {}
    for parts in touched:
        if root(parts[0][3].rank) == mine:
            for part in parts:
                portions.setdefault(part[3].rank, []).append(part)
    return members, portions


def pieces(
    queries: Held,
    keys: Held,
    causal: bool,
    window: int | None = None,
    spans: Spans | None = None,
    ahead: bool = False,
) -> list[tuple[Run, Run, bool]]:
    """The (query run, key run, causal_diagonal) pairs to compute for one head group.

    Runs of one segment only, future blocks left out (and with a ``window``, blocks out of its reach; with
    ``spans``, blocks past every span's reach); the diagonal is a run meeting itself. ``ahead``: only the key runs
    in the queries' future that a span reaches into (an ``ahead`` plan's blocks).
    """
    if ahead:
        return [(a, b, False) for a in queries.runs for b in keys.runs if _ahead(a, b, spans)]
    return [
        (a, b, causal and a.position == b.position)
        for a in queries.runs
        for b in keys.runs
        if _meets(a, b, causal, window, spans)
    ]
