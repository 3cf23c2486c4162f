"""Single-process dilated attention with a flash-style custom backward.

Every (branch, segment run, head group) is a batched block-kernel call on the kept rows of its
segments, a long run cut into calls of at most :data:`ROWS_PER_CALL` kept rows; the pieces are
LSE-merged into fp32 (fp64) accumulators. Only the kept rows of one call and one head group are
ever copied, so a call's extra memory is bounded by ``ROWS_PER_CALL × heads × head_dim`` whatever
the sequence, and a ``seq × seq`` matrix never exists. The backward recomputes each piece with the
*final* ``out``/``lse`` (docs/design.md §The LSE merge), which is exact also when branches overlap.

Token layout helpers: a tensor in *token layout* is ``[*lead, rows, heads, head_dim]`` (``lead`` is
batch × segments); the block kernels want ``[N, heads, rows, head_dim]``. ``v`` may have a head dim ``Dv`` of
its own (multi-head latent attention): ``out``, ``dout`` and the output accumulator have ``Dv``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ds_ring.kernels.block import block_backward, block_forward
from ds_ring.kernels.delta import OutputByDelta, materialized
from ds_ring.kernels.dilation import (
    HeadGroup,
    Region,
    SegmentRun,
    add_heads_,
    check_cu_seqlens,
    check_softcap,
    document_regions,
    head_groups,
    kept_rows,
    segment_runs,
    select_heads,
    validate_qkv,
)
from ds_ring.kernels.merge import accum_dtype, merge_
from ds_ring.kernels.piece import Grads, Piece
from ds_ring.kernels.sinks import add_sinks_, check_sinks, sinks_grad
from ds_ring.kernels.spans import BAND, DIAGONAL, Spans, check_span_options, resolve_spans, span_blocks
from ds_ring.kernels.window import attend_band_backward, attend_band_into, check_window

__all__ = [
    "Options",
    "dilated_attention",
    "plan_dilated",
    "dilated_forward",
    "dilated_backward",
    "attend_into",
    "attend_backward",
    "regions_forward_",
    "regions_backward_",
    "regions_backward",
    "new_accumulators",
    "check_window_branches",
    "span_cuts",
]


@dataclass(frozen=True)
class Options:
    """How a call computes: causal mask by (global) position, softmax scale (``None``: ``1/sqrt(D)``),
    global index of local head 0, causal sliding window (``None``: none; dense attention), logit soft-cap
    (``None``: uncapped scores), bidirectional spans over the global sequence (``None``: none;
    :mod:`ds_ring.kernels.spans`)."""

    causal: bool
    scale: float | None
    head_offset: int
    window: int | None = None
    softcap: float | None = None
    spans: Spans | None = None

    def piece(self, d: int = 0, causal: bool | None = None) -> Piece:
        """The options of one piece (:func:`attend_into` / :func:`attend_backward`): ``d``, how far its queries'
        positions are ahead of its keys' (with a window); ``causal`` (default: the call's)."""
        causal = self.causal if causal is None else causal
        return Piece(causal, self.scale, self.softcap, self.window, d)


def _to_kernel(x: torch.Tensor) -> torch.Tensor:
    """``[*lead, rows, heads, D]`` → contiguous ``[N, heads, rows, D]``."""
    return x.transpose(-2, -3).reshape(-1, x.shape[-2], x.shape[-3], x.shape[-1])


def _from_kernel(x: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """``[N, heads, rows, D]`` → ``[*lead, rows, heads, D]`` (a view)."""
    return x.view(*lead, *x.shape[1:]).transpose(-2, -3)


def _lse_to_kernel(lse: torch.Tensor) -> torch.Tensor:
    """``[*lead, rows, heads]`` → contiguous ``[N, heads, rows]``."""
    return lse.transpose(-1, -2).reshape(-1, lse.shape[-1], lse.shape[-2])


def _lse_from_kernel(lse: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    return lse.view(*lead, *lse.shape[1:]).transpose(-1, -2)


def attend_into(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, piece: Piece) -> None:
    """Attend ``q`` over ``k``/``v`` and LSE-merge the result into ``out``/``lse`` in place: one block, or with
    ``piece.window`` the band of a causal sliding window (:func:`~ds_ring.kernels.window.attend_band_into`).

    Args:
        q: ``[*lead, m, h, D]``; k: ``[*lead, n, h, D]``; v: ``[*lead, n, h, Dv]`` (heads already matched to ``q``).
        out: accumulator view ``[*lead, m, h, Dv]`` (fp32/fp64); lse: ``[*lead, m, h]``.
        piece: causal mask, scale, softcap, window (:class:`~ds_ring.kernels.piece.Piece`).
    """
    if piece.window is not None:
        attend_band_into(q, k, v, out, lse, piece)
        return
    lead = q.shape[:-3]
    block_out, block_lse = block_forward(
        _to_kernel(q), _to_kernel(k), _to_kernel(v), causal=piece.causal, scale=piece.scale, softcap=piece.softcap
    )
    merge_(out, lse, _from_kernel(block_out, lead), _lse_from_kernel(block_lse, lead))


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, piece: Piece) -> Grads:
    """Gradient share of one piece, in token layout; ``out``/``lse`` are the *final* merged values.

    Arguments and shapes as in :func:`attend_into` (``dout`` like ``out``). Returns ``(dq, dk, dv)`` shaped like
    ``q``, ``k``, ``v`` (``[*lead, m|n, h, D|Dv]``): views, or with a window in the accumulation dtype
    (:func:`~ds_ring.kernels.window.attend_band_backward`).
    """
    out = materialized(out, q.dtype)  # an OutputByDelta: the stand-in of just these rows
    if piece.window is not None:
        return attend_band_backward(dout, q, k, v, out, lse, piece)
    lead = q.shape[:-3]
    tensors = (_to_kernel(x) for x in (dout, q, k, v, out))
    dq, dk, dv = block_backward(
        *tensors, _lse_to_kernel(lse), causal=piece.causal, scale=piece.scale, softcap=piece.softcap
    )
    return _from_kernel(dq, lead), _from_kernel(dk, lead), _from_kernel(dv, lead)


def new_accumulators(q: torch.Tensor, v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero output ``[B, S, H, Dv]`` (``Dv``: ``v``'s head dim; ``q``'s without ``v``) and ``-inf`` LSE
    ``[B, S, H]`` in the accumulation dtype of ``q``, laid out like ``q`` when it is a view of the kernels'
    ``[B, H, S, D]``."""
    acc = accum_dtype(q.dtype)
    dv = (q if v is None else v).shape[-1]
    if q.dim() == 4 and not q.is_contiguous() and q.transpose(1, 2).is_contiguous():
        # q is a view of the kernels' layout [B, H, S, D] (Ulysses' head shards): so are the accumulators, and the
        # backward then reads the saved output without a copy.
        b, s, h = q.shape[:3]
        out = torch.zeros((b, h, s, dv), dtype=acc, device=q.device).transpose(1, 2)
        lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device).transpose(1, 2)
        return out, lse
    out = torch.zeros((*q.shape[:-1], dv), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    return out, lse


ROWS_PER_CALL = 8192
"""Most kept rows (per batch row) one kernel call takes: a run of more segments is cut into several calls
(a segment is never cut), so the copies and kernel outputs of one call do not grow with the shard."""


def _calls(run: SegmentRun, rate: int) -> Iterator[SegmentRun]:
    """``run`` cut into runs of whole segments, each of at most :data:`ROWS_PER_CALL` kept rows (one segment at
    least) when one row in ``rate`` is kept."""
    per_call = max(1, ROWS_PER_CALL // -(-run.length // rate))
    for first in range(0, run.count, per_call):
        yield SegmentRun(run.start + first * run.length, run.length, min(per_call, run.count - first))


def _segments(x: torch.Tensor, start: int, length: int, count: int) -> torch.Tensor:
    """View rows ``[start, start + length·count)`` of dim 1 as ``[B, count, length, ...]``."""
    return x[:, start : start + length * count].unflatten(1, (count, length))


def _pieces(
    regions: Sequence[Region], q: Tensor, k: Tensor, head_offset: int, tensors: Sequence[Tensor]
) -> Iterator[tuple[HeadGroup, list[Tensor], Region]]:
    """Each (region, segment run, head group) over the rows of ``q [B, S, H, D]`` (``k`` ``[B, S, Hkv, D]``) that
    keeps a row: the group, ``tensors`` (each ``[B, S, ...]``) viewed as ``[B, count, kept, ...]`` at its
    kept rows (all heads), and the region (a region with spans is one dense segment: ``count`` 1)."""
    for region in regions:
        branch, rows = region.branch, region.rows
        groups = head_groups(q.shape[2], k.shape[2], branch.rate, head_offset, q.device)
        runs = segment_runs(len(range(q.shape[1])[rows]), branch.segment)
        for run in (call for whole in runs for call in _calls(whole, branch.rate)):
            segments = [_segments(x[:, rows], run.start, run.length, run.count) for x in tensors]
            for group in groups:
                kept = kept_rows(0, run.length, group.offset, group.rate)
                if kept.start < run.length:
                    yield group, [x[:, :, kept] for x in segments], region


def _blocks(region: Region, rows: int, opts: Options) -> list[tuple[slice, slice, Piece]]:
    """``(query rows, key rows, piece)`` of one segment run of ``rows`` rows: the whole run, or with bidirectional
    spans its blocks (:func:`span_cuts`)."""
    if not region.spans:
        return [(slice(None), slice(None), opts.piece())]
    return span_cuts(0, rows, 0, rows, region.spans, opts)


def span_cuts(qpos: int, m: int, kpos: int, n: int, spans: Spans, opts: Options) -> list[tuple[slice, slice, Piece]]:
    """``(query rows, key rows, piece)`` offsets into a query run of ``m`` rows at ``qpos`` and a key run of ``n`` at
    ``kpos`` (rate 1, one document) under bidirectional ``spans`` (:func:`~ds_ring.kernels.spans.span_blocks`): full
    and causal blocks, and with the call's window its bands."""
    cuts = []
    for q0, q1, k0, k1, how in span_blocks(qpos, m, kpos, n, spans, opts.window):
        if how == BAND:
            piece = opts.piece((qpos + q0) - (kpos + k0))
        else:
            piece = dataclasses.replace(opts.piece(causal=how == DIAGONAL), window=None)
        cuts.append((slice(q0, q1), slice(k0, k1), piece))
    return cuts


def regions_forward_(
    q: Tensor, k: Tensor, v: Tensor, regions: Sequence[Region], out: Tensor, lse: Tensor, opts: Options
) -> None:
    """Merge each region's branch of dilated attention over its rows into ``out``/``lse``.

    ``q [B, S, H, D]``, ``k [B, S, Hkv, D]``, ``v [B, S, Hkv, Dv]``; every region starts at a segment boundary.
    ``out [B, S, H, Dv]`` and ``lse [B, S, H]`` are accumulators (see :func:`new_accumulators`).
    """
    for group, (qs, ks, vs, outs, lses), region in _pieces(regions, q, k, opts.head_offset, (q, k, v, out, lse)):
        h, kv = group.q_heads, group.kv_heads
        kg, vg = select_heads(ks, kv), select_heads(vs, kv)
        for a, b, piece in _blocks(region, qs.shape[2], opts):
            attend_into(qs[:, :, a, h], kg[:, :, b], vg[:, :, b], outs[:, :, a, h], lses[:, :, a, h], piece)


def regions_backward_(
    saved: Sequence[Tensor], regions: Sequence[Region], grads: Sequence[Tensor], opts: Options
) -> None:
    """Accumulate each region's gradients into ``grads``: ``(dq [B, S, H, D], dk [B, S, Hkv, D], dv [B, S, Hkv,
    Dv])``. ``saved``: ``(dout, q, k, v, out, lse)``, ``out``/``lse`` the final merged output ``[B, S, H, Dv]``
    and LSE ``[B, S, H]``."""
    q, k = saved[1], saved[2]
    for group, pieces, region in _pieces(regions, q, k, opts.head_offset, (*saved, *grads)):
        (douts, qs, ks, vs, outs, lses, dqs, dks, dvs), h, kv = pieces, group.q_heads, group.kv_heads
        for a, b, piece in _blocks(region, qs.shape[2], opts):
            args = (douts[:, :, a, h], qs[:, :, a, h], select_heads(ks[:, :, b], kv), select_heads(vs[:, :, b], kv),
                    outs[:, :, a, h], lses[:, :, a, h])  # fmt: skip
            dq_piece, dk_piece, dv_piece = attend_backward(*args, piece)
            dqs[:, :, a, h] += dq_piece
            add_heads_(dks[:, :, b], kv, dk_piece)
            add_heads_(dvs[:, :, b], kv, dv_piece)
            del args, dq_piece, dk_piece, dv_piece  # this call's copies and outputs go before the next call's exist


def _whole_call(
    regions: Sequence[Region], q: torch.Tensor, k: torch.Tensor, final: bool
) -> tuple[Region, SegmentRun] | None:
    """A region whose branch is one kernel call over every row and head of ``q``/``k`` ``[B, S, H, D]``.

    That is a rate-1 branch over all rows whose segments tile them (one run), without GQA: the call's
    dQ/dK/dV then have the tensors' shapes and can be the gradients themselves. In half precision only when they
    are ``final`` and it is the one region (anything added into them wants the accumulation dtype): a dense call
    on one process then keeps no fp32 gradient accumulators (6 q-shards of bf16, measured on an H200).
    """
    seq = q.shape[1]
    half = q.dtype != accum_dtype(q.dtype)
    if k.shape[2] != q.shape[2] or (half and not (final and len(regions) == 1)):
        return None
    for region in regions:
        runs = segment_runs(seq, region.branch.segment)
        whole = region.rows.indices(seq) == (0, seq, 1) and len(runs) == 1
        if region.branch.rate == 1 and whole and not region.spans:
            return region, runs[0]
    return None


def regions_backward(
    saved: Sequence[Tensor], regions: Sequence[Region], opts: Options, *, final: bool = False
) -> Grads | None:
    """Every region's gradients, when one region is a single kernel call over the whole tensors (with a
    ``window``: one band call, :func:`~ds_ring.kernels.window.attend_band_backward`).

    That call runs first and its dQ/dK/dV become the gradients (no zero accumulators, no added
    copy); the other regions accumulate into them. ``saved`` and shapes as in :func:`regions_backward_`;
    ``final``: nothing outside adds into the gradients returned (half-precision inputs may then keep them in their
    own dtype). Returns ``(dq, dk, dv)``, or ``None`` (nothing computed) when no region is such a call.
    """
    q, k, v = saved[1:4]
    whole = _whole_call(regions, q, k, final)
    if whole is None:
        return None
    region, run = whole
    views = (_segments(x, 0, run.length, run.count) for x in saved)
    pieces = attend_backward(*views, opts.piece())
    # The kernel's pieces are contiguous in token layout here, so these are views (a copy otherwise).
    grads = tuple(piece.reshape(x.shape) for piece, x in zip(pieces, (q, k, v), strict=True))
    regions_backward_(saved, [other for other in regions if other is not region], grads, opts)
    return grads


def dilated_forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, regions: Sequence[Region], opts: Options
) -> tuple[Tensor, Tensor]:
    """All regions merged, then the sinks: ``out [B, S, H, Dv]`` in ``q``'s dtype and ``lse [B, S, H]`` (accumulation
    dtype); shapes as in :func:`regions_forward_`, ``sinks [H]`` or ``None``."""
    out, lse = new_accumulators(q, v)
    regions_forward_(q, k, v, regions, out, lse, opts)
    if sinks is not None:
        add_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse


def dilated_backward(
    saved: Sequence[Tensor | OutputByDelta],
    sinks: Tensor | None,
    regions: Sequence[Region],
    opts: Options,
    sinks_wanted: bool,
    grads: Sequence[Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dsinks)`` in the inputs' dtypes (``dsinks``: ``None`` unless ``sinks_wanted``) from ``saved =
    (dout, q, k, v, out, lse)``. ``out`` enters only through ``Delta = rowsum(dout ∘ out)``: it may be an
    :class:`~ds_ring.kernels.delta.OutputByDelta`, each call's stand-in then made for its rows only. ``grads``:
    ``(dq, dk, dv)`` already computed (:func:`~ds_ring.kernels.overwrite.dilated_backward_over_inputs`)."""
    dout, q, k, v, out, lse = saved
    saved = (dout.to(q.dtype), q, k, v, out, lse)
    if grads is None:
        grads = regions_backward(saved, regions, opts, final=True)
    if grads is None:
        acc = accum_dtype(q.dtype)
        grads = tuple(torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
        regions_backward_(saved, regions, grads, opts)
    dq, dk, dv = grads
    dsinks = sinks_grad(saved[0], out, lse, sinks) if sinks is not None and sinks_wanted else None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


class _DilatedAttention(torch.autograd.Function):
    """Forward: all regions merged (then the sinks); backward: per-piece flash backward with the final out/lse."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, regions, opts: Options):
        out, lse = dilated_forward(q, k, v, sinks, regions, opts)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (regions, opts)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        regions, opts = ctx.args
        grads = dilated_backward((dout, q, k, v, out, lse), sinks, regions, opts, ctx.needs_input_grad[3])
        return *grads, None, None


def check_window_branches(window: int | None, causal: bool, segment_lengths: Sequence[int] | None) -> None:
    """``ValueError`` for a bad ``window`` (:func:`~ds_ring.kernels.window.check_window`), or one with LongNet
    branches (a window works with dense attention, each document its own)."""
    check_window(window, causal)
    if window is not None and segment_lengths is not None:
        raise ValueError(
            f"window={window} works with dense attention only, got segment_lengths={list(segment_lengths)}; remove "
            f"segment_lengths/dilation_rates for a sliding-window layer (packed documents: cu_seqlens)"
        )


def dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    head_offset: int = 0,
    return_lse: bool = False,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    bidirectional_spans: torch.Tensor | Sequence[Sequence[int]] | Sequence[int] | None = None,
    prefix_lengths: int | Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LongNet dilated attention on one device.

    Args:
        q: ``[batch, seq, heads, head_dim]``; k: ``[batch, seq, kv_heads, head_dim]`` with ``heads % kv_heads
            == 0`` (GQA); v: ``[batch, seq, kv_heads, v_head_dim]`` (``v_head_dim`` may differ from ``head_dim``:
            multi-head latent attention, DeepSeek V2/V3).
        segment_lengths, dilation_rates: one ``(w, r)`` per branch; a segment longer than ``seq``
            is clamped; the last segment may be shorter. Both ``None``: dense attention.
        causal: mask by original position inside each segment.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        head_offset: global index of local head 0; head ``h`` uses offset ``(head_offset + h) % r``.
        return_lse: also return the log-sum-exp.
        cu_seqlens: document boundaries ``[0, e1, ..., seq]`` of a packed sequence (1-D integers, the same
            for every batch row): each document is attended as if alone (segments and dilation offsets
            restart at its first token; a document shorter than a segment clamps it). ``None``: one document.
        window: causal sliding window: query ``i`` sees keys ``[i - window + 1, i]`` of its document (dense
            attention, ``causal=True``; flash-attn's ``window_size=(window - 1, 0)``). ``None``: no window.
        sinks: ``[heads]`` attention-sink logits (GPT-OSS): one more key per head with that score and value 0;
            differentiable (not capped by ``softcap``). ``None``: no sink.
        softcap: attention logit soft-capping (Gemma 2): scores ``s = q·k·scale`` become
            ``softcap·tanh(s / softcap)`` before the softmax (computed by the tiled pure-torch kernel).
            ``None``: uncapped.
        bidirectional_spans: spans of tokens that see each other fully inside the causal sequence (Gemma 3's image
            tokens): ``(start, stop)`` pairs, or per-token span ids ``[seq]`` (0: causal token; equal nonzero ids:
            one span of consecutive tokens). Each span inside one document; dense attention, ``causal=True``; with a
            ``window``: ``(causal OR same span) AND window``, spans at most the window. ``None``: none.
        prefix_lengths: prefix-LM (PaliGemma): the first ``P`` tokens of every document see each other fully; one
            int, or one per document. ``None``: none.

    Returns:
        ``out [batch, seq, heads, v_head_dim]`` in the input dtype, and with ``return_lse`` also
        ``lse [batch, heads, seq]`` (float32; float64 for float64 inputs; ``-inf`` for rows no
        branch covers, whose output is 0; the sinks included). ``lse`` carries no gradient.
    """
    seq = q.shape[1] if q.dim() == 4 else 0
    spans = resolve_spans(bidirectional_spans, prefix_lengths, check_cu_seqlens(cu_seqlens, seq) or (0, seq))
    regions, opts = plan_dilated(
        q, k, v, segment_lengths, dilation_rates, causal=causal, scale=scale, head_offset=head_offset,
        cu_seqlens=cu_seqlens, window=window, sinks=sinks, softcap=softcap, spans=spans,
    )  # fmt: skip
    out, lse = _DilatedAttention.apply(q, k, v, sinks, regions, opts)
    return (out, lse.transpose(1, 2)) if return_lse else out


def plan_dilated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | None,
    dilation_rates: Sequence[int] | None,
    *,
    causal: bool,
    scale: float | None,
    head_offset: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None,
    window: int | None,
    sinks: torch.Tensor | None,
    softcap: float | None,
    spans: Spans | None = None,
) -> tuple[tuple[Region, ...], Options]:
    """Check a :func:`dilated_attention` call (arguments as there; ``spans``: checked bidirectional spans,
    :func:`~ds_ring.kernels.spans.resolve_spans`; ``ValueError`` for a bad one) and return its regions and options:
    what :func:`dilated_forward` and :func:`dilated_backward` take."""
    validate_qkv(q, k, v, head_offset)
    check_window_branches(window, causal, segment_lengths)
    check_span_options(spans, causal, window, segment_lengths)
    check_sinks(sinks, q)
    softcap = check_softcap(softcap)
    documents = check_cu_seqlens(cu_seqlens, q.shape[1])
    regions = document_regions(q.shape[1], segment_lengths, dilation_rates, documents, spans)
    return regions, Options(causal, scale, head_offset, window, softcap, spans)
