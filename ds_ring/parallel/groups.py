"""The process groups of a :class:`~ds_ring.parallel.layout.RankLayout`, and their gloo twins for control traffic.

Control traffic (agreements, metrics, guards, checkpoint tags: small CPU tensors) needs a backend that takes
CPU tensors. Where the default backend takes none (plain NCCL), every group gets a *twin*: a gloo group of
the same ranks. A :class:`~ds_ring.Topology` holds the twins of its groups; the twin of the world (or of the
group a Topology divides) is made once per process group by :func:`control_world`, for the callers that have
no Topology yet (``ds_ring.initialize`` agreeing on its config, a checkpoint of an engine without one): made
again on every call, each would leave a gloo group (and its connections) behind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_ring.comm.backends import device_backend
from ds_ring.comm.collectives import all_reduce
from ds_ring.comm.group_ranks import takes_cpu
from ds_ring.comm.job import job
from ds_ring.comm.wait import process_group_timeout_s, resolve_timeout
from ds_ring.parallel.layout import ROLES, RankLayout

__all__ = [
    "RoleGroups", "create_groups", "control_world", "needs_control_twins", "nccl_device", "group_timeout",
    "group_timeout_s",
]  # fmt: skip

logger = logging.getLogger("ds_ring.parallel")


def needs_control_twins(group: ProcessGroup | None = None) -> bool:
    """Whether groups made from ``group``'s default backend need a gloo twin for control traffic (they do
    when it takes no CPU tensors: plain NCCL). The same on every rank."""
    return not takes_cpu(group)


def control_world(group: ProcessGroup | None = None, timeout_s: float | None = None) -> ProcessGroup | None:
    """``group`` (``None``: the world) when its backend takes CPU tensors, else a gloo group of the same
    ranks, made once per group with the timeout :func:`group_timeout` gives ``timeout_s`` (``None``: 300 s).
    Collective on its first call: every rank calls it at the same point. The job's :class:`~ds_ring.comm.job.Job`
    keeps the twin; it goes with the group."""
    if not dist.is_initialized() or not needs_control_twins(group):
        return group
    world = dist.group.WORLD if group is None else group
    timeout = group_timeout(resolve_timeout(timeout_s))
    make = lambda: dist.new_group(dist.get_process_group_ranks(world), backend="gloo", timeout=timeout)
    return job().owned(world, "control twin", make)


def group_timeout(timeout_s: float) -> timedelta:
    """What every group made here gets (``new_group`` without ``timeout`` takes the backend's default, 600 s
    for NCCL and 1,800 s for gloo, whatever ds_ring's bound): twice ``timeout_s``."""
    return timedelta(seconds=process_group_timeout_s(timeout_s))


def group_timeout_s(group: ProcessGroup) -> float | None:
    """``group``'s own timeout in seconds, as its backend holds it (CPU backend first, then CUDA); ``None`` when
    no backend of it exposes one."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def nccl_device(world: ProcessGroup | None = None) -> torch.device | None:
    """The CUDA device this rank's NCCL groups are bound to: the current one when ``world``'s backend moves
    CUDA tensors with NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) and CUDA is available, else ``None``."""
    if device_backend(dist.get_backend(world), "cuda") != "nccl" or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


@dataclass(frozen=True)
class RoleGroups:
    """This rank's group of every role (:data:`~ds_ring.parallel.layout.ROLES`) and the control group of each."""

    mine: dict[str, ProcessGroup]
    """Role → this rank's process group of that role."""
    controls: dict[int, ProcessGroup | None]
    """``id`` of each of those groups (and of the world) → its group for control traffic."""


def create_groups(
    layout: RankLayout, rank: int, world: ProcessGroup, control: ProcessGroup | None, timeout_s: float
) -> RoleGroups:
    """This rank's group of every role, and the control group of each; every rank runs the same
    ``new_group`` calls in the same order, each with twice ``timeout_s`` as its timeout.

    A rank set that several roles share (e.g. sequence parallel = ulysses when ``ring == 1``) gets
    one process group; the set of all ranks is ``world`` itself (its control group: ``control``) when ``world``'s
    own timeout is at least twice ``timeout_s``, else a group of its own with that timeout (and its gloo twin),
    with a warning naming both: reusing a world with a shorter timeout (DeepSpeed's ``init_distributed`` gives
    1,800 s) would let the backend's bound (NCCL's watchdog, gloo's timeout) end a wait ds_ring still allows. The
    world's timeout is the one every rank passed to ``init_process_group``, so every rank makes the same groups.
    When ``world``'s backend takes no CPU tensors (:func:`needs_control_twins`) every other set also gets a gloo
    group, for control traffic.

    On NCCL (:func:`nccl_device`) each group is made with ``device_id``, so NCCL connects its communicator
    at creation, and then warmed up by one 1-element all-reduce, in creation order (the same on every
    rank, so no two ranks wait on each other's groups in opposite orders): its communicator never comes
    from a first batched point-to-point that might leave a member out (a packed batch, odd segments).
    """
    timeout, device = group_timeout(timeout_s), nccl_device(world)
    twins = needs_control_twins(world)
    bound = {} if device is None or getattr(dist.group.WORLD, "bound_device_id", None) else {"device_id": device}
    made: dict[tuple[int, ...], tuple[ProcessGroup, ProcessGroup | None]] = {}
    mine: dict[str, ProcessGroup] = {}
    controls: dict[int, ProcessGroup | None] = {id(world): control}
    warm: list[ProcessGroup] = []
    world_s = group_timeout_s(world)
    reuse_world = world_s is not None and world_s >= timeout.total_seconds()
    if not reuse_world and rank == 0:
        logger.warning(
            "ds_ring: the world process group's timeout (%s s) is shorter than twice timeout_s (2 × %g s): the "
            "groups of every rank are a new process group with a %g s timeout instead of the world (one more "
            "communicator); start torch.distributed with timeout=timedelta(seconds=%g) (deepspeed.init_distributed "
            "or init_process_group) to reuse the world",
            "unknown" if world_s is None else f"{world_s:g}", timeout_s, timeout.total_seconds(),
            timeout.total_seconds(),
        )  # fmt: skip
    for role in ROLES:
        for ranks in layout.groups(role):
            if ranks not in made:
                if len(ranks) == layout.world_size and reuse_world:
                    made[ranks] = (world, control)
                else:
                    group = dist.new_group(list(ranks), timeout=timeout, **bound)
                    twin = dist.new_group(list(ranks), backend="gloo", timeout=timeout) if twins else group
                    made[ranks] = (group, twin)
                    if device is not None and rank in ranks and len(ranks) > 1:
                        warm.append(group)
                    if len(ranks) == layout.world_size:
                        controls[id(world)] = twin  # control traffic of every rank: bounded like the rest
            if rank in ranks:
                mine[role] = made[ranks][0]
                controls[id(made[ranks][0])] = made[ranks][1]
    for group in warm:
        all_reduce(torch.zeros(1, device=device), group=group, op="Topology warm-up", timeout_s=timeout_s)
    return RoleGroups(mine, controls)
