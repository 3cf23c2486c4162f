"""The backward of a dense attention call written over its own inputs, block by block.

A caller that owns ``q``, ``k`` and ``v`` (Ulysses' head shards, made by its all-to-all and read by nothing else)
does not need them once their last kernel call has run, and their gradients have their shapes. So the backward runs
in blocks of at most :data:`BLOCK_ROWS` rows, key block by key block (first to last), and as soon as a block is
consumed its finished gradient is copied over it: ``dk``/``dv`` of key block ``j`` once its query blocks have run,
``dq`` of query block ``i`` once its last key block has (causal: key block ``i``; otherwise the last). What lives
besides the inputs is the ``dq`` of unfinished query blocks, one key block's ``dk``/``dv`` and one call's pieces
(docs/auto.md, "Ulysses and hybrid memory"); one kernel call over the whole sequence would instead hold ``dq``,
``dk``, ``dv`` and the stand-in output of every row next to ``q``, ``k``, ``v`` and ``dout``.

The returned gradients *are* ``q``, ``k``, ``v`` (detached views): their version counters move, so a second
backward through the same graph (``retain_graph=True``) cannot read them unnoticed; Ulysses refuses it by name first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ds_ring.kernels.delta import OutputByDelta
from ds_ring.kernels.dilated import Options, attend_backward, dilated_backward
from ds_ring.kernels.dilation import Region, add_heads_, head_groups, select_heads
from ds_ring.kernels.merge import accum_dtype
from ds_ring.kernels.piece import Grads

__all__ = ["BLOCK_ROWS", "backward_over_inputs", "dilated_backward_over_inputs"]

BLOCK_ROWS = 4096
"""Most rows of one block: a sequence of up to this many rows runs as one kernel call (nothing to gain)."""


def _dense(regions: Sequence[Region], seq: int, opts: Options) -> bool:
    """One region, rate 1, one segment over all ``seq`` rows, no window: dense attention over the whole tensors."""
    if opts.window is not None or len(regions) != 1:
        return False
    (region,) = regions
    whole = region.rows.indices(seq) == (0, seq, 1) and not region.spans
    return region.branch.rate == 1 and region.branch.segment >= seq and whole


def _accumulate(total: Tensor | None, piece: Tensor, dtype: torch.dtype) -> Tensor:
    if total is None:
        return piece if piece.dtype == dtype else piece.to(dtype)
    return total.add_(piece)


def backward_over_inputs(
    saved: Sequence[Tensor | OutputByDelta], regions: Sequence[Region], opts: Options
) -> Grads | None:
    """``(dq, dk, dv)`` of dense attention over ``q``, ``k``, ``v``, written over them; ``None`` (nothing computed or
    written) unless the call is dense (:func:`_dense`) over more than :data:`BLOCK_ROWS` rows.

    ``saved = (dout, q, k, v, out, lse)`` as in :func:`~ds_ring.kernels.dilated.regions_backward_`: ``q [B, S, H, D]``,
    ``k [B, S, Hkv, D]``, ``v [B, S, Hkv, Dv]`` (any strides; the caller's own: they are overwritten), ``dout`` in
    ``q``'s dtype, ``out`` the final output or an :class:`~ds_ring.kernels.delta.OutputByDelta`, ``lse [B, S, H]``.
    Returns detached views of ``q``, ``k``, ``v`` holding their gradients (their dtypes; accumulated in the
    accumulation dtype).
    """
    dout, q, k, v, out, lse = saved
    seq = q.shape[1]
    if seq <= BLOCK_ROWS or not _dense(regions, seq, opts):
        return None
    q, k, v = (x.detach() for x in (q, k, v))
    (group,) = head_groups(q.shape[2], k.shape[2], 1, opts.head_offset, q.device)
    kv, gqa, acc = group.kv_heads, k.shape[2] != q.shape[2], accum_dtype(q.dtype)
    count = -(-seq // BLOCK_ROWS)
    edges = [seq * i // count for i in range(count + 1)]
    rows = [slice(a, b) for a, b in zip(edges, edges[1:], strict=False)]
    dq: list[Tensor | None] = [None] * count
    for j, keys in enumerate(rows):
        k_j, v_j = k[:, keys], v[:, keys]
        k_heads, v_heads = select_heads(k_j, kv), select_heads(v_j, kv)  # GQA: expanded once per key block
        dk = dv = None
        if gqa:  # pieces come per query head: summed into zeros per K/V head
            dk, dv = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k_j, v_j))
        for i in range(j, count) if opts.causal else range(count):
            queries = rows[i]
            pieces = attend_backward(
                dout[:, queries], q[:, queries], k_heads, v_heads, out[:, queries], lse[:, queries],
                opts.piece(causal=opts.causal and i == j),
            )  # fmt: skip
            dq[i] = _accumulate(dq[i], pieces[0], acc)
            if gqa:
                add_heads_(dk, kv, pieces[1])
                add_heads_(dv, kv, pieces[2])
            else:
                dk, dv = _accumulate(dk, pieces[1], acc), _accumulate(dv, pieces[2], acc)
            del pieces  # this call's outputs and stand-in go before the next call's exist
        del k_heads, v_heads
        k_j.copy_(dk)
        v_j.copy_(dv)
        del dk, dv
        if opts.causal:  # query block j saw its last key block
            q[:, rows[j]].copy_(dq[j])
            dq[j] = None
    for i, grad in enumerate(dq):
        if grad is not None:
            q[:, rows[i]].copy_(grad)
            dq[i] = None
    return q, k, v


def dilated_backward_over_inputs(
    saved: Sequence[Tensor | OutputByDelta],
    sinks: Tensor | None,
    regions: Sequence[Region],
    opts: Options,
    sinks_wanted: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`~ds_ring.kernels.dilated.dilated_backward` for a caller that owns ``q``, ``k``, ``v``: dense attention
    writes its gradients over them (:func:`backward_over_inputs`), anything else runs as usual."""
    dout, q = saved[0], saved[1]
    saved = (dout.to(q.dtype), *saved[1:])
    return dilated_backward(saved, sinks, regions, opts, sinks_wanted, backward_over_inputs(saved, regions, opts))
