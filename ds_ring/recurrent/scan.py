"""Linear recurrences and causal convolutions over a sequence split across ranks, exact.

A linear recurrence ``h_t = a_t ⊙ h_{t-1} + u_t`` (``a_t`` a per-head scalar or an elementwise decay; or a matrix
applied from the left, the delta rule's, with ``⊙`` read as that product: ``apply``) run over a chunk from an
initial state ``h_in`` ends in ``h_end = A ⊙ h_in + h_end⁰`` (``A = ∏ a_t``, ``h_end⁰`` the end state from zero)
and outputs ``y_t = y⁰_t + C_t · (∏_{s≤t} a_s ⊙ h_in)``. Each rank runs its chunks from zero, all-gathers every
chunk's ``(A, h_end⁰)`` (:mod:`ds_ring.recurrent.exchange`), folds the earlier chunks' summaries in sequence order
into its true ``h_in`` (:func:`carry_states`) and adds the ``h_in`` term to its outputs (:func:`run_chunks`). A
document starting inside a chunk cuts it: the state carried in reaches only the tokens before that start (``A = 0``
for the chunk). Memory stays that of one shard; the exchange is a few states per rank.

A causal depthwise convolution of width ``k`` needs the ``k - 1`` inputs before each chunk (:func:`causal_conv`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ds_ring.recurrent.exchange import gather_summaries, tie
from ds_ring.recurrent.pieces import ShardPieces

__all__ = ["SegmentScan", "carry_states", "run_chunks", "causal_conv"]


@dataclass(frozen=True)
class SegmentScan:
    """One segment run from a zero state.

    output: its outputs (time along the caller's ``time_dim``).
    final: its end state.
    transition: ``A``, what its steps do to a state they are given (``h_end = A · h_in + final``): a decay
        broadcastable to ``final`` (elementwise), or a matrix acting on it from the left (the delta rule's).
    correct: ``h_in ↦`` what an initial state ``h_in`` (shaped like ``final``) adds to ``output``.
    """

    output: torch.Tensor
    final: torch.Tensor
    transition: torch.Tensor
    correct: Callable[[torch.Tensor], torch.Tensor]


def _summary_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def carry_states(
    pieces: ShardPieces,
    decays: Sequence[torch.Tensor],
    finals: Sequence[torch.Tensor],
    group: ProcessGroup | None,
    *,
    op: str = "recurrent_state",
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.mul,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """The state entering each of this rank's chunks, from every chunk's summary.

    Args:
        pieces: this rank's chunks.
        decays: per chunk of this rank, its transition ``A`` (0 where a document starts in it), one shape for every
            chunk and rank (sent as it is: a per-head decay stays one number per head).
        finals: per chunk, its end state from a zero initial state; one shape for every chunk and rank.
        apply: ``(A, h) ↦`` the state ``h`` after a chunk's steps: ``torch.mul`` for a decay (broadcast),
            ``torch.matmul`` for a matrix.
    Returns:
        per chunk of this rank, ``h_in = Σ_{j < c} (∏_{j < i < c} A_i) · h_end⁰_j`` (global chunk order), shaped like
        ``finals[0]``, in the summaries' dtype (the states' promoted to at least float32).
    """
    shape, decay_shape = finals[0].shape, decays[0].shape
    dtype = _summary_dtype(finals[0].dtype)
    flat = torch.cat([t.reshape(-1).to(dtype) for pair in zip(decays, finals, strict=True) for t in pair])
    gathered = gather_summaries(flat, group, op=op, timeout_s=timeout_s)  # [world, held · (|A| + |h|)]
    sizes = (decays[0].numel(), finals[0].numel())
    summary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for rank, held in enumerate(pieces.order):
        row = gathered[rank].view(len(held), sum(sizes))
        for slot, index in enumerate(held):
            decay, final = row[slot].split(sizes)
            summary[index] = (decay.view(decay_shape), final.view(shape))
    state = torch.zeros(shape, dtype=dtype, device=flat.device)
    entering = {}
    for index in range(pieces.chunk_count):
        entering[index] = state
        decay, final = summary[index]
        state = apply(decay, state) + final
    return [tie(entering[chunk.index], gathered) for chunk in pieces.chunks]


def run_chunks(
    pieces: ShardPieces,
    segment: Callable[[int, int], SegmentScan],
    group: ProcessGroup | None,
    *,
    time_dim: int,
    op: str = "recurrent_state",
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.mul,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """The exact outputs of this rank's shard of a linear recurrence.

    Args:
        pieces: this rank's chunks and segments.
        segment: ``(start, stop) ↦`` the :class:`SegmentScan` of local tokens ``[start, stop)`` from a zero state.
        time_dim: the outputs' time dimension.
        apply: how a transition acts on a state (:func:`carry_states`).
    Returns:
        every segment's output, with the carried state's contribution added, concatenated along ``time_dim``.
    """
    runs = [[segment(s.start, s.stop) for s in chunk.segments] for chunk in pieces.chunks]
    decays = [
        scans[0].transition if chunk.passes_state else torch.zeros_like(scans[0].transition)
        for chunk, scans in zip(pieces.chunks, runs, strict=True)
    ]
    finals = [scans[-1].final for scans in runs]
    entering = carry_states(pieces, decays, finals, group, op=op, apply=apply, timeout_s=timeout_s)
    outputs = []
    for chunk, scans, h_in in zip(pieces.chunks, runs, entering, strict=True):
        for segment_, scan in zip(chunk.segments, scans, strict=True):
            out = scan.output
            if segment_ is chunk.segments[0]:
                if segment_.continues:
                    out = out + scan.correct(h_in.to(scan.final.dtype)).to(out.dtype)
                else:
                    out = tie(out, h_in)
            outputs.append(out)
    return torch.cat(outputs, dim=time_dim)


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pieces: ShardPieces,
    group: ProcessGroup | None,
    *,
    op: str = "recurrent_halo",
    timeout_s: float | None = None,
) -> torch.Tensor:
    """Causal depthwise convolution of this rank's shard, each token seeing the ``k - 1`` before it in its document.

    Args:
        x: ``[batch, channels, shard_len]``.
        weight: ``[channels, k]``; bias: ``[channels]`` or ``None``.
    Returns:
        ``[batch, channels, shard_len]`` in ``weight``'s dtype (no activation), what ``F.conv1d(..., padding=k-1)``
        gives on the whole sequence (zero before each document), restricted to this shard.
    """
    batch, channels, _ = x.shape
    width = weight.shape[-1] - 1
    x = x.to(weight.dtype)
    size = pieces.chunks[0].end - pieces.chunks[0].begin
    if width > size:
        raise ValueError(
            f"a causal convolution of width {width + 1} needs chunks of at least {width} tokens; each rank's chunks "
            f"hold {size}: use longer sequences or fewer sequence-parallel ranks"
        )
    tails = (
        torch.cat([x[:, :, c.offset + size - width : c.offset + size].reshape(-1) for c in pieces.chunks])
        if width
        else x.new_zeros(0)
    )
    gathered = gather_summaries(tails, group, op=op, timeout_s=timeout_s) if width else None
    halo: dict[int, torch.Tensor] = {}
    if gathered is not None:
        for rank, held in enumerate(pieces.order):
            row = gathered[rank].view(len(held), batch, channels, width)
            for slot, index in enumerate(held):
                halo[index + 1] = row[slot]
    outputs = []
    for chunk in pieces.chunks:
        for segment in chunk.segments:
            part = x[:, :, segment.start : segment.stop]
            before = x.new_zeros(batch, channels, width)
            if segment.continues and width:
                before = halo[chunk.index]
                first = chunk.begin - width  # global index of the halo's first row
                if segment.document_start > first:  # the document begins inside the halo: earlier rows are not its
                    keep = torch.arange(first, chunk.begin, device=x.device) >= segment.document_start
                    before = before * keep
            out = F.conv1d(torch.cat([before, part], dim=-1), weight.unsqueeze(1), bias, groups=channels)
            outputs.append(out)
    out = torch.cat(outputs, dim=-1)
    return tie(out, gathered) if gathered is not None else out
