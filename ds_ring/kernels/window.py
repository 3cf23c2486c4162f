"""Causal sliding-window attention of a query run over a key run, from full and causal block calls only.

Query row ``i`` (global position ``P + i``) of a window ``w`` sees key row ``j`` (position ``P' + j``) when
``0 <= (P + i) - (P' + j) <= w - 1`` (DESIGN.md §8; flash-attn's ``window_size=(w - 1, 0)``). With
``d = P - P'`` the keys of row ``i`` are ``[i + d - w + 1, i + d]``: a band. Cut the query rows into chunks
of ``c <= w - 1`` rows; for the chunk ``[a, b)`` the band splits into three pieces, each a primitive the
block kernels have (DESIGN.md §2, merged by the LSE merge):

- ``causal``: keys ``[a + d, b + d)``, row ``a + x`` sees the first ``x + 1`` — an aligned causal square;
- ``full``: keys ``[b + d - w, a + d)``, seen by every row of the chunk;
- ``anti``: keys ``[a + d - w + 1, b + d - w)``, row ``a + x`` sees those from the ``x``-th on — a causal
  square on rows and keys taken in reverse order (computed on flipped copies, flipped back).

Clipped to the key run ``[0, n)`` a square becomes a smaller square and a full rectangle (rows past the
run's end see all of it; rows whose keys start before it see a shifted square). ``w = 1`` keeps only
each query's own key: a ``diagonal`` piece, computed elementwise. Pieces of one kind and shape are
stacked into one kernel call. No ``seq × seq`` (or ``seq × w``) matrix is formed: a kernel sees one
chunk against at most ``w`` keys.

Layout: token layout ``[*lead, rows, heads, D]`` as in :mod:`ds_ring.kernels.dilated` (``v``, ``out``: ``Dv``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby

import torch

from ds_ring.kernels.block import block_backward, block_forward
from ds_ring.kernels.merge import accum_dtype, merge_

__all__ = ["Piece", "band_pieces", "attend_band_into", "attend_band_backward", "check_window"]

FULL, CAUSAL, ANTI, DIAGONAL = "full", "causal", "anti", "diagonal"


@dataclass(frozen=True)
class Piece:
    """Query rows ``rows`` against key rows ``keys`` of one primitive ``kind``."""

    kind: str
    rows: slice
    keys: slice

    @property
    def shape(self) -> tuple[str, int, int]:
        return self.kind, self.rows.stop - self.rows.start, self.keys.stop - self.keys.start


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


def _causal(r0: int, k0: int, size: int, lo: int, hi: int, kind: str = CAUSAL) -> list[Piece]:
    """Rows ``r0 + x`` (``x < size``) seeing keys ``k0 + y`` with ``y <= x`` and ``lo <= y < hi``: rows
    ``[lo, hi)`` a causal square, rows past ``hi`` all of ``[lo, hi)``, rows before ``lo`` nothing."""
    lo, hi = max(lo, 0), min(hi, size)
    if hi <= lo:
        return []
    pieces = [Piece(kind, slice(r0 + lo, r0 + hi), slice(k0 + lo, k0 + hi))]
    if hi < size:
        pieces.append(Piece(FULL, slice(r0 + hi, r0 + size), slice(k0 + lo, k0 + hi)))
    return pieces


def _anti(r0: int, k0: int, size: int, lo: int, hi: int) -> list[Piece]:
    """Rows ``r0 + x`` (``x < size``) seeing keys ``k0 + y`` with ``x <= y < size`` and ``lo <= y < hi``: the
    causal pieces of the rows and keys in reverse order, mapped back."""
    return [
        Piece(p.kind, slice(r0 + size - p.rows.stop, r0 + size - p.rows.start),
              slice(k0 + size - p.keys.stop, k0 + size - p.keys.start))
        for p in _causal(0, 0, size, size - hi, size - lo, ANTI)
    ]  # fmt: skip


def band_pieces(m: int, n: int, d: int, window: int, chunk: int | None = None) -> list[Piece]:
    """The pieces of ``m`` query rows against ``n`` key rows, query positions ``d`` ahead of key positions.

    ``chunk``: query rows per chunk (``None``: ``max(1, window // 2)``, at most ``window - 1``).
    """
    if window == 1:
        lo, hi = max(0, -d), min(m, n - d)
        return [Piece(DIAGONAL, slice(lo, hi), slice(lo + d, hi + d))] if hi > lo else []
    chunk = min(window - 1, chunk or max(1, window // 2))
    pieces: list[Piece] = []
    # Only chunks whose band meets the keys: rows with i + d >= 0 and i + d - w + 1 < n.
    first, last = max(0, -d), min(m, n - d + window - 1)
    for a in range(first - (first % chunk), last, chunk):
        b = min(a + chunk, m)
        size = b - a
        pieces += _causal(a, a + d, size, -(a + d), n - (a + d))
        full = slice(max(b + d - window, 0), min(a + d, n))
        if full.stop > full.start:
            pieces.append(Piece(FULL, slice(a, b), full))
        start = a + d - window + 1
        pieces += _anti(a, start, size - 1, -start, n - start)
    return pieces


def _grouped(pieces: list[Piece]) -> Iterator[list[Piece]]:
    for _, group in groupby(sorted(pieces, key=lambda p: p.shape), key=lambda p: p.shape):
        yield list(group)


def _stack(x: torch.Tensor, slices: list[slice], flip: bool) -> torch.Tensor:
    """``x [*lead, rows, ...]`` at each slice of dim -3, stacked along a new dim 0 (rows reversed with ``flip``)."""
    parts = torch.stack([x[..., s, :, :] for s in slices])
    return parts.flip(-3) if flip else parts


def _stack_lse(x: torch.Tensor, slices: list[slice], flip: bool) -> torch.Tensor:
    parts = torch.stack([x[..., s, :] for s in slices])
    return parts.flip(-2) if flip else parts


def _to_kernel(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -3).reshape(-1, x.shape[-2], x.shape[-3], x.shape[-1])


def _from_kernel(x: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    return x.view(*lead, *x.shape[1:]).transpose(-2, -3)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def attend_band_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    d: int,
    window: int,
    scale: float | None,
    softcap: float | None = None,
) -> None:
    """Merge windowed attention of ``q [*lead, m, h, D]`` over ``k [*lead, n, h, D]``, ``v [*lead, n, h, Dv]``
    into ``out [*lead, m, h, Dv]`` / ``lse [*lead, m, h]`` (accumulators, in place); query positions are ``d``
    ahead; ``softcap``: scores capped to ``softcap·tanh(s / softcap)``."""
    for group in _grouped(band_pieces(q.shape[-3], k.shape[-3], d, window)):
        rows, keys = [p.rows for p in group], [p.keys for p in group]
        kind = group[0].kind
        if kind == DIAGONAL:
            qs, ks, vs = (_stack(x, s, False) for x, s in ((q, rows), (k, keys), (v, keys)))
            block_out, block_lse = vs, (qs.to(lse.dtype) * ks.to(lse.dtype)).sum(-1) * _scale(q, scale)
            if softcap is not None:
                block_lse = torch.tanh(block_lse / softcap) * softcap
        else:
            flip = kind == ANTI
            qs, ks, vs = (_stack(x, s, flip) for x, s in ((q, rows), (k, keys), (v, keys)))
            lead = qs.shape[:-3]
            o, s_ = block_forward(
                _to_kernel(qs), _to_kernel(ks), _to_kernel(vs), causal=kind != FULL, scale=scale, softcap=softcap
            )
            block_out, block_lse = _from_kernel(o, lead), s_.view(*lead, *s_.shape[1:]).transpose(-1, -2)
            if flip:
                block_out, block_lse = block_out.flip(-3), block_lse.flip(-2)
        for i, r in enumerate(rows):
            merge_(out[..., r, :, :], lse[..., r, :], block_out[i], block_lse[i])


def attend_band_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    d: int,
    window: int,
    scale: float | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attend_band_into` given the *final* merged ``out``/``lse``: ``(dq, dk, dv)`` shaped
    like ``q``, ``k``, ``v``, in the accumulation dtype (zeros where no piece reaches)."""
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for group in _grouped(band_pieces(q.shape[-3], k.shape[-3], d, window)):
        rows, keys = [p.rows for p in group], [p.keys for p in group]
        kind = group[0].kind
        flip = kind == ANTI
        dos, qs, os_ = (_stack(x, rows, flip) for x in (dout, q, out))
        ls = _stack_lse(lse, rows, flip)
        ks, vs = (_stack(x, keys, flip) for x in (k, v))
        gq, gk, gv = _piece_backward(kind, dos, qs, ks, vs, os_, ls, scale, softcap)
        if flip:
            gq, gk, gv = gq.flip(-3), gk.flip(-3), gv.flip(-3)
        for i, (r, s) in enumerate(zip(rows, keys, strict=True)):
            dq[..., r, :, :] += gq[i]
            dk[..., s, :, :] += gk[i]
            dv[..., s, :, :] += gv[i]
    return dq, dk, dv


def _piece_backward(
    kind: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stacked group's ``(dq, dk, dv)`` in token layout (flash-style, with the final ``out``/``lse``)."""
    if kind == DIAGONAL:  # one key per row: p = exp(s - lse), dv = p·dout, ds = p·(dout·v - D)
        acc = accum_dtype(q.dtype)
        q, k, v, dout, out = (x.to(acc) for x in (q, k, v, dout, out))
        factor = _scale(q, scale)
        s = (q * k).sum(-1) * factor
        if softcap is not None:  # s capped to c·tanh(s / c); dS scaled by 1 - tanh²
            t = torch.tanh(s / softcap)
            s, factor = t * softcap, (1 - t * t) * factor
        p = torch.exp(s - lse.to(acc))
        ds = p * ((dout * v).sum(-1) - (dout * out).sum(-1)) * factor
        return ds.unsqueeze(-1) * k, ds.unsqueeze(-1) * q, p.unsqueeze(-1) * dout
    lead = q.shape[:-3]
    grads = block_backward(
        _to_kernel(dout), _to_kernel(q), _to_kernel(k), _to_kernel(v), _to_kernel(out),
        lse.transpose(-1, -2).reshape(-1, lse.shape[-1], lse.shape[-2]), causal=kind != FULL, scale=scale,
        softcap=softcap,
    )  # fmt: skip
    return tuple(_from_kernel(g, lead) for g in grads)
