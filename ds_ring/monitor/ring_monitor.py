"""``RingMonitor``: the built-in hooks a ds_config switches on, driven by the training loop.

``ds_ring.initialize`` attaches one to the engine as ``engine.ring_monitor``. A training loop calls::

    for step in range(start, steps):
        monitor.begin_step(step + 1)          # labels events, starts the step deadline
        loss = ...forward...
        if not monitor.skip_step():           # collective only under numerics_guard "skip_step"
            engine.backward(loss)
            engine.step()
        monitor.end_step(loss=loss.item())    # collective only with metrics: gathers and writes them

Every rank must make the same calls (the collectives run over the whole world).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from ds_ring.comm.group_ranks import group_rank
from ds_ring.hooks import PHASES, HookHandle, peak_memory_bytes, pop_labels, push_labels, register_hook
from ds_ring.monitor.deepspeed_collectives import NamedCollectives
from ds_ring.monitor.guard import GUARD_MODES, NumericsGuard
from ds_ring.monitor.layers import label_layers
from ds_ring.monitor.metrics import EventWriter, MetricsReporter, rank_metrics
from ds_ring.monitor.timeline import StepTimeline
from ds_ring.monitor.watchdog import Watchdog

__all__ = ["RingMonitor"]

logger = logging.getLogger("ds_ring.monitor")


class RingMonitor:
    """The metrics hook, the watchdog and the numerics guard, each on when asked for.

    Args:
        metrics: gather per-step metrics (:data:`ds_ring.monitor.metrics.METRICS`, min and max over
            ranks) in :meth:`end_step` and write them to ``writer`` from rank 0.
        watchdog: log communication errors where they happen, DeepSpeed's collectives included (their
            failures renamed by :class:`~ds_ring.monitor.deepspeed_collectives.NamedCollectives`); ``step_timeout_s``:
            exit a process whose training step runs longer (``None``: no deadline).
        numerics_guard: ``"off"``, ``"warn"``, ``"raise"`` or ``"skip_step"``.
        model: its attention modules label events with their names (for messages).
        writer: DeepSpeed's ``engine.monitor`` (anything with ``write_events``).
        timeout_s: bound in seconds on the metrics and guard collectives (``None``: 300 s).
        group: the group of every rank those collectives (small CPU tensors) take: one whose backend takes
            CPU tensors (``topology.control_group(None)``; ``None``: the world).
    """

    def __init__(
        self,
        *,
        metrics: bool = False,
        watchdog: bool = True,
        step_timeout_s: float | None = None,
        numerics_guard: str = "off",
        model: nn.Module | None = None,
        writer: EventWriter | None = None,
        timeout_s: float | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        if numerics_guard not in GUARD_MODES:
            raise ValueError(f"ds_ring: numerics_guard must be one of {list(GUARD_MODES)}, got {numerics_guard!r}")
        self.rank = group_rank(None)
        self.step = 0
        self._hooks: list[HookHandle] = []
        self._module_hooks: list[RemovableHandle] = []
        self._labels: Mapping[str, Any] | None = None
        self._started = time.perf_counter()
        self.timeline = StepTimeline() if metrics else None
        self.reporter = MetricsReporter(writer, timeout_s, group) if metrics else None
        self.guard = NumericsGuard(numerics_guard, timeout_s, group) if numerics_guard != "off" else None
        self.watchdog = Watchdog(self.rank, step_timeout_s) if watchdog else None
        self._collectives = NamedCollectives(timeout_s) if watchdog else None
        if self.timeline is not None:
            self._hooks.append(register_hook(self.timeline, phases=PHASES))
        for hook in (self.guard, self.watchdog):
            if hook is not None:
                self._hooks.append(register_hook(hook))
        if model is not None and self._hooks:
            self._module_hooks = label_layers(model)

    def begin_step(self, step: int) -> None:
        """Training step ``step`` starts: label events with it, reset the sums, arm the deadline."""
        self._pop_labels()
        self.step = step
        self._labels = push_labels(train_step=step)
        if self.timeline is not None:
            self.timeline.take()
        if self.guard is not None:
            self.guard.reset()
        if self.watchdog is not None:
            self.watchdog.arm(step)
        self._started = time.perf_counter()

    def skip_step(self) -> bool:
        """Whether to skip this step's backward and optimizer step (the same answer on every rank).

        Only under ``numerics_guard: skip_step`` is this a collective (one small all-reduce); else
        it is ``False`` at once.
        """
        if self.guard is None or self.guard.mode != "skip_step":
            return False
        ranks = self.guard.agree_to_skip(self.step)
        if ranks:
            logger.warning(
                "ds_ring numerics guard: rank %d skips training step %d (non-finite attention on rank(s) %s)",
                self.rank, self.step, ranks,
            )  # fmt: skip
        return bool(ranks)

    def end_step(self, **scalars: float) -> dict[str, float]:
        """The step is done: with metrics, gather and write them (collective); disarm the deadline.

        ``scalars`` (e.g. ``loss=...``) are written too, with rank 0's value. Returns the written
        values (``{}`` without metrics).
        """
        summary: dict[str, float] = {}
        if self.reporter is not None and self.timeline is not None:
            values = rank_metrics(self.timeline.take(), time.perf_counter() - self._started, peak_memory_bytes())
            summary = self.reporter.report(self.step, values, scalars)
        if self.watchdog is not None:
            self.watchdog.disarm()
        self._pop_labels()
        return summary

    def close(self) -> None:
        """Remove every hook (events, module hooks, the deadline)."""
        for handle in self._hooks:
            handle.remove()
        for handle in self._module_hooks:
            handle.remove()
        self._hooks, self._module_hooks = [], []
        if self.watchdog is not None:
            self.watchdog.close()
        if self._collectives is not None:
            self._collectives.close()
        self._pop_labels()

    def _pop_labels(self) -> None:
        if self._labels is not None:
            pop_labels(self._labels)
            self._labels = None
