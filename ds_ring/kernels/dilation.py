"""Dilated-attention bookkeeping: branches, head groups, segment runs and argument checks.

Pure index math shared by the single-process kernel and every distributed strategy
(docs/design.md §Dilated attention):

- a *branch* ``(w, r)`` cuts the sequence into segments of length ``w`` (the last may be shorter);
- head ``h`` (global index ``head_offset + h``) keeps, inside each segment, the positions
  ``o, o + r, o + 2r, ...`` with ``o = (head_offset + h) % r``;
- heads sharing an offset form a *head group*; they are the strided slice ``first::r`` of the
  local heads, so selecting them is a view, not a copy;
- a packed sequence (``cu_seqlens``, docs/design.md §Packed sequences) restarts segments and offsets at every document's
  first token, and a document shorter than a segment clamps it to its own length: a *region* is a
  stretch of rows starting at a segment boundary and holding whole segments of one branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from ds_ring.kernels.spans import spans_within

__all__ = [
    "Branch",
    "Region",
    "check_cu_seqlens",
    "document_regions",
    "HeadGroup",
    "SegmentRun",
    "Lengths",
    "check_branches",
    "make_branches",
    "head_groups",
    "segment_runs",
    "kept_rows",
    "select_heads",
    "add_heads_",
    "validate_qkv",
    "check_softcap",
]


@dataclass(frozen=True)
class Branch:
    """One LongNet branch: segment length ``segment`` (already clamped to the sequence) and ``rate``."""

    segment: int
    rate: int


@dataclass(frozen=True)
class Region:
    """Rows ``rows`` (contiguous, starting at a segment boundary) made of whole segments of ``branch``.

    Every segment is ``branch.segment`` rows long except possibly the last, which ends its document.
    ``spans``: bidirectional spans inside the rows (dense causal attention: one segment), relative to its first row
    (:mod:`ds_ring.kernels.spans`); ``()``: none.
    """

    rows: slice
    branch: Branch
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class HeadGroup:
    """Query heads ``first, first + rate, ...`` (local indices) that keep positions ``≡ offset (mod rate)``.

    ``kv_index`` maps each of those query heads to its K/V head (GQA); ``None`` when the K/V heads
    are the query heads themselves, so the same strided slice selects them. ``kv_list`` is the same map as host
    ints: per-head kernel calls slice by it, so no call reads the device tensor back.
    """

    offset: int
    first: int
    rate: int
    kv_index: torch.Tensor | None
    kv_list: tuple[int, ...] | None = None

    @property
    def q_heads(self) -> slice:
        return slice(self.first, None, self.rate)

    @property
    def kv_heads(self) -> slice | torch.Tensor:
        """The K/V head of each query head of the group, for :func:`select_heads`."""
        return self.q_heads if self.kv_index is None else self.kv_index


@dataclass(frozen=True)
class SegmentRun:
    """``count`` consecutive segments of ``length`` rows starting at row ``start``."""

    start: int
    length: int
    count: int


class Lengths(tuple):
    """A branch list (segment lengths or dilation rates) :func:`check_branches` has validated: passed on as it is,
    it is never validated again (the one proof an :class:`~ds_ring.strategies.AttentionCall` carries)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(list(self))  # as the lists users write, in messages


def check_branches(
    segment_lengths: Sequence[int] | None, dilation_rates: Sequence[int] | None
) -> tuple[Lengths, Lengths] | tuple[None, None]:
    """The branch lists as :class:`Lengths`, validated unless they already are (``(None, None)``: dense)."""
    if isinstance(segment_lengths, Lengths) and isinstance(dilation_rates, Lengths):
        return segment_lengths, dilation_rates
    if segment_lengths is None and dilation_rates is None:
        return None, None
    return _validated_branches(segment_lengths, dilation_rates)


def _validated_branches(
    segment_lengths: Sequence[int] | None, dilation_rates: Sequence[int] | None
) -> tuple[Lengths, Lengths]:
    if segment_lengths is None or dilation_rates is None:
        missing = "segment_lengths" if segment_lengths is None else "dilation_rates"
        raise ValueError(f"{missing} is None but the other list is given; pass both or neither (dense)")
    segment_lengths, dilation_rates = list(segment_lengths), list(dilation_rates)
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError(
            f"segment_lengths {segment_lengths} and dilation_rates {dilation_rates} must have the same "
            f"length (one rate per segment length), got {len(segment_lengths)} and {len(dilation_rates)}"
        )
    if not segment_lengths:
        raise ValueError("segment_lengths is empty; give at least one (segment, rate) branch")
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        bad = [x for x in values if not isinstance(x, int) or isinstance(x, bool) or x < 1]
        if bad:
            raise ValueError(f"{name} must be integers >= 1, got {values} (bad: {bad})")
    return Lengths(segment_lengths), Lengths(dilation_rates)


def make_branches(
    seq_len: int, segment_lengths: Sequence[int] | None, dilation_rates: Sequence[int] | None
) -> list[Branch]:
    """The branches with each segment clamped to ``seq_len`` (``None`` means dense), the lists validated unless
    they are :class:`Lengths` already."""
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    if segment_lengths is None:
        return [Branch(seq_len, 1)]
    return [Branch(min(w, seq_len), r) for w, r in zip(segment_lengths, dilation_rates, strict=True)]


def check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int] | None, seq_len: int) -> tuple[int, ...] | None:
    """Validate document boundaries ``[0, e1, ..., seq_len]`` (flash-attn varlen convention) as a tuple.

    ``None`` (one document) stays ``None``. ``ValueError`` names what is wrong and the fix.
    """
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor of document boundaries [0, e1, ..., seq_len], got "
                f"shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}; build it with torch.tensor(..., "
                f"dtype=torch.int32)"
            )
        if cu_seqlens.dtype == torch.bool:
            raise ValueError("cu_seqlens must be an integer tensor, got dtype torch.bool")
        bounds = cu_seqlens.tolist()
    else:
        bounds = list(cu_seqlens)
        if any(not isinstance(b, int) or isinstance(b, bool) for b in bounds):
            raise ValueError(f"cu_seqlens must hold integers, got {bounds}")
    shown = bounds if len(bounds) <= 12 else [*bounds[:5], "...", *bounds[-5:]]
    if len(bounds) < 2:
        raise ValueError(f"cu_seqlens must hold at least [0, seq_len], got {shown}")
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {shown}; boundaries are offsets [0, e1, ..., {seq_len}]")
    if bounds[-1] != seq_len:
        raise ValueError(
            f"cu_seqlens must end at the (global) sequence length {seq_len}, got {shown}; the last document ends "
            f"where the sequence ends (pad with a document of its own rather than leave tokens out)"
        )
    if any(b <= a for a, b in pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents), got {shown}")
    return tuple(bounds)


def document_regions(
    seq_len: int,
    segment_lengths: Sequence[int] | None,
    dilation_rates: Sequence[int] | None,
    documents: tuple[int, ...] | None,
    spans: tuple[tuple[int, int], ...] | None = None,
) -> tuple[Region, ...]:
    """Every branch over every document (``documents``: checked ``cu_seqlens``; ``None``: one document), with the
    bidirectional ``spans`` (checked, dense attention) of each document."""
    bounds = documents or (0, seq_len)
    return tuple(
        Region(slice(start, stop), branch, spans_within(spans or (), start, stop))
        for start, stop in pairwise(bounds)
        for branch in make_branches(stop - start, segment_lengths, dilation_rates)
    )


def head_groups(
    num_heads: int, num_kv_heads: int, rate: int, head_offset: int, device: torch.device
) -> list[HeadGroup]:
    """Group the local query heads by dilation offset; one group per offset that has a head."""
    per_kv = num_heads // num_kv_heads
    groups = []
    for offset in range(rate):
        first = (offset - head_offset) % rate
        if first >= num_heads:
            continue
        kv_index = kv_list = None
        if per_kv != 1:
            kv_list = tuple(h // per_kv for h in range(first, num_heads, rate))
            kv_index = torch.tensor(kv_list, dtype=torch.long, device=device)
        groups.append(HeadGroup(offset, first, rate, kv_index, kv_list))
    return groups


def segment_runs(seq_len: int, segment: int) -> list[SegmentRun]:
    """Full segments as one run, then the shorter last segment (if any) as a second run."""
    full, rest = divmod(seq_len, segment)
    runs = [SegmentRun(0, segment, full)] if full else []
    if rest:
        runs.append(SegmentRun(full * segment, rest, 1))
    return runs


def kept_rows(start_in_segment: int, rows: int, offset: int, rate: int) -> slice:
    """Rows of a block kept by a head group.

    The block holds ``rows`` consecutive positions starting at ``start_in_segment`` inside its
    segment; the kept ones are those ``≡ offset (mod rate)``. Returns a slice of the block's rows
    (possibly empty).
    """
    first = (offset - start_in_segment) % rate
    return slice(first, rows, rate)


def select_heads(x: torch.Tensor, heads: slice | torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Heads ``heads`` of ``x`` along ``dim``: a view for a slice, a copy for an index tensor."""
    if isinstance(heads, slice):
        index = [slice(None)] * x.dim()
        index[dim] = heads
        return x[tuple(index)]
    return x.index_select(dim % x.dim(), heads)


def add_heads_(dst: torch.Tensor, heads: slice | torch.Tensor, src: torch.Tensor, dim: int = -2) -> None:
    """``dst[heads] += src`` along ``dim``, accumulating repeated indices (inverse of :func:`select_heads`)."""
    if isinstance(heads, slice):
        index = [slice(None)] * dst.dim()
        index[dim] = heads
        dst[tuple(index)] += src
    else:
        dst.index_add_(dim % dst.dim(), heads, src.to(dst.dtype))


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_offset: int) -> None:
    """Check shapes, dtypes and devices of ``q [batch, seq, heads, head_dim]``, ``k [batch, seq, kv_heads,
    head_dim]`` and ``v [batch, seq, kv_heads, v_head_dim]`` (``v_head_dim`` may differ: multi-head latent
    attention); ``ValueError`` naming the argument and the fix if bad."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, seq and kv_heads ([batch, seq, "
            f"kv_heads, head_dim] layout; only the last dim, v's head dim, may differ); pass one value per key"
        )
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq and head_dim "
            "([batch, seq, heads, head_dim] layout; v alone may have a head dim of its own)"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]}) for grouped-query attention"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset must be an integer >= 0, got {head_offset!r}")


def check_softcap(softcap: object) -> float | None:
    """``softcap`` as a float (``None`` stays ``None``); ``ValueError`` unless it is a finite number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < float("inf"):
        raise ValueError(
            f"softcap must be a finite number > 0 (scores s become softcap·tanh(s / softcap); Gemma 2's "
            f"attn_logit_softcapping is 50.0) or None for uncapped scores, got {softcap!r}"
        )
    return float(softcap)
