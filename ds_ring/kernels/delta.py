"""A stand-in for the attention output in the backward, built from ``dout`` and ``Delta = rowsum(dout ∘ out)``.

A flash-style backward reads ``out`` only through ``Delta``: ``dS = P ∘ (dout·Vᵀ − Delta)``, and the sinks' gradient
(:mod:`ds_ring.kernels.sinks`) likewise. So a caller that knows ``Delta`` but no longer holds ``out`` (Ulysses computes
``Delta`` on its sequence shards, before ``dout`` is exchanged to head shards) can give the kernels any tensor with the
same row sums: here ``Delta · dout / |dout|²`` per row, which has them up to rounding (every term of ``|dout|²`` is
positive, so the error is a few ulps of ``Delta`` itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["stand_in_output", "OutputByDelta", "row_delta", "materialized"]


def stand_in_output(dout: torch.Tensor, delta: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """Write ``Delta · dout / |dout|²`` (per row; 0 where ``dout`` is 0) into ``into`` and return it.

    Args:
        dout: ``[..., Dv]``, any strides; delta: ``[...]`` (accumulation dtype).
        into: ``[..., Dv]`` in the kernels' dtype, not overlapping ``dout`` (e.g. a consumed receive buffer).
    Returns:
        ``into``, whose ``rowsum(dout ∘ into)`` equals ``delta`` up to rounding.
    """
    # Rows scaled by their largest entry first: |dout|² then neither underflows nor overflows.
    top = dout.abs().amax(-1, keepdim=True).to(delta.dtype)
    top = torch.where(top > 0, top, torch.ones_like(top))
    torch.div(dout, top, out=into)
    norm = torch.linalg.vector_norm(into, dim=-1, keepdim=True, dtype=delta.dtype).square_()
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))
    return into.mul_(delta.unsqueeze(-1) / (top * norm))


class OutputByDelta:
    """The attention output as a backward reads it, ``out`` itself gone: ``dout [..., rows, h, Dv]`` and ``Delta =
    rowsum(dout ∘ out) [..., rows, h]`` (accumulation dtype).

    Indexed and unflattened like ``out`` over the dims before ``Dv`` (views of both), it is handed where ``out``
    would be; :meth:`materialize` (called by the kernels' backward entry) writes the stand-in of just those rows, so
    a backward holds one call's stand-in instead of the whole output.
    """

    def __init__(self, dout: torch.Tensor, delta: torch.Tensor) -> None:
        if tuple(dout.shape[:-1]) != tuple(delta.shape):
            raise ValueError(f"Delta {tuple(delta.shape)} must be dout {tuple(dout.shape)} without its last dim")
        self.dout, self.delta = dout, delta

    @property
    def shape(self) -> torch.Size:
        return self.dout.shape

    def __getitem__(self, index: Any) -> OutputByDelta:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.delta.dim() or any(i is Ellipsis or i is None for i in index):
            raise IndexError("an OutputByDelta is indexed over the dims before the head dim only")
        return OutputByDelta(self.dout[index], self.delta[index])

    def unflatten(self, dim: int, sizes: Sequence[int]) -> OutputByDelta:
        if not 0 <= dim < self.delta.dim():
            raise IndexError("an OutputByDelta is unflattened over the dims before the head dim only")
        return OutputByDelta(self.dout.unflatten(dim, sizes), self.delta.unflatten(dim, sizes))

    def materialize(self, dtype: torch.dtype) -> torch.Tensor:
        """A new ``[..., Dv]`` tensor in ``dtype`` whose row sums with ``dout`` are ``Delta``."""
        return stand_in_output(
            self.dout, self.delta, torch.empty(self.dout.shape, dtype=dtype, device=self.dout.device)
        )


def row_delta(dout: torch.Tensor, out: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``Delta = rowsum(dout ∘ out)`` over the last dim, in ``acc``."""
    return torch.linalg.vecdot(dout.to(acc), out.to(acc))


def materialized(out: torch.Tensor | OutputByDelta, dtype: torch.dtype) -> torch.Tensor:
    """``out`` itself, or the stand-in an :class:`OutputByDelta` gives in ``dtype``."""
    return out.materialize(dtype) if isinstance(out, OutputByDelta) else out
