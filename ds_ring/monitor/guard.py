"""Numerics guard: NaN or Inf in an attention output or LSE, handled as the config says.

Checked on the end event of every attention forward (``extra["out"]``, ``extra["lse"]``). In the
LSE, NaN and ``+inf`` are faults; ``-inf`` is how a row that no key covers is marked, not a fault.
Modes: ``warn`` logs a warning naming the rank, layer and training step (once per layer and
step); ``raise`` raises :class:`NumericsError`; ``skip_step`` warns and remembers, and
:meth:`NumericsGuard.agree_to_skip` (a collective) tells every rank whether any rank saw one.
On CUDA the check synchronises with the device once per attention call.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_reduce
from ds_ring.comm.group_ranks import group_rank, group_size
from ds_ring.hooks import Event, current_labels
from ds_ring.monitor.timeline import MONITOR_OP_PREFIX

__all__ = ["GUARD_MODES", "NumericsError", "NumericsGuard", "nonfinite_report"]

GUARD_MODES = ("off", "warn", "raise", "skip_step")
logger = logging.getLogger("ds_ring.monitor")


class NumericsError(FloatingPointError):
    """An attention output or LSE held NaN or Inf (``numerics_guard: raise``)."""

    def __init__(self, rank: int, layer: str, step: int, detail: str) -> None:
        self.rank, self.layer, self.step, self.detail = rank, layer, step, detail
        super().__init__(describe(rank, layer, step, detail))

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), (self.rank, self.layer, self.step, self.detail)


def describe(rank: int, layer: str, step: int, detail: str) -> str:
    return f"ds_ring numerics guard: rank {rank}, layer {layer}, training step {step}: {detail}"


def nonfinite_report(out: torch.Tensor, lse: torch.Tensor) -> str | None:
    """``None`` when ``out`` is finite and ``lse`` holds no NaN or ``+inf``; else what was found."""
    lse_bad = torch.isnan(lse) | torch.isposinf(lse)
    if bool(torch.isfinite(out).all()) and not bool(lse_bad.any()):
        return None
    return (
        f"attention output holds {int(torch.isnan(out).sum())} NaN and {int(torch.isinf(out).sum())} Inf "
        f"of {out.numel()} values, LSE {int(torch.isnan(lse).sum())} NaN and {int(torch.isposinf(lse).sum())} "
        f"+Inf of {lse.numel()}"
    )


class NumericsGuard:
    """A hook checking attention forwards; ``mode`` is one of :data:`GUARD_MODES` other than ``off``;
    :meth:`agree_to_skip`'s all-reduce runs over ``group`` (every rank, CPU tensors; ``None``: the world),
    bounded by ``timeout_s`` (``None``: 300 s)."""

    def __init__(self, mode: str, timeout_s: float | None = None, group: ProcessGroup | None = None) -> None:
        if mode not in GUARD_MODES[1:]:
            raise ValueError(f"ds_ring: numerics_guard must be one of {list(GUARD_MODES[1:])} here, got {mode!r}")
        self.mode, self.timeout_s, self.group = mode, timeout_s, group
        self.rank = group_rank(None)
        self.found: list[str] = []  # messages since the last agree_to_skip() / reset()
        self._warned: set[tuple[object, str]] = set()

    def __call__(self, event: Event) -> None:
        if event.kind != "attention" or event.extra.get("direction") != "forward" or "out" not in event.extra:
            return
        detail = nonfinite_report(event.extra["out"], event.extra["lse"])
        if detail is None:
            return
        labels = current_labels()
        layer, step = str(labels.get("layer", "?")), labels.get("train_step", -1)
        if self.mode == "raise":
            raise NumericsError(self.rank, layer, step, detail)
        message = describe(self.rank, layer, step, detail)
        self.found.append(message)
        if (step, layer) not in self._warned:
            self._warned.add((step, layer))
            action = "this step will be skipped on every rank" if self.mode == "skip_step" else "training goes on"
            logger.warning("%s; %s", message, action)

    def reset(self) -> None:
        self.found.clear()
        self._warned.clear()

    def agree_to_skip(self, step: int = -1) -> list[int]:
        """Collective over the world: the ranks that found a NaN / Inf since the last call (empty: none)."""
        flags = torch.zeros(group_size(None), dtype=torch.float64)
        flags[self.rank] = 1.0 if self.found else 0.0
        total = all_reduce(flags, group=self.group, op=f"{MONITOR_OP_PREFIX}guard", step=step, timeout_s=self.timeout_s)
        self.found.clear()
        return [rank for rank, flag in enumerate(total.tolist()) if not math.isclose(flag, 0.0)]
