"""Token losses over a sequence split across ranks.

Each rank holds a slice of the tokens, and slices hold different numbers of real (non-padding)
tokens, so averaging per-rank means is wrong. The helpers here sum over the local tokens, add up
sums and counts over the sequence-parallel group, and divide once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_reduce
from ds_ring.kernels.merge import accum_dtype
from ds_ring.parallel.topology import Topology, sequence_group

__all__ = ["sequence_parallel_cross_entropy", "sequence_parallel_mean"]


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup | Topology | None = None,
    *,
    ignore_index: int = -100,
    timeout_s: float | None = None,
    gradient_scale: float = 1.0,
) -> torch.Tensor:
    """Mean cross-entropy over every counted token of the sequences sharded across ``group``.

    Args:
        logits: local ``[..., vocab]`` (e.g. ``[batch, seq/p, vocab]``); computed in fp32 (fp64 stays fp64).
        labels: local ``[...]`` class indices; ``ignore_index`` marks tokens not counted (padding).
        group: a :class:`ds_ring.Topology` (its sequence-parallel group), or the sequence-parallel
            process group itself (``None``: the default group).
        timeout_s: bound in seconds on the one all-reduce (``None``: the topology's; 300 s for a plain group).
        gradient_scale: factor on this rank's gradient share (not on the value): the sequence-parallel degree
            for an engine that divides the all-rank gradient sum by every rank (ZeRO 3's reduce-scatter path,
            :mod:`ds_ring.engine.gradient_scale`), else 1.

    Returns:
        A scalar equal on every rank to (sum of token losses) / (number of counted tokens), over
        the whole group. Its gradient on each rank is that rank's tokens' share, so summing
        gradients over the group — what ZeRO's sequence-data-parallel reduction does — gives the
        gradient of the global mean. Zero (with zero gradient) when no token is counted anywhere.
    """
    logits = logits.reshape(-1, logits.shape[-1])
    logits = logits.to(accum_dtype(logits.dtype))
    local_sum = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
    local_count = (labels != ignore_index).sum()
    return sequence_parallel_mean(local_sum, local_count, group, timeout_s=timeout_s, gradient_scale=gradient_scale)


def sequence_parallel_mean(
    local_sum: torch.Tensor,
    local_count: torch.Tensor,
    group: ProcessGroup | Topology | None = None,
    *,
    timeout_s: float | None = None,
    gradient_scale: float = 1.0,
) -> torch.Tensor:
    """The mean over a sequence group of per-token values this rank has summed: ``Σ sums / Σ counts``.

    Args:
        local_sum: this rank's scalar sum of token values (e.g. token losses), with its autograd graph.
        local_count: this rank's number of counted tokens (scalar, any dtype).
        group, timeout_s, gradient_scale: as :func:`sequence_parallel_cross_entropy`.

    Returns:
        A scalar, the same on every rank; its gradient is this rank's share ``gradient_scale × local_sum /
        Σ counts`` (zero when no token is counted anywhere), so the group's gradients sum to the mean's.
    """
    local_count = local_count.to(local_sum.dtype)
    group, timeout_s = sequence_group(group, timeout_s)
    global_sum, global_count = all_reduce(
        torch.stack([local_sum.detach(), local_count]), group=group, timeout_s=timeout_s
    )
    share = local_sum * gradient_scale / global_count.clamp(min=1)
    # Same value on every rank (the global mean); gradient of this rank's (scaled) share only.
    return share + (global_sum / global_count.clamp(min=1) - share).detach()
