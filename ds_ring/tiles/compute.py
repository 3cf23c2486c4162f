"""Any token-wise computation over tiles of a sequence, recomputed tile by tile in the backward.

:func:`tiled_recompute` runs ``fn`` on tiles of its tiled inputs with autograd off, so only the inputs and
the concatenated output are kept; the backward runs ``fn`` again on one tile at a time with autograd on
and back-propagates that tile's part of the incoming gradient, so ``fn``'s intermediates exist for one tile
at a time. Gradients reach the tiled input (summed into one buffer) and every parameter ``fn`` uses
(accumulated in its ``.grad`` tile after tile, as autograd does for a module called several times).

Under DeepSpeed ZeRO a parameter's reduction hook fires at each accumulation; :func:`held_until_last`
tells ZeRO 1-3 to wait for the last tile (DeepSpeed's ``ds_grad_is_ready`` attribute), so the parameter is
reduced once per step, as for an untiled module. ``fn`` reaches its parameters through its modules, whose
ZeRO-3 hooks gather them around every call.

:func:`tiled_loss` is the same for a loss: it back-propagates each tile as soon as its loss exists (in the
forward), so nothing is recomputed; the input's gradient waits in a buffer for the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["tile_bounds", "tiled_recompute", "tiled_loss", "held_until_last"]

_READY = "ds_grad_is_ready"  # DeepSpeed ZeRO 1-3 reduce a parameter's gradient only when this is not False


def tile_bounds(length: int, tiles: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``length`` positions cut into at most ``tiles`` tiles of ``ceil(length / tiles)``
    (the last shorter; empty tiles dropped). ``ValueError`` for ``tiles < 1``."""
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"the number of tiles (shards) must be an integer >= 1, got {tiles!r}")
    step = max(-(-length // tiles), 1)
    return [(start, min(start + step, length)) for start in range(0, length, step)]


@contextmanager
def held_until_last(params: Sequence[torch.nn.Parameter], last: bool) -> Iterator[None]:
    """Inside: ZeRO holds ``params``' gradients back unless ``last`` (the final tile's accumulation); after the
    final tile the attribute is removed, so nothing outlives the tiled computation."""
    for param in params:
        setattr(param, _READY, last)
    try:
        yield
    finally:
        if last:
            for param in params:
                if hasattr(param, _READY):
                    delattr(param, _READY)


class _TiledRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, keys, passed, dim, bounds, stack, params, grad_index, *tiled):  # noqa: ANN001, ANN205
        ctx.fn, ctx.keys, ctx.passed, ctx.dim, ctx.bounds, ctx.params = fn, keys, passed, dim, bounds, params
        ctx.grad_index, ctx.stack = grad_index, stack
        ctx.save_for_backward(*tiled)
        with torch.no_grad():
            outputs = [fn(**_tile(keys, tiled, dim, start, stop), **passed) for start, stop in bounds]
        return torch.stack(outputs) if stack else torch.cat(outputs, dim=dim)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        tiled = list(ctx.saved_tensors)
        wanted = ctx.needs_input_grad[8 + ctx.grad_index]
        source = tiled[ctx.grad_index].detach()
        grad_in = torch.zeros_like(source) if wanted else None
        params = [p for p in ctx.params if p.requires_grad]
        for i, (start, stop) in enumerate(ctx.bounds):
            pieces = _tile(ctx.keys, tiled, ctx.dim, start, stop)
            tile = source.narrow(ctx.dim, start, stop - start).detach().requires_grad_(wanted)
            pieces[ctx.keys[ctx.grad_index]] = tile
            grad_tile = grad_out[i] if ctx.stack else grad_out.narrow(ctx.dim, start, stop - start)
            with torch.enable_grad(), held_until_last(params, i == len(ctx.bounds) - 1):
                out = ctx.fn(**pieces, **ctx.passed)
                if out.requires_grad:
                    torch.autograd.backward(out, grad_tile)
            if wanted and tile.grad is not None:
                grad_in.narrow(ctx.dim, start, stop - start).copy_(tile.grad)
            del out, tile  # this tile's activations go before the next tile's exist
        grads = [None] * len(tiled)
        grads[ctx.grad_index] = grad_in
        return (None,) * 8 + tuple(grads)


def _tile(keys: Sequence[str], tiled: Sequence[torch.Tensor], dim: int, start: int, stop: int) -> dict[str, Any]:
    return {key: value.narrow(dim, start, stop - start) for key, value in zip(keys, tiled, strict=True)}


def tiled_recompute(
    fn: Callable[..., torch.Tensor],
    tiled: Mapping[str, torch.Tensor],
    *,
    passed: Mapping[str, Any],
    dim: int,
    tiles: int,
    grad_key: str,
    params: Sequence[torch.nn.Parameter] = (),
    stack: bool = False,
) -> torch.Tensor:
    """``fn(**tile_of(tiled), **passed)`` for every tile along ``dim``, joined; ``fn``'s activations recomputed
    per tile in the backward.

    Args:
        fn: computes one tile; position-wise along ``dim`` (a tile's output depends on that tile's inputs only).
        tiled: tensors of the same length along ``dim``, cut into tiles.
        passed: keyword arguments given to every call as they are (no gradient flows into them).
        dim: the tiled dimension (the sequence: 1 for ``[batch, seq, ...]``, 0 for ``[tokens, ...]``).
        tiles: how many tiles (:func:`tile_bounds`).
        grad_key: the entry of ``tiled`` that gets a gradient (the others are treated as constants).
        params: the parameters ``fn`` uses that ZeRO must reduce once (:func:`held_until_last`).
        stack: join the tiles' outputs with ``torch.stack`` (e.g. one loss per tile) instead of concatenating
            them along ``dim``.

    Returns:
        The joined output: ``fn``'s outputs concatenated along ``dim``, or stacked ``[tiles, ...]``.
    """
    keys = list(tiled)
    length = tiled[grad_key].shape[dim]
    for key, value in tiled.items():
        if value.shape[dim] != length:
            raise ValueError(
                f"{key!r} has {value.shape[dim]} positions along dim {dim} but {grad_key!r} has {length}; tile "
                f"only tensors of the same sequence length"
            )
    bounds = tile_bounds(length, tiles)
    params = tuple(params)
    return _TiledRecompute.apply(
        fn, keys, dict(passed), dim, bounds, stack, params, keys.index(grad_key), *tiled.values()
    )


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, self, mask, bounds, weights, params, grad_mode, x, y):  # noqa: ANN001, ANN205
        rows_x, rows_y = x.detach().flatten(0, 1), y.flatten(0, 1)
        rows_mask = None if mask is None else mask.flatten(0, 1)
        wanted = grad_mode and x.requires_grad
        grad_x = torch.zeros_like(rows_x) if wanted else None
        params = [p for p in params if p.requires_grad] if grad_mode else []
        total = None
        for i, ((start, stop), weight) in enumerate(zip(bounds, weights, strict=True)):
            tile = rows_x[start:stop].requires_grad_(wanted)
            args = (self, tile, rows_y[start:stop]) + (() if rows_mask is None else (rows_mask[start:stop],))
            with torch.set_grad_enabled(grad_mode), held_until_last(params, i == len(bounds) - 1):
                out = fn(*args)
                if out.requires_grad and (wanted or params):
                    torch.autograd.backward(out, torch.full_like(out, weight))
            if wanted and tile.grad is not None:
                grad_x[start:stop] = tile.grad
            part = out.detach() * weight
            total = part if total is None else total + part
        ctx.grad_x = None if grad_x is None else grad_x.view_as(x)
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: ANN001, ANN205
        grad_x, ctx.grad_x = ctx.grad_x, None
        if grad_x is not None:
            grad_x.mul_(grad_total.to(grad_x.dtype))
        return None, None, None, None, None, None, None, grad_x, None


def tiled_loss(
    fn: Callable[..., torch.Tensor],
    module: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    tiles: int,
    params: Sequence[torch.nn.Parameter] = (),
    reduction: str,
) -> torch.Tensor:
    """A loss over tiles of ``[batch, seq]`` tokens: ``fn(module, x_tile, y_tile[, mask_tile])`` per tile, reduced.

    Args:
        fn: one tile's scalar loss; ``x_tile [tokens, ...]``, ``y_tile [tokens, ...]``, ``mask_tile [tokens]``
            (batch and sequence flattened, so tiles cut across rows as ALST's do).
        module: passed to ``fn`` first (the LM head's owner).
        x: ``[batch, seq, ...]`` inputs (hidden states); the only tensor that gets a gradient through the output.
        y: ``[batch, seq, ...]`` targets; mask: ``[batch, seq]`` or ``None`` (then not passed to ``fn``).
        tiles: how many tiles (:func:`tile_bounds` over ``batch × seq`` tokens).
        params: the parameters ``fn`` uses that ZeRO must reduce once (:func:`held_until_last`).
        reduction: ``"sum"`` of the tiles' losses, or ``"mean"``: weighted by each tile's token count, so a
            per-tile mean loss gives the mean over all tokens even when the last tile is shorter.

    Returns:
        A scalar. The parameters' gradients are accumulated during this call (grad mode on); ``x``'s is
        handed on by the backward, times the incoming gradient.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"output_reduction must be 'mean' or 'sum', got {reduction!r}")
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise ValueError(
            f"x and y must be [batch, seq, ...] with the same batch and seq, got x {tuple(x.shape)}, y "
            f"{tuple(y.shape)}; pass hidden states and their shift_labels"
        )
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
    tokens = x.shape[0] * x.shape[1]
    bounds = tile_bounds(tokens, tiles)
    weights = [(stop - start) / tokens if reduction == "mean" else 1.0 for start, stop in bounds]
    grad_mode = torch.is_grad_enabled()  # off inside an autograd Function's forward: read it here
    return _TiledLoss.apply(fn, module, mask, bounds, weights, tuple(params), grad_mode, x, y)
