"""Sequence-parallel linear recurrences and causal convolutions, exact across shard boundaries.

:mod:`~ds_ring.recurrent.pieces` places a shard's chunks and documents in the whole sequence;
:mod:`~ds_ring.recurrent.exchange` is the one (differentiable) all-gather of per-chunk summaries;
:mod:`~ds_ring.recurrent.scan` carries states and convolution halos across chunks; :mod:`~ds_ring.recurrent.mixers`
adapts state-space layers' scans to it. ``docs/recurrent.md`` derives it.
"""

from ds_ring.recurrent.pieces import Chunk, Segment, ShardPieces, shard_pieces
from ds_ring.recurrent.scan import SegmentScan, carry_states, causal_conv, run_chunks

__all__ = [
    "Chunk", "Segment", "ShardPieces", "shard_pieces", "SegmentScan", "carry_states", "causal_conv", "run_chunks",
]  # fmt: skip
