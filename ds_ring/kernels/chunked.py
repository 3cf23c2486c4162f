"""A tiled pure-torch block kernel (``torch``): any device and dtype, never a whole block's score matrix.

Used where no fused kernel returns the LSE (CUDA fp64, ROCm, other devices) and when ``DS_RING_KERNEL=torch``.
The block is cut into tiles of (batch·heads, query rows, key rows) whose score-sized temporaries hold at
most :data:`TILE_BYTES` together (:func:`tiling`):

- forward: per query tile, each key tile gives an exactly normalised ``(out, lse)`` that is LSE-merged
  (:func:`ds_ring.kernels.merge.merge_`) into the tile's accumulators; one score tile is alive at a time
  (masked, shifted, exponentiated and normalised in place);
- backward: every tile's probabilities are recomputed from the *final* LSE (flash-style), so tiles are
  independent; the probabilities and ``dP`` are the two score-sized tiles alive.

A causal block (square, aligned at its first row) is tiled as a square grid: query tile ``i`` meets key
tiles ``j <= i`` and masks only the diagonal one, so every computed row has at least its own key.
Accumulation is in float32 (float64 for float64 inputs).

``v`` may have another head dim than ``q``/``k`` (multi-head latent attention: ``q``, ``k`` ``[.., D]``, ``v``
``[.., Dv]``; ``out`` and ``dout`` then have ``Dv``). The only kernel that takes ``softcap`` (Gemma 2): scores
``s = q·kᵀ·scale`` become ``c·tanh(s / c)`` before the softmax; the backward recomputes ``t = tanh(s / c)``
and multiplies ``dS`` by ``1 - t²`` (a third score-sized tile, inside the same budget).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ds_ring.kernels.base import BlockKernel
from ds_ring.kernels.merge import accum_dtype, merge_

__all__ = ["CHUNKED", "TILE_BYTES", "Tiling", "tiling"]

TILE_BYTES = 8 * 2**20
"""Bytes of score-sized temporaries (in the accumulation dtype) one tile may hold."""


@dataclass(frozen=True)
class Tiling:
    """A tile: ``matrices`` (batch, head) pairs × ``rows`` query rows × ``keys`` key rows."""

    matrices: int
    rows: int
    keys: int


def tiling(
    batch_heads: int, m: int, n: int, causal: bool, itemsize: int, *, scores: int = 1, budget: int = TILE_BYTES
) -> Tiling:
    """The tile for ``batch_heads`` matrices of ``m`` query × ``n`` key rows: ``scores`` score-sized tensors of
    ``itemsize`` bytes per element fit ``budget`` (``matrices·rows·keys·itemsize·scores <= budget``, unless one
    score alone is larger). Causal tiles are square (``rows == keys``)."""
    elems = max(1, budget // (itemsize * scores))
    side = max(1, math.isqrt(elems // batch_heads)) if elems >= batch_heads else 1
    rows = min(m, side)
    keys = rows if causal else min(n, max(1, elems // (batch_heads * rows)))
    return Tiling(min(batch_heads, max(1, elems // (rows * keys))), rows, keys)


def _matrices(batch: int, heads: int, per_tile: int) -> Iterator[tuple[slice, slice]]:
    """``(batch slice, head slice)`` covering ``batch × heads`` matrices, ``per_tile`` (or fewer) at a time."""
    if per_tile >= heads:
        step = per_tile // heads
        for b in range(0, batch, step):
            yield slice(b, b + step), slice(None)
    else:
        for b in range(batch):
            for h in range(0, heads, per_tile):
                yield slice(b, b + 1), slice(h, h + per_tile)


def _starts(length: int, step: int) -> range:
    return range(0, length, step)


def _check(q: Tensor, k: Tensor, causal: bool) -> None:
    if q.dim() != 4:
        raise ValueError(f"ds_ring: block kernels take [batch, heads, rows, head_dim], got q of shape {tuple(q.shape)}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"ds_ring: a causal block is square; got {q.shape[-2]} query rows and {k.shape[-2]} keys")


def _mask_diagonal_(s: Tensor) -> None:
    """Mask keys after each row's own in a diagonal tile (square, aligned)."""
    rows = s.shape[-1]
    s.masked_fill_(torch.ones(rows, rows, dtype=torch.bool, device=s.device).triu(1), float("-inf"))


def _cap_(s: Tensor, softcap: float) -> Tensor:
    """``softcap · tanh(s / softcap)`` in place."""
    return s.div_(softcap).tanh_().mul_(softcap)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """``q``, ``k`` ``[B, H, m|n, D]``, ``v [B, H, n, Dv]`` → ``out [B, H, m, Dv]`` (``q.dtype``), ``lse [B, H, m]``."""
    _check(q, k, causal)
    acc = accum_dtype(q.dtype)
    (batch, heads, m, _), n = q.shape, k.shape[-2]
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc, device=q.device)
    tile = tiling(batch * heads, m, n, causal, torch.finfo(acc).bits // 8, budget=TILE_BYTES)
    for b, h in _matrices(batch, heads, tile.matrices):
        for i in _starts(m, tile.rows):
            rows = slice(i, i + tile.rows)
            qt = q[b, h, rows].to(acc) * scale
            o = torch.zeros((*qt.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
            l_ = torch.full(qt.shape[:-1], float("-inf"), dtype=acc, device=q.device)
            for j in _starts(i + 1 if causal else n, tile.keys):
                keys = slice(j, j + tile.keys)
                s = torch.matmul(qt, k[b, h, keys].to(acc).transpose(-1, -2))
                if softcap is not None:
                    _cap_(s, softcap)
                if causal and j == i:
                    _mask_diagonal_(s)
                top = s.amax(-1, keepdim=True)
                total = s.sub_(top).exp_().sum(-1, keepdim=True)
                s.div_(total)
                merge_(o, l_, torch.matmul(s, v[b, h, keys].to(acc)), (top + total.log()).squeeze(-1))
                del s
            out[b, h, rows], lse[b, h, rows] = o, l_
    return out.to(q.dtype), lse


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dout``/``out`` ``[B, H, m, Dv]``, the rest as in :func:`_forward` → ``(dq, dk, dv)`` shaped like
    ``q``, ``k``, ``v`` in their dtypes."""
    _check(q, k, causal)
    acc = accum_dtype(q.dtype)
    (batch, heads, m, _), n = q.shape, k.shape[-2]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    scores = 2 if softcap is None else 3  # p and dP, and with a cap its tanh
    tile = tiling(batch * heads, m, n, causal, torch.finfo(acc).bits // 8, scores=scores, budget=TILE_BYTES)
    for b, h in _matrices(batch, heads, tile.matrices):
        for i in _starts(m, tile.rows):
            rows = slice(i, i + tile.rows)
            qt, dot = q[b, h, rows].to(acc), dout[b, h, rows].to(acc)
            delta = (dot * out[b, h, rows].to(acc)).sum(-1, keepdim=True)
            lt = lse[b, h, rows].to(acc).unsqueeze(-1)
            dqt = dq[b, h, rows]
            for j in _starts(i + 1 if causal else n, tile.keys):
                keys = slice(j, j + tile.keys)
                kt, vt = k[b, h, keys].to(acc), v[b, h, keys].to(acc)
                p = torch.matmul(qt, kt.transpose(-1, -2)).mul_(scale)
                tanh = None
                if softcap is not None:  # p = exp(c·t - lse) with t = tanh(s / c); keep t for dS
                    tanh = p.div_(softcap).tanh_()
                    p = tanh * softcap
                if causal and j == i:
                    _mask_diagonal_(p)
                p.sub_(lt).exp_()
                dv[b, h, keys] += torch.matmul(p.transpose(-1, -2), dot)
                ds = torch.matmul(dot, vt.transpose(-1, -2)).sub_(delta).mul_(p).mul_(scale)
                del p
                if tanh is not None:  # d(c·tanh(s / c))/ds = 1 - t²
                    ds.mul_(tanh.square_().neg_().add_(1))
                    del tanh
                dqt += torch.matmul(ds, kt)
                dk[b, h, keys] += torch.matmul(ds.transpose(-1, -2), qt)
                del ds
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


CHUNKED = BlockKernel("torch", _forward, _backward, softcap=True)
