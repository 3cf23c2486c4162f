"""Attention sinks (GPT-OSS): one more key per head with score ``a`` and value 0 (docs/design.md §Windows and sinks).

In LSE space a sink is one more piece to merge: ``lse' = logaddexp(lse, a)``, ``out' = out · exp(lse − lse')``.
It has value 0, so the backward of every real block is unchanged when run with the final ``out'`` and
``lse'`` (``p_j = exp(s_j − lse')``, ``D = rowsum(dout ⊙ out')``), and the sink's own gradient is
``d a = − Σ_rows exp(a − lse') · D``. Token layout: ``out [*lead, rows, heads, D]``, ``lse [*lead, rows, heads]``,
``sinks [heads]``.
"""

from __future__ import annotations

import torch

from ds_ring.kernels.delta import OutputByDelta, row_delta

__all__ = ["add_sinks_", "sinks_grad", "check_sinks"]


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """``ValueError`` unless ``sinks`` is ``None`` or a ``[heads]`` tensor of ``q``'s dtype and device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[2]:
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"sinks must be a [heads] tensor with one logit per query head ({q.shape[2]} here), got {shape}; pass "
            f"the layer's sink logits for this rank's heads"
        )
    if sinks.dtype != q.dtype or sinks.device != q.device:
        raise ValueError(
            f"sinks must have q's dtype and device ({q.dtype}, {q.device}), got {sinks.dtype}, {sinks.device}; pass "
            f"sinks.to(q)"
        )


def add_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Merge one sink per head into the accumulators ``out``/``lse`` (accumulation dtype), in place."""
    sink = sinks.to(lse.dtype)
    merged = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))  # lse = -inf (no key): weight 0, out stays 0
    lse.copy_(merged)


def sinks_grad(
    dout: torch.Tensor, out: torch.Tensor | OutputByDelta, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """``d sinks [heads]`` from the final ``out``/``lse`` (sinks merged) and ``dout``, in ``sinks``' dtype."""
    acc = lse.dtype
    rowsum = out.delta.to(acc) if isinstance(out, OutputByDelta) else row_delta(dout, out, acc)
    weight = torch.exp(sinks.to(acc) - lse)
    return -(weight * rowsum).flatten(0, -2).sum(0).to(sinks.dtype)
