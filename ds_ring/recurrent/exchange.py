"""The one exchange recurrent layers make: an all-gather of small per-chunk summaries, differentiable.

Forward: every rank of the sequence-parallel group gets every rank's flat summary (:func:`ds_ring.comm.collectives
.all_gather`, so the comm hooks count its bytes). Backward: each rank's copy of the gathered summaries has a gradient;
the gradient of rank ``r``'s summary is the sum over ranks of their copies' row ``r``, one all-reduce of the same size.
Neither grows with the sequence: a summary is a state (``[batch, heads, d_head, d_state]``) or a convolution halo
(``[batch, channels, width - 1]``) per chunk.

Every rank's backward must reach the all-reduce, including ranks whose outputs did not need the gathered summaries
(the first chunk, a chunk starting a document): :func:`tie` makes a tensor depend on them at no cost.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_gather, all_reduce
from ds_ring.comm.group_ranks import global_ranks, group_rank, group_size

__all__ = ["gather_summaries", "tie"]


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, flat: torch.Tensor, group: ProcessGroup | None, op: str, timeout_s: float | None
    ) -> torch.Tensor:
        ctx.group, ctx.op, ctx.timeout_s = group, op, timeout_s
        world = group_size(group)
        parts = all_gather(
            flat.contiguous(), global_ranks(group, range(world)), group=group, op=op, timeout_s=timeout_s
        )
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        summed = all_reduce(grad.contiguous(), group=ctx.group, op=f"{ctx.op}_grad", timeout_s=ctx.timeout_s)
        return summed[group_rank(ctx.group)], None, None, None


def gather_summaries(
    flat: torch.Tensor, group: ProcessGroup | None, *, op: str, timeout_s: float | None = None
) -> torch.Tensor:
    """``[world, n]``: every group rank's 1-D ``flat [n]`` (all equal in size), differentiable (see module doc)."""
    if group_size(group) == 1:
        return flat[None]
    return _Gather.apply(flat, group, op, timeout_s)


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        ctx.other_shape, ctx.other_dtype, ctx.other_device = other.shape, other.dtype, other.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.zeros(ctx.other_shape, dtype=ctx.other_dtype, device=ctx.other_device)


def tie(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged, but depending on ``other`` in autograd (with a zero gradient): ``other``'s backward runs
    whenever ``x``'s does."""
    if not (torch.is_grad_enabled() and other.requires_grad):
        return x
    return _Tie.apply(x, other)
