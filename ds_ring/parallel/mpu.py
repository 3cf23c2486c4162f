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

from torch.distributed import ProcessGroup

from ds_ring.parallel.layout import RankLayout

__all__ = ["DeepSpeedMpu"]


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

    def _coord(self, index: int) -> int:
        return self.layout.coords(self.rank)[index]

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
        return self._coord(0)

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

    # Sequence parallel ------------------------------------------------------------------------------

    def get_sequence_parallel_group(self) -> ProcessGroup:
        return self.sequence_parallel_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.layout.sequence_parallel

    def get_sequence_parallel_rank(self) -> int:
        return self.layout.sequence_parallel_rank(self.rank)

    def get_sequence_data_parallel_group(self) -> ProcessGroup:
        return self.sequence_data_parallel_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.layout.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    # The sub-groups of the sequence-parallel group ----------------------------------------------

    def get_ulysses_group(self) -> ProcessGroup:
        return self.ulysses_group

    def get_ulysses_world_size(self) -> int:
        return self.layout.ulysses

    def get_ulysses_rank(self) -> int:
        return self._coord(2)

    def get_ring_group(self) -> ProcessGroup:
        return self.ring_group

    def get_ring_world_size(self) -> int:
        return self.layout.ring

    def get_ring_rank(self) -> int:
        return self._coord(1)
