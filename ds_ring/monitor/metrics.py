"""Per-step metrics: every rank's totals gathered, reduced to min / max, written by rank 0.

The writer is anything with DeepSpeed's ``write_events([(name, value, step), ...])`` (the
engine's ``engine.monitor``, which fans out to the CSV / TensorBoard / W&B / Comet backends the
ds_config enables). Names are ``ds_ring/<metric>_min`` and ``ds_ring/<metric>_max``; the CSV
monitor writes each to ``<output_path>/<job_name>/ds_ring_<metric>_<min|max>.csv``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_gather
from ds_ring.comm.group_ranks import group_rank
from ds_ring.comm.spans import group_members
from ds_ring.monitor.timeline import MONITOR_OP_PREFIX, RankTotals

__all__ = ["METRICS", "EventWriter", "MetricsReporter", "rank_metrics"]

METRICS = (
    "attention_ms",  # wall time in attention (forward + backward), waits included
    "attention_compute_ms",  # attention time not blocked on communication
    "comm_ms",  # time ds_ring's transfers were in flight
    "comm_wait_ms",  # time blocked waiting for them
    "comm_hidden_share",  # 1 - comm_wait / comm: the share of communication hidden behind compute
    "sent_bytes",
    "received_bytes",
    "peak_memory_mib",  # peak memory of the process so far (CUDA allocator, else resident set)
    "step_ms",  # wall time of the training step on this rank
)


class EventWriter(Protocol):
    def write_events(self, event_list: list[tuple[str, float, int]]) -> None: ...


def rank_metrics(totals: RankTotals, step_s: float, peak_bytes: int) -> list[float]:
    """This rank's values of :data:`METRICS`, in order."""
    return [
        totals.attention_s * 1e3,
        totals.attention_compute_s * 1e3,
        totals.comm_s * 1e3,
        totals.comm_wait_s * 1e3,
        totals.hidden_share,
        float(totals.sent_bytes),
        float(totals.received_bytes),
        peak_bytes / 2**20,
        step_s * 1e3,
    ]


def _min_max(values: list[float]) -> tuple[float, float]:
    known = [v for v in values if not math.isnan(v)]
    return (min(known), max(known)) if known else (math.nan, math.nan)


class MetricsReporter:
    """Gathers :func:`rank_metrics` from every rank (an all-gather over ``group``, every rank, on CPU
    tensors: ``None`` is the world; bounded by ``timeout_s``, ``None``: 300 s) and writes min / max from rank 0."""

    def __init__(
        self, writer: EventWriter | None, timeout_s: float | None = None, group: ProcessGroup | None = None
    ) -> None:
        self.writer, self.timeout_s, self.group = writer, timeout_s, group
        self.rank = group_rank(None)

    def report(self, step: int, values: list[float], scalars: Mapping[str, Any]) -> dict[str, float]:
        """Collective: every rank calls it with its values; returns ``{"<metric>_min": ..., "<metric>_max": ...}``.

        ``scalars`` (e.g. the loss) are written as ``ds_ring/<name>`` with rank 0's value.
        """
        mine = torch.tensor(values, dtype=torch.float64)
        rows = all_gather(
            mine, group_members(self.group), group=self.group, op=f"{MONITOR_OP_PREFIX}metrics", step=step,
            timeout_s=self.timeout_s,
        )  # fmt: skip
        table = torch.stack(rows).tolist()
        summary: dict[str, float] = {}
        for i, name in enumerate(METRICS):
            low, high = _min_max([row[i] for row in table])
            summary[f"{name}_min"], summary[f"{name}_max"] = low, high
        summary.update({name: float(value) for name, value in scalars.items()})
        if self.rank == 0 and self.writer is not None:
            self.writer.write_events([(f"ds_ring/{name}", value, step) for name, value in summary.items()])
        return summary
