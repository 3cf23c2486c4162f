"""DeepSpeed ALST's tiled computations (its "full recipe"), with ALST's names and signatures, on ds_ring's tiles.

``from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, TiledFusedLogitsLoss,
sequence_tiled_compute`` becomes ``from ds_ring.integrations.hf import ...``; the calls stay as they are
(``TiledMLP.apply(fn, self, x, shards, compute_params)``, ...). The work is :mod:`ds_ring.tiles.compute`'s:
the forward keeps only the inputs, the backward recomputes one tile at a time, and ZeRO 1-3 reduce each
parameter once per step.

Where ds_ring differs from ALST:

* ``TiledFusedLogitsLoss`` with ``output_reduction="mean"`` weights each tile by its token count: a per-tile
  mean loss gives the mean over all tokens when the last tile is shorter (ALST averages the tiles' means,
  off by ``O(1 / tokens)``); with equal tiles the two are the same. ALST's ``sum`` is unchanged.
* ``sequence_tiled_compute``'s ``"mean"``/``"sum"`` are plain reductions of the joined output, with their
  exact gradients for every ``output_unshard_dimension`` (ALST's backward handles a reduced output only for
  ``output_unshard_dimension=0``).
* Arguments are checked, each error naming the argument and the fix; ``compute_params=None`` is allowed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ds_ring.integrations.internal import tiled_loss, tiled_recompute

__all__ = ["TiledMLP", "TiledFusedLogitsLoss", "sequence_tiled_compute"]


class TiledMLP:
    """ALST's ``TiledMLP``: ``TiledMLP.apply(fn, self, x, shards, compute_params)`` is ``fn(self, x)`` computed
    ``shards`` tiles of tokens at a time, its activations recomputed per tile in the backward."""

    @staticmethod
    def apply(
        fn: Callable[[Any, torch.Tensor], torch.Tensor],
        self: Any,
        x: torch.Tensor,
        shards: int,
        compute_params: Sequence[torch.nn.Parameter] | None = None,
    ) -> torch.Tensor:
        """``fn(self, x)`` over ``shards`` tiles of ``x``'s tokens.

        Args:
            fn: the MLP's own forward, ``fn(self, rows [tokens, hidden]) -> [tokens, out]``, token-wise.
            self: the MLP module, passed to ``fn``.
            x: ``[batch, seq, hidden]`` or ``[tokens, hidden]`` (a mixture of experts' tokens).
            shards: how many tiles (batch and sequence flattened; the last tile may be shorter).
            compute_params: the weights ``fn`` uses (ZeRO reduces each once); ``None``: no ZeRO coordination.

        Returns:
            ``[..., out]``: ``fn``'s output with ``x``'s leading dimensions.
        """
        rows = x.reshape(-1, x.shape[-1])
        out = tiled_recompute(
            lambda x: fn(self, x), {"x": rows}, passed={}, dim=0, tiles=shards, grad_key="x",
            params=compute_params or (),
        )  # fmt: skip
        return out.view(*x.shape[:-1], out.shape[-1])


class TiledFusedLogitsLoss:
    """ALST's ``TiledFusedLogitsLoss``: a loss over tiles of tokens, the ``[tokens, vocab]`` logits of one tile
    at a time; each tile is back-propagated as soon as its loss exists, so nothing is recomputed."""

    @staticmethod
    def apply(
        fn: Callable[..., torch.Tensor],
        self: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Sequence[torch.nn.Parameter] | None,
        output_reduction: str,
    ) -> torch.Tensor:
        """``fn(self, x_tile, y_tile[, mask_tile])`` over ``shards`` tiles, reduced.

        Args:
            fn: one tile's scalar loss (e.g. ``cross_entropy(self.lm_head(x), y)``); tiles are ``[tokens, ...]``.
            self: passed to ``fn`` (the model or its LM head's owner).
            x: ``[batch, seq, hidden]`` hidden states (gets the gradient); y: ``[batch, seq]`` targets.
            mask: ``[batch, seq]``, or ``None`` (not passed to ``fn``).
            shards: how many tiles over the ``batch × seq`` tokens.
            compute_params: the weights ``fn`` uses (the LM head's): their gradients are accumulated in this
                call, and ZeRO reduces each once.
            output_reduction: ``"mean"`` (tiles weighted by their token counts) or ``"sum"``; with a mask or
                ignored labels pass ``"sum"`` of per-tile sums and divide by the token count yourself.

        Returns:
            The scalar loss.
        """
        return tiled_loss(fn, self, x, y, mask, tiles=shards, params=compute_params or (), reduction=output_reduction)


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: Mapping[str, torch.Tensor],
    kwargs_to_pass: Mapping[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[torch.nn.Parameter] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> torch.Tensor:
    """ALST's ``sequence_tiled_compute``: ``fn(**kwargs_to_shard, **kwargs_to_pass)`` over ``shards`` tiles of
    the sequence (dimension 1), recomputed per tile in the backward.

    Args:
        fn: computes one tile, position-wise along the sequence.
        seqlen: the sequence length: dimension 1 of every ``kwargs_to_shard`` tensor.
        shards: how many tiles (``ceil(seqlen / shards)`` positions each, the last shorter).
        kwargs_to_shard: ``[batch, seq, ...]`` tensors cut into tiles.
        kwargs_to_pass: passed to every call as they are.
        grad_requiring_tensor_key: the entry of ``kwargs_to_shard`` that gets a gradient.
        compute_params: the weights ``fn`` uses (ZeRO reduces each once); ``None``: no ZeRO coordination.
        output_unshard_dimension: where the tiles' outputs are joined: 1 (the sequence) concatenates, 0
            stacks them (one scalar per tile, e.g. a loss).
        output_reduction: ``None`` (the joined output), ``"mean"`` or ``"sum"`` of it.

    Returns:
        The joined output, or its mean / sum (a scalar).
    """
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}")
    if output_unshard_dimension not in (0, 1):
        raise ValueError(
            f"output_unshard_dimension must be 1 (concatenate along the sequence) or 0 (stack one output per "
            f"tile), got {output_unshard_dimension!r}"
        )
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not a key of kwargs_to_shard "
            f"{sorted(kwargs_to_shard)}; name the sharded tensor that needs a gradient"
        )
    for key, value in kwargs_to_shard.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"kwargs_to_shard[{key!r}] must be a [batch, seqlen={seqlen}, ...] tensor, got {shape}; pass "
                f"seqlen = its dimension 1, or move it to kwargs_to_pass"
            )
    out = tiled_recompute(
        fn, kwargs_to_shard, passed=kwargs_to_pass, dim=1, tiles=shards, grad_key=grad_requiring_tensor_key,
        params=compute_params or (), stack=output_unshard_dimension == 0,
    )  # fmt: skip
    if output_reduction == "mean":
        return out.mean()
    return out.sum() if output_reduction == "sum" else out
