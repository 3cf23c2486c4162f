"""The log-sum-exp merge (docs/design.md §The LSE merge): the one piece of math every strategy rests on.

If piece *i* of a key set gives attention output ``o_i`` and log-sum-exp ``lse_i`` for a query
row, the exact result over the union of the pieces is::

    lse = logsumexp_i(lse_i)
    o   = sum_i exp(lse_i - lse) * o_i

A piece that covers no key for a row has ``lse_i = -inf`` and weight 0; a row no piece covers
keeps ``lse = -inf`` and ``o = 0``. The same merge combines ring steps, dilation branches and
blockwise compute. Pure tensor math: no other ds_ring import, no ``torch.distributed``.
"""

from __future__ import annotations

import torch

__all__ = ["merge", "merge_", "accum_dtype"]


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for outputs and LSE: float64 stays float64, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weights(lse: torch.Tensor, new_lse: torch.Tensor) -> torch.Tensor:
    # Rows with new_lse == -inf have no key in either piece: weight 0 instead of exp(-inf - -inf) = nan.
    finite = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    return torch.exp(lse - finite)


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one piece into running accumulators, in place.

    Args:
        out: running output ``[..., rows, head_dim]`` (or any ``[..., D]``), accumulation dtype;
            may be a strided view into a larger accumulator.
        lse: running log-sum-exp, ``out.shape[:-1]``, same dtype as ``out``; updated in place.
        block_out: the piece's output, broadcastable to ``out`` (any float dtype).
        block_lse: the piece's log-sum-exp, shape of ``lse`` (``-inf`` where the piece is empty).
    """
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(_weights(lse, new_lse).unsqueeze(-1))
    out.addcmul_(block_out, _weights(block_lse, new_lse).unsqueeze(-1))  # no output-sized temporary
    lse.copy_(new_lse)


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional form of :func:`merge_`: returns the merged ``(out, lse)`` in accumulation dtype."""
    acc = accum_dtype(out.dtype)
    merged_out, merged_lse = out.to(acc).clone(), lse.to(acc).clone()
    merge_(merged_out, merged_lse, block_out, block_lse)
    return merged_out, merged_lse
