"""DeepSpeed's ``mpu`` interface over a topology's groups: the getters ``deepspeed.initialize(mpu=...)`` reads.

Two meanings of "data parallel" meet here and must not be confused:

- DeepSpeed's :meth:`DeepSpeedMpu.get_data_parallel_group` is the group of every rank that shares
  gradients and over which ZeRO-3 partitions parameters: with sequence parallelism that is *all*
  ``D·U·R`` ranks (as with DeepSpeed's own sequence-parallel mpu);
- the topology's ``data_parallel_group`` holds the ``D`` *replicas* of this rank's position only
  (same ring and ulysses index): what the data loader splits batches over
  (:meth:`DeepSpeedMpu.get_data_parallel_world_size`, :meth:`DeepSpeedMpu.get_data_parallel_rank`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed import ProcessGroup

from ds_ring.parallel.layout import RankLayout

__all__ = ["DeepSpeedMpu"]


def _role_getters(
    role: str, size: str, position: Callable[[RankLayout, int], int]
) -> tuple[Callable[[Any], ProcessGroup], Callable[[Any], int], Callable[[Any], int]]:
    """DeepSpeed's three getters of ``role``'s group, as methods of :class:`DeepSpeedMpu`: the ``<role>_group``
    attribute, the layout's ``size`` attribute (the group's rank count) and ``position(layout, rank)`` (this
    rank's index in the group)."""

    def group(self: DeepSpeedMpu) -> ProcessGroup:
        return getattr(self, f"{role}_group")

    def world_size(self: DeepSpeedMpu) -> int:
        return getattr(self.layout, size)

    def rank(self: DeepSpeedMpu) -> int:
        return position(self.layout, self.rank)

    for getter, what in ((group, "group"), (world_size, "world_size"), (rank, "rank")):
        getter.__name__ = getter.__qualname__ = f"get_{role}_{what}"
    return group, world_size, rank


class DeepSpeedMpu:
    """The mpu getters over ``layout``, ``rank`` and the ``<role>_group`` attributes of the class it is mixed into
    (:class:`ds_ring.Topology`).

    ZeRO reduces gradients over :meth:`get_sequence_data_parallel_group` (all ``D·U·R`` ranks) and divides by
    its size / sequence-parallel size = ``D`` (ZeRO-3's reduce-scatter path, DeepSpeed's default, divides by
    all ``D·U·R``: see :mod:`ds_ring.loss`); ZeRO-3 partitions parameters over all ranks
    (:meth:`get_data_parallel_group`); the data loader splits batches over the ``D`` replicas; the
    model-parallel group is this rank alone (no tensor or pipeline parallelism), so gradient norms count
    every replicated parameter once. It deliberately has no ``initialize_sequence_parallel`` attribute:
    DeepSpeed takes that as the sign of its own sequence-parallel mpu and would then ignore this object's
    data-parallel group.
    """

    layout: RankLayout
    rank: int
    sequence_parallel_group: ProcessGroup
    ulysses_group: ProcessGroup
    ring_group: ProcessGroup
    sequence_data_parallel_group: ProcessGroup
    model_parallel_group: ProcessGroup

    # Data parallel: DeepSpeed's group is every rank sharing gradients; its size and rank count the replicas.

    def get_data_parallel_group(self) -> ProcessGroup:
        """Every rank sharing gradients, which ZeRO-3 partitions parameters over: all ``D·U·R`` ranks, not the
        ``D`` replicas of ``data_parallel_group``. DeepSpeed asks it only to partition (``deepspeed.initialize``
        at ZeRO 3 converting the model) and for MoE / pipeline groups; the data loader's replicas are
        :meth:`get_data_parallel_world_size` / :meth:`get_data_parallel_rank`, and gradients are reduced over
        :meth:`get_sequence_data_parallel_group` at every stage."""
        return self.sequence_data_parallel_group

    def get_data_parallel_world_size(self) -> int:
        """The ``D`` replicas the data loader splits batches over."""
        return self.layout.data_parallel

    def get_data_parallel_rank(self) -> int:
        """This rank's replica index ``d``."""
        return self.layout.coords(self.rank)[0]

    def get_data_parallel_group_ranks(self) -> list[int]:
        """The ranks of this rank's ``D`` replicas (same ring and ulysses index)."""
        return list(self.layout.group_of("data_parallel", self.rank))

    # No tensor or pipeline parallelism ------------------------------------------------------------

    def get_model_parallel_group(self) -> ProcessGroup:
        return self.model_parallel_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_world_size(self) -> int:
        """No tensor parallelism: 1 (DeepSpeed's universal checkpoint loading asks)."""
        return 1

    def get_tensor_model_parallel_rank(self) -> int:
        return 0

    # Sequence parallel, and its sub-groups: ``get_<role>_group``, ``get_<role>_world_size``, ``get_<role>_rank``.

    get_sequence_parallel_group, get_sequence_parallel_world_size, get_sequence_parallel_rank = _role_getters(
        "sequence_parallel", "sequence_parallel", RankLayout.sequence_parallel_rank
    )
    get_sequence_data_parallel_group, get_sequence_data_parallel_world_size, get_sequence_data_parallel_rank = (
        _role_getters("sequence_data_parallel", "world_size", lambda _layout, rank: rank)
    )
    get_ulysses_group, get_ulysses_world_size, get_ulysses_rank = _role_getters(
        "ulysses", "ulysses", lambda layout, rank: layout.coords(rank)[2]
    )
    get_ring_group, get_ring_world_size, get_ring_rank = _role_getters(
        "ring", "ring", lambda layout, rank: layout.coords(rank)[1]
    )
