"""Causal sliding-window attention of a query run over a key run, as a few batched ops over key bands.

Query row ``i`` (global position ``P + i``) of a window ``w`` sees key row ``j`` (position ``P' + j``) when
``0 <= (P + i) - (P' + j) <= w - 1`` (docs/design.md §Windows and sinks; flash-attn's ``window_size=(w - 1, 0)``). With
``d = P - P'`` the keys of row ``i`` are ``[i + d - w + 1, i + d]``: a band.

The query rows that meet a key are cut into ``T`` blocks of ``b`` rows (``b = max(16, w // 2)``, at most the
rows). Block ``t``'s keys all lie in one *band* of ``c·b`` key rows starting ``t·b`` rows after block 0's
(``c = ceil((b + w - 1) / b)``): K and V are zero-padded at both ends once and every band is a strided view
of them (``unfold``), so all blocks' scores come from one batched matmul ``[*, T, h, b, c·b]``. In every
band row ``x`` sees band key ``y`` exactly when ``x <= y <= x + w - 1`` (one mask for all blocks), less
the padding. One ``logsumexp`` gives each row's LSE, merged into the accumulators by one LSE merge.

The backward (flash-style, with the final merged ``out``/``lse``) recomputes the scores the same way;
dK/dV of overlapping bands are summed back with ``c`` shifted adds (deterministic, no atomics). So a
layer is a few dozen ops whatever its length, where the earlier per-piece loop launched ~7 ops per band
piece (33,881 ops per layer forward + backward at 16K tokens, window 128).

Memory: ``O(rows × (b + w))`` — never ``seq × seq``. Blocks go in groups whose score-sized temporaries
(in the accumulation dtype) stay within :data:`BAND_BYTES`; one group at 16K tokens, 8 heads, window 128.
The scores are computed in the accumulation dtype (fp32 for fp16/bf16 inputs, fp64 for fp64).

On a CPU (and meta tensors) without ``softcap``, with ``Dv == D``, the blocks (``max(128, w // 2)`` rows) go
through PyTorch's fused CPU flash kernel and its backward instead, with an additive band mask shared by the
interior blocks (see the section at the end): no score tensor in memory, ~3× faster than the piece loop at 16K.

Layout: token layout ``[*lead, rows, heads, D]`` as in :mod:`ds_ring.kernels.dilated` (``v``, ``out``: ``Dv``).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_ring.kernels.merge import accum_dtype, merge_
from ds_ring.kernels.piece import Grads, Piece

__all__ = ["BAND_BYTES", "attend_band_into", "attend_band_backward", "check_window"]

BAND_BYTES = 256 * 2**20
"""Bytes of one group of blocks' score-sized temporaries (``[*, blocks, h, b, c·b]`` in the accumulation
dtype); a longer run is done in several groups."""


def check_window(window: object, causal: bool) -> None:
    """``ValueError`` unless ``window`` is ``None`` or an integer >= 1 given with ``causal=True``."""
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (keys [i - window + 1, i]) or None, got {window!r}")
    if not causal:
        raise ValueError(
            f"window={window} is a causal sliding window (each query sees itself and the window - 1 keys before "
            f"it), but causal=False; pass causal=True, or window=None for bidirectional attention"
        )


@dataclass(frozen=True)
class _Bands:
    """Query rows ``[first, first + rows)`` in ``count`` blocks of ``block`` rows; block ``t``'s band is key rows
    ``[start + t·block, start + t·block + per_band·block)`` of ``n`` (negative or past ``n``: padding)."""

    first: int
    rows: int
    block: int
    count: int
    per_band: int
    start: int
    n: int
    window: int

    @property
    def band(self) -> int:
        return self.per_band * self.block

    @property
    def key_blocks(self) -> int:
        """Blocks of the padded key run: every band's last block included."""
        return self.count - 1 + self.per_band


@functools.lru_cache(maxsize=32)
def _hidden(geo: _Bands, device: torch.device) -> torch.Tensor:
    """``[count, 1, block, band]``, true where row ``x`` of block ``t`` does *not* see band key ``y``: outside
    ``x <= y <= x + w - 1``, a key outside ``[0, n)`` or a row past the run. Made once per geometry and device
    (a layer's forward and backward, and every layer of a model, share it)."""
    x = torch.arange(geo.block, device=device).view(-1, 1)
    y = torch.arange(geo.band, device=device)
    rel = y - x
    seen = (rel >= 0) & (rel < geo.window)  # [block, band]
    t = torch.arange(geo.count, device=device).view(-1, 1) * geo.block
    if geo.start < 0 or geo.start + geo.key_blocks * geo.block > geo.n:
        key = t + (y + geo.start)
        seen = seen & ((key >= 0) & (key < geo.n)).unsqueeze(1)  # [count, block, band]
    if geo.count * geo.block > geo.rows:
        seen = seen & (t + x.view(1, -1) < geo.rows).unsqueeze(-1)
    return (~seen).expand(geo.count, geo.block, geo.band).unsqueeze(1)


def _bands(m: int, n: int, d: int, window: int, block: int | None = None) -> _Bands | None:
    """The blocks of ``m`` query rows over ``n`` key rows, queries ``d`` positions ahead; ``None``: no row
    meets a key. ``block``: rows per block (``None``: ``max(16, window // 2)``), at most the rows."""
    first, last = max(0, -d), min(m, n - d + window - 1)
    if last <= first:
        return None
    rows = last - first
    block = min(rows, max(16, window // 2) if block is None else block)
    per_band = -(-(block + window - 1) // block)
    return _Bands(first, rows, block, -(-rows // block), per_band, first + d - window + 1, n, window)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _query_blocks(x: torch.Tensor, geo: _Bands, acc: torch.dtype) -> torch.Tensor:
    """``x [*lead, m, h, E]``'s rows of the run as ``[L, count, h, block, E]`` in ``acc`` (zero rows past its end)."""
    rows = x.narrow(-3, geo.first, geo.rows)
    rows = rows.reshape(-1, *rows.shape[-3:]).to(acc)
    padded = F.pad(rows, (0, 0, 0, 0, 0, geo.count * geo.block - geo.rows))
    return padded.view(padded.shape[0], geo.count, geo.block, *padded.shape[-2:]).transpose(2, 3)


def _key_run(x: torch.Tensor, geo: _Bands, acc: torch.dtype) -> torch.Tensor:
    """``x [*lead, n, h, E]`` over the padded key run, ``[L, key_blocks·block, h, E]`` in ``acc`` (zero rows
    outside ``[0, n)``)."""
    total = geo.key_blocks * geo.block
    lo, hi = max(geo.start, 0), min(geo.start + total, geo.n)
    rows = x.narrow(-3, lo, hi - lo)
    rows = rows.reshape(-1, *rows.shape[-3:]).to(acc)
    return F.pad(rows, (0, 0, 0, 0, lo - geo.start, geo.start + total - hi))


def _bands_of(run: torch.Tensor, geo: _Bands, t0: int, t1: int) -> torch.Tensor:
    """Blocks ``t0:t1``'s bands of a padded key run: ``[L, t1 - t0, h, E, band]`` (a strided view)."""
    part = run[:, t0 * geo.block : (t1 - 1 + geo.per_band) * geo.block]
    return part.unfold(1, geo.band, geo.block)


def _group_size(geo: _Bands, lead_heads: int, dtype: torch.dtype) -> int:
    """Blocks per group: as many as keep ``[L, blocks, h, block, band]`` scores in ``dtype`` within
    :data:`BAND_BYTES` (at least one)."""
    per_block = lead_heads * geo.block * geo.band * torch.finfo(dtype).bits // 8
    return max(1, BAND_BYTES // max(1, per_block))


def _scores(
    qb: torch.Tensor, kband: torch.Tensor, hidden: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked (``-inf``) scores ``[L, blocks, h, block, band]`` and, with ``softcap``, ``tanh(s / softcap)``."""
    if softcap is None:
        return torch.matmul(qb * scale, kband).masked_fill_(hidden, float("-inf")), None
    capped = torch.tanh(torch.matmul(qb, kband).mul_(scale / softcap))
    return (capped * softcap).masked_fill_(hidden, float("-inf")), capped


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (rows that see no key) as 0, so ``exp(s - lse)`` is 0 there, not nan."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _token_layout(x: torch.Tensor, lead: torch.Size, rows: int) -> torch.Tensor:
    """``[L, blocks, h, block, *E]`` back to token layout ``[*lead, rows, h, *E]`` (the first ``rows`` rows)."""
    x = x.transpose(2, 3)
    return x.reshape(*lead, x.shape[1] * x.shape[2], *x.shape[3:]).narrow(len(lead), 0, rows)


def attend_band_into(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, piece: Piece) -> None:
    """Merge windowed attention (``piece.window``, query positions ``piece.d`` ahead) of ``q [*lead, m, h, D]``
    over ``k [*lead, n, h, D]``, ``v [*lead, n, h, Dv]`` into ``out [*lead, m, h, Dv]`` / ``lse [*lead, m, h]``
    (accumulators, in place), with ``piece``'s scale and softcap."""
    d, window, scale, softcap = piece.d, piece.window, piece.scale, piece.softcap
    if _fused(q, v, softcap):
        geo = _bands(q.shape[-3], k.shape[-3], d, window, _fused_block(window))
        if geo is not None:
            _fused_forward(q, k, v, out, lse, geo, _scale(q, scale))
        return
    geo = _bands(q.shape[-3], k.shape[-3], d, window)
    if geo is None:
        return
    acc, lead = accum_dtype(q.dtype), q.shape[:-3]
    qb, kr, vr = _query_blocks(q, geo, acc), _key_run(k, geo, acc), _key_run(v, geo, acc)
    hidden, factor = _hidden(geo, q.device), _scale(q, scale)
    step = _group_size(geo, qb.shape[0] * q.shape[-2], acc)
    for t0 in range(0, geo.count, step):
        t1 = min(t0 + step, geo.count)
        s, _ = _scores(qb[:, t0:t1], _bands_of(kr, geo, t0, t1), hidden[t0:t1], factor, softcap)
        top = _finite(s.amax(dim=-1, keepdim=True))
        p = s.sub_(top).exp_()  # the scores' memory, reused
        total = p.sum(dim=-1, keepdim=True)
        block_lse = (top + total.log()).squeeze(-1)  # rows that see no key: 0 + log 0 = -inf
        # total >= 1 where a row sees a key (its largest term is exp(0)); 0 rows stay 0, not 0 / 0
        block_out = torch.matmul(p, _bands_of(vr, geo, t0, t1).transpose(-1, -2)).div_(total.clamp_(min=1))
        r0, r1 = t0 * geo.block, min(t1 * geo.block, geo.rows)
        rows = r1 - r0
        block_lse = _token_layout(block_lse.unsqueeze(-1), lead, rows).squeeze(-1)
        merge_(out.narrow(-3, geo.first + r0, rows), lse.narrow(-2, geo.first + r0, rows),
               _token_layout(block_out, lead, rows), block_lse)  # fmt: skip


def attend_band_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, piece: Piece
) -> Grads:
    """Gradients of :func:`attend_band_into` given the *final* merged ``out``/``lse``: ``(dq, dk, dv)`` shaped
    like ``q``, ``k``, ``v``, in the accumulation dtype (zeros where no band reaches)."""
    d, window, scale, softcap = piece.d, piece.window, piece.scale, piece.softcap
    acc, fused = accum_dtype(q.dtype), _fused(q, v, softcap)
    geo = _bands(q.shape[-3], k.shape[-3], d, window, _fused_block(window) if fused else None)
    if geo is None:
        return tuple(torch.zeros(x.shape, dtype=acc, device=x.device) for x in (q, k, v))
    qb, dob, ob = (_query_blocks(x, geo, acc) for x in (q, dout, out))
    lb = _query_blocks(_finite(lse.to(acc)).unsqueeze(-1), geo, acc).squeeze(-1)  # [L, count, h, block]
    kr, vr = _key_run(k, geo, acc).contiguous(), _key_run(v, geo, acc).contiguous()
    dqb, dkr, dvr = torch.empty_like(qb), torch.zeros_like(kr), torch.zeros_like(vr)
    if fused:
        _fused_backward_((dob, qb, kr, vr, ob, lb), (dqb, dkr, dvr), geo, _scale(q, scale))
    else:
        _batched_backward_((dob, qb, kr, vr, ob, lb), (dqb, dkr, dvr), geo, _scale(q, scale), softcap)
    dq = _placed(_token_layout(dqb, q.shape[:-3], geo.rows), q, geo.first)
    lo, hi = max(geo.start, 0), min(geo.start + geo.key_blocks * geo.block, geo.n)
    dk, dv = (_placed(run.narrow(1, lo - geo.start, hi - lo).view(*x.shape[:-3], hi - lo, *run.shape[-2:]), x, lo)
              for run, x in ((dkr, k), (dvr, v)))  # fmt: skip
    return dq, dk, dv


def _batched_backward_(
    blocks: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], geo: _Bands, factor: float, softcap: float | None
) -> None:
    """The band gradients by batched matmuls over groups of blocks. ``blocks``: ``(dout, q, k, v, out, lse)`` as
    :func:`attend_band_backward` cuts them, in the accumulation dtype: ``dout``, ``q``, ``out`` in query blocks
    ``[L, count, h, block, E]``, ``k``, ``v`` as padded key runs ``[L, key_blocks·block, h, E]``, the finite
    ``lse`` ``[L, count, h, block]``; ``grads``: ``(dq, dk, dv)`` shaped like ``q``'s blocks and the key runs,
    written in place (the runs summed into)."""
    (dob, qb, kr, vr, ob, lb), (dqb, dkr, dvr) = blocks, grads
    hidden = _hidden(geo, qb.device)
    step = _group_size(geo, qb.shape[0] * qb.shape[2], qb.dtype)
    for t0 in range(0, geo.count, step):
        t1 = min(t0 + step, geo.count)
        kband, vband = _bands_of(kr, geo, t0, t1), _bands_of(vr, geo, t0, t1)  # [L, blocks, h, E, band]
        s, capped = _scores(qb[:, t0:t1], kband, hidden[t0:t1], factor, softcap)
        p = s.sub_(lb[:, t0:t1].unsqueeze(-1)).exp_()
        do = dob[:, t0:t1]
        delta = (do * ob[:, t0:t1]).sum(-1, keepdim=True)
        ds = torch.matmul(do, vband).sub_(delta).mul_(p)
        if capped is not None:  # s capped to c·tanh(s / c): dS scaled by 1 - tanh²
            ds.mul_(1 - capped * capped)
        ds.mul_(factor)
        dqb[:, t0:t1] = torch.matmul(ds, kband.transpose(-1, -2))
        _add_bands_(dkr, torch.matmul(ds.transpose(-1, -2), qb[:, t0:t1]), geo, t0)
        _add_bands_(dvr, torch.matmul(p.transpose(-1, -2), do), geo, t0)


def _placed(rows: torch.Tensor, like: torch.Tensor, first: int) -> torch.Tensor:
    """``rows [*lead, r, h, E]`` at rows ``first:first + r`` of zeros shaped like ``like`` (``rows`` itself when
    they are all of them)."""
    if rows.shape == like.shape:
        return rows
    full = rows.new_zeros(like.shape)
    full.narrow(-3, first, rows.shape[-3]).copy_(rows)
    return full


def _add_bands_(run: torch.Tensor, grads: torch.Tensor, geo: _Bands, t0: int) -> None:
    """Sum band gradients ``[L, blocks, h, band, E]`` of blocks ``t0:`` into the padded key run
    ``[L, key_blocks·block, h, E]``: ``per_band`` shifted adds, one per ``block``-row slice of the bands."""
    blocks = grads.shape[1]
    by_block = run.view(run.shape[0], geo.key_blocks, geo.block, *run.shape[-2:])
    parts = grads.view(*grads.shape[:3], geo.per_band, geo.block, grads.shape[-1]).permute(0, 1, 3, 4, 2, 5)
    for i in range(geo.per_band):
        by_block[:, t0 + i : t0 + i + blocks] += parts[:, :, i]


# --- CPU: the blocks through PyTorch's fused flash kernel -------------------------------------------------------
#
# On a CPU the bands go through ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward) with an additive
# band mask: batch = blocks, each block's keys a strided view of the padded key run (no copy), no score tensor
# in memory (the kernel tiles the scores in its caches). Interior blocks share one ``[block, band]`` mask; the
# few blocks at the run's edges (padding keys, rows past the run) get their own masks, in separate calls.


def _fused(q: torch.Tensor, v: torch.Tensor, softcap: float | None) -> bool:
    """Whether the band goes through the fused CPU flash kernel: a CPU (or meta) tensor, no ``softcap``, one
    head dim for q/k and v."""
    return q.device.type in ("cpu", "meta") and softcap is None and q.shape[-1] == v.shape[-1]


def _fused_block(window: int) -> int:
    """Query rows per block for the fused kernel: ``max(128, window // 2)``. Its backward costs a fixed time per
    (block, head) task, so small blocks (``window // 2`` = 64 at window 128) are slower than larger ones that
    compute more masked scores (band ``2·window`` rather than ``1.5·window`` keys a row at window 128)."""
    return max(128, window // 2)


@functools.lru_cache(maxsize=64)
def _segments(geo: _Bands) -> tuple[tuple[int, int, bool], ...]:
    """Blocks ``[t0, t1)`` in at most three runs ``(t0, t1, interior)``: leading blocks, the *interior* (one
    shared ``[block, band]`` mask), trailing blocks. A block is interior when every key its real rows see
    under the band mask is one of ``[0, n)``: padding keys and rows past the run then need no mask of their
    own (a padded row's output is cut off; its ``dout`` is 0, so it adds nothing to dK/dV)."""

    def interior(t: int) -> bool:
        last_row = min(geo.block, geo.rows - t * geo.block) - 1
        return geo.start + t * geo.block >= 0 and geo.start + t * geo.block + last_row + geo.window - 1 < geo.n

    inner = [t for t in range(geo.count) if interior(t)]  # a run of blocks (both conditions are monotone)
    if not inner:
        return ((0, geo.count, False),)
    e0, e1 = inner[0], inner[-1] + 1
    runs = ((0, e0, False), (e0, e1, True), (e1, geo.count, False))
    return tuple(run for run in runs if run[1] > run[0])


@functools.lru_cache(maxsize=64)
def _additive(geo: _Bands, t0: int, t1: int, interior: bool, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``t0:t1``'s band mask, additive (``0`` seen, ``-inf`` hidden): ``[1, 1, block, band]`` for the
    interior, else ``[t1 - t0, 1, block, band]`` (keys outside ``[0, n)`` and rows past the run hidden too)."""
    x = torch.arange(geo.block, device=device).view(-1, 1)
    y = torch.arange(geo.band, device=device)
    rel = y - x
    seen = (rel >= 0) & (rel < geo.window)  # [block, band]
    if not interior:
        t = torch.arange(t0, t1, device=device).view(-1, 1) * geo.block
        key = t + (y + geo.start)
        seen = seen & ((key >= 0) & (key < geo.n)).unsqueeze(1)  # [blocks, block, band]
        seen = seen & (t + x.view(1, -1) < geo.rows).unsqueeze(-1)
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
    return mask.view(-1, 1, geo.block, geo.band)


def _band_view(run: torch.Tensor, geo: _Bands, t0: int, t1: int) -> torch.Tensor:
    """Blocks ``t0:t1``'s bands of one lead's padded key run ``[key_blocks·block, h, E]`` (contiguous) as the
    kernel's keys ``[t1 - t0, h, band, E]``: a strided view."""
    rows, h, e = run.shape
    return run.as_strided((t1 - t0, h, geo.band, e), (geo.block * h * e, e, h * e, 1),
                          run.storage_offset() + t0 * geo.block * h * e)  # fmt: skip


def _fused_forward(q, k, v, out, lse, geo: _Bands, scale: float) -> None:
    acc, lead = accum_dtype(q.dtype), q.shape[:-3]
    qb, kr, vr = _query_blocks(q, geo, acc), _key_run(k, geo, acc).contiguous(), _key_run(v, geo, acc).contiguous()
    for i, at in enumerate(itertools.product(*map(range, lead))):  # out[at]: one lead's accumulators (views)
        qi, ki, vi = qb[i], kr[i], vr[i]
        pieces = [
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qi[t0:t1], _band_view(ki, geo, t0, t1), _band_view(vi, geo, t0, t1), 0.0, False,
                attn_mask=_additive(geo, t0, t1, inner, q.device, acc), scale=scale,
            )  # [blocks, h, block, E], [blocks, h, block]
            for t0, t1, inner in _segments(geo)
        ]  # fmt: skip
        block_out, block_lse = (torch.cat(x) if len(pieces) > 1 else x[0] for x in zip(*pieces, strict=True))
        block_out = block_out.transpose(1, 2).reshape(-1, *block_out.shape[1:2], block_out.shape[-1])[: geo.rows]
        block_lse = block_lse.transpose(1, 2).reshape(-1, block_lse.shape[1])[: geo.rows]
        merge_(out[at].narrow(0, geo.first, geo.rows), lse[at].narrow(0, geo.first, geo.rows), block_out, block_lse)


def _fused_backward_(
    blocks: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], geo: _Bands, scale: float
) -> None:
    """The band gradients through the fused CPU flash kernel's backward, one lead at a time; ``blocks`` and
    ``grads`` as in :func:`_batched_backward_`."""
    (dob, qb, kr, vr, ob, lb), (dqb, dkr, dvr) = blocks, grads
    for i in range(qb.shape[0]):
        qi, ki, vi, doi, oi, li = qb[i], kr[i], vr[i], dob[i], ob[i], lb[i]
        for t0, t1, inner in _segments(geo):  # each segment's band grads summed into the key run at once (no copies)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                doi[t0:t1], qi[t0:t1], _band_view(ki, geo, t0, t1), _band_view(vi, geo, t0, t1), oi[t0:t1],
                li[t0:t1], 0.0, False, attn_mask=_additive(geo, t0, t1, inner, qb.device, qb.dtype), scale=scale,
            )  # fmt: skip
            dqb[i, t0:t1] = dq
            _add_bands_(dkr[i : i + 1], dk.unsqueeze(0), geo, t0)
            _add_bands_(dvr[i : i + 1], dv.unsqueeze(0), geo, t0)
            del dq, dk, dv
