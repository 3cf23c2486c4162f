"""The shape a checkpoint was written at, and how (or whether) it loads at another.

A shape is the number of ranks, how they split into data-parallel replicas × sequence-parallel ranks, the
ZeRO stage and the global batch (samples per optimizer step). With sequence parallelism every rank of a
sequence group holds whole parameters (no tensor or pipeline parallelism), so the state to move is ZeRO's
partitioning of the fp32 weights and optimizer state, over every rank:

- same ZeRO stage and rank count, or stage 0 (optimizer state replicated): DeepSpeed loads it as it is;
- between ZeRO stages 1-3 at another rank count or stage: through DeepSpeed's universal checkpoint
  (:mod:`ds_ring.engine.universal`), which re-partitions per parameter (the conversion is completed with the
  optimizer-state entries the loader of the other stage family reads);
- stage 0 to ZeRO 1-3 or back: refused (the two keep the optimizer state in different files, and DeepSpeed
  converts only ZeRO checkpoints).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["TrainingShape", "how_to_load"]

Load = Literal["native", "universal"]


@dataclass(frozen=True)
class TrainingShape:
    """Ranks, their split, the ZeRO stage and the global batch (samples per optimizer step) of a run."""

    world_size: int
    data_parallel: int
    sequence_parallel: int
    zero_stage: int
    global_batch: int

    @classmethod
    def of(cls, engine: Any) -> TrainingShape:
        """The shape of a DeepSpeed engine built by :func:`ds_ring.initialize` (``engine.mpu`` a topology)."""
        mpu = getattr(engine, "mpu", None)
        world = engine.world_size
        data = mpu.get_data_parallel_world_size() if mpu is not None else world
        sequence = mpu.get_sequence_parallel_world_size() if mpu is not None else 1
        return cls(world, data, sequence, int(engine.zero_optimization_stage()), int(engine.train_batch_size()))

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> TrainingShape:
        return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.world_size} ranks = {self.data_parallel} data-parallel × {self.sequence_parallel} "
            f"sequence-parallel, ZeRO {self.zero_stage}, global batch {self.global_batch}"
        )


def how_to_load(saved: TrainingShape, current: TrainingShape) -> Load:
    """``"native"`` when DeepSpeed loads the checkpoint as it is, ``"universal"`` when it must be converted.

    Raises:
        ValueError: naming both shapes, when the checkpoint cannot be resumed at ``current``.
    """
    if saved.zero_stage == current.zero_stage and (saved.zero_stage == 0 or saved.world_size == current.world_size):
        return "native"
    if saved.zero_stage >= 1 and current.zero_stage >= 1:
        return "universal"
    raise ValueError(
        f"ds_ring: the checkpoint was written at ({saved}) and cannot be resumed at ({current}): ZeRO stage 0 keeps "
        f"the optimizer state whole beside the model, in files DeepSpeed does not convert; set "
        f"zero_optimization.stage to {'0' if saved.zero_stage == 0 else '1, 2 or 3'} (any rank count) to resume it"
    )
