"""A gated MLP (``down(act(gate(x)) * up(x))``, Llama's SwiGLU and its kin) run over tiles of tokens.

The forward keeps only the MLP's input; the backward recomputes each tile's ``[tile, intermediate]``
activations and sums the weights' gradients over the tiles, so the intermediate is never held for
more than one tile. The weights are read whole once per forward and once per backward
(:mod:`ds_ring.tiles.zero`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ds_ring.tiles.zero import gathered

__all__ = ["tiled_gated_mlp", "gated_mlp_parts"]

_PARTS = ("gate_proj", "up_proj", "down_proj")


def gated_mlp_parts(mlp: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear, Callable] | None:
    """``(gate_proj, up_proj, down_proj, act_fn)`` of a gated MLP whose children are exactly those, else ``None``."""
    children = dict(mlp.named_children())
    if set(children) != {*_PARTS, "act_fn"} or not all(isinstance(children[name], nn.Linear) for name in _PARTS):
        return None
    return children["gate_proj"], children["up_proj"], children["down_proj"], children["act_fn"]


def _gated(x: torch.Tensor, act: Callable, params: Sequence[torch.Tensor | None]) -> torch.Tensor:
    gate_w, gate_b, up_w, up_b, down_w, down_b = params
    return F.linear(act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


class _TiledGatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act, tile_tokens, *params):  # noqa: ANN001, ANN205
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], params[4].shape[0], dtype=x.dtype, device=x.device)
        for start in range(0, rows.shape[0], tile_tokens):
            out[start : start + tile_tokens] = _gated(rows[start : start + tile_tokens], act, params)
        ctx.save_for_backward(x)
        ctx.act, ctx.tile_tokens, ctx.params = act, tile_tokens, params
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        params = ctx.params
        rows = x.detach().reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        want_x = ctx.needs_input_grad[0]
        wanted = [p is not None and need for p, need in zip(params, ctx.needs_input_grad[3:], strict=True)]
        grad_x = torch.empty_like(rows) if want_x else None
        with gathered([p for p in params if p is not None]):
            pairs = zip(params, wanted, strict=True)
            leaves = [p.detach().requires_grad_(want) if p is not None else None for p, want in pairs]
            sums = [torch.zeros_like(p) if want else None for p, want in zip(leaves, wanted, strict=True)]
            inputs = [leaf for leaf, want in zip(leaves, wanted, strict=True) if want]
            for start in range(0, rows.shape[0], ctx.tile_tokens):
                tile = rows[start : start + ctx.tile_tokens].requires_grad_(want_x)
                with torch.enable_grad():
                    out = _gated(tile, ctx.act, leaves)
                    grads = torch.autograd.grad(
                        out, [tile] * want_x + inputs, grad_rows[start : start + ctx.tile_tokens]
                    )
                if want_x:
                    grad_x[start : start + ctx.tile_tokens] = grads[0]
                for total, grad in zip([s for s in sums if s is not None], grads[want_x:], strict=True):
                    total += grad
                del out, grads  # this tile's activations go before the next tile's exist
        grad_x = grad_x.view_as(x) if want_x else None
        return (grad_x, None, None, *sums)


def tiled_gated_mlp(mlp: nn.Module, x: torch.Tensor, *, tile_tokens: int) -> torch.Tensor:
    """``mlp(x)`` for a gated MLP (:func:`gated_mlp_parts`), ``tile_tokens`` rows of ``x [..., hidden]`` at a time.

    Returns ``[..., hidden]``, equal to the untiled MLP's output, with exact gradients for ``x`` and every
    weight and bias.
    """
    gate, up, down, act = gated_mlp_parts(mlp)
    params = (gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)
    with gathered([p for p in params if p is not None]):
        return _TiledGatedMLP.apply(x, act, tile_tokens, *params)
