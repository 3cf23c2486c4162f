"""Rank arithmetic of process groups (no communication happens here)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["group_rank", "group_size", "global_rank", "global_ranks", "takes_cpu", "CPU_BACKENDS"]

CPU_BACKENDS = ("gloo", "mpi", "ucc")
"""Backends that run collectives on CPU tensors (NCCL takes CUDA tensors only)."""


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group`` (``None``: the default group); 1 when torch.distributed is not initialised."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank within ``group``; 0 when torch.distributed is not initialised."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def global_rank(group: ProcessGroup | None, rank: int) -> int:
    """Global rank of group-local ``rank``."""
    if group is None or not dist.is_initialized():
        return rank
    return dist.get_global_rank(group, rank)


def global_ranks(group: ProcessGroup | None, ranks: range | tuple[int, ...] | list[int]) -> list[int]:
    """Global ranks of several group-local ranks, in order."""
    return [global_rank(group, r) for r in ranks]


def takes_cpu(group: ProcessGroup | None) -> bool:
    """Whether ``group``'s backend runs collectives on CPU tensors: ``gloo``, ``mpi``, ``ucc``, or a per-device
    backend such as ``"cpu:gloo,cuda:nccl"``; ``True`` without torch.distributed. The same on every rank."""
    if not dist.is_initialized():
        return True
    backend = str(dist.get_backend(group)).lower()
    devices = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    if devices:
        return devices.get("cpu") in CPU_BACKENDS
    return backend in CPU_BACKENDS
