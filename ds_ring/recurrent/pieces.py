"""Where a rank's shard sits in the whole sequence: its chunks, and the document segments inside each.

A rank's shard is one chunk of the sequence (``contiguous`` layout) or two (``zigzag``), concatenated. A packed
sequence's documents cut a chunk further into *segments*; only a chunk's first segment may continue a document
begun before the chunk (the state carried in from earlier chunks reaches it, and nothing past its end).
Pure arithmetic on Python ints: no tensor is read, nothing is communicated.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ds_ring.parallel.order import order_chunks

__all__ = ["Segment", "Chunk", "ShardPieces", "shard_pieces"]


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, stop)`` of the local shard (local indices) lying in one document of one chunk.

    ``continues``: the document began before this segment's first token (in an earlier chunk), so the state carried
    into the chunk reaches it. ``document_start``: the global index of its document's first token.
    """

    start: int
    stop: int
    continues: bool
    document_start: int


@dataclass(frozen=True)
class Chunk:
    """One chunk of the shard: global index ``index`` of ``count`` chunks, global tokens ``[begin, end)``, local
    tokens ``[offset, offset + end - begin)``, cut into ``segments`` at document starts."""

    index: int
    begin: int
    end: int
    offset: int
    segments: tuple[Segment, ...]

    @property
    def passes_state(self) -> bool:
        """Whether the state carried into this chunk reaches its end (no document starts inside or at it)."""
        return len(self.segments) == 1 and self.segments[0].continues


@dataclass(frozen=True)
class ShardPieces:
    """A rank's shard as chunks of the whole sequence; ``order[r]`` is the global chunk indices rank ``r`` holds."""

    rank: int
    world: int
    chunks: tuple[Chunk, ...]
    order: tuple[tuple[int, ...], ...]

    @property
    def chunk_count(self) -> int:
        """Chunks of the whole sequence."""
        return sum(len(held) for held in self.order)


def shard_pieces(
    rank: int, world: int, layout: str, shard_len: int, documents: Sequence[int] | None = None
) -> ShardPieces:
    """The chunks and segments of rank ``rank``'s ``shard_len`` tokens.

    Args:
        rank, world: the rank within the sequence-parallel group, and the group's size.
        layout: ``"contiguous"`` or ``"zigzag"`` (:func:`ds_ring.parallel.order.order_chunks`).
        shard_len: tokens this rank holds (every rank holds as many).
        documents: ``(0, e1, ..., S)``: the whole sequence's document boundaries; ``None``: one document.
    """
    order = tuple(order_chunks(r, world, layout) for r in range(world))
    held = order[rank]
    if shard_len % len(held):
        raise ValueError(f"a {layout} shard of {shard_len} tokens does not split into {len(held)} equal chunks")
    size = shard_len // len(held)
    total = size * world * len(held)
    starts = sorted(set(documents[:-1])) if documents is not None else [0]
    if documents is not None and documents[-1] != total:
        raise ValueError(f"documents {tuple(documents)} end at {documents[-1]}, not at the sequence's {total} tokens")
    chunks = []
    for slot, index in enumerate(held):
        begin, end = index * size, (index + 1) * size
        inside = starts[bisect.bisect_right(starts, begin) : bisect.bisect_left(starts, end)]
        cuts = [begin, *inside, end]
        segments = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            document_start = starts[bisect.bisect_right(starts, a) - 1]
            local = slot * size + a - begin
            segments.append(Segment(local, local + b - a, document_start < a, document_start))
        chunks.append(Chunk(index, begin, end, slot * size, tuple(segments)))
    return ShardPieces(rank, world, tuple(chunks), order)
