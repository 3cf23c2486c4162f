"""A stand-in for the attention output in the backward, built from ``dout`` and ``Delta = rowsum(dout ∘ out)``.

A flash-style backward reads ``out`` only through ``Delta``: ``dS = P ∘ (dout·Vᵀ − Delta)``, and the sinks' gradient
(:mod:`ds_ring.kernels.sinks`) likewise. So a caller that knows ``Delta`` but no longer holds ``out`` (Ulysses computes
``Delta`` on its sequence shards, before ``dout`` is exchanged to head shards) can give the kernels any tensor with the
same row sums: here ``Delta · dout / |dout|²`` per row, which has them up to rounding (every term of ``|dout|²`` is
positive, so the error is a few ulps of ``Delta`` itself).
"""

from __future__ import annotations

import torch

__all__ = ["stand_in_output"]


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
