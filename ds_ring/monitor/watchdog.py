"""Watchdog: communication errors logged where they happen; an optional deadline on each training step.

Every wait in ``ds_ring.comm`` is bounded by the configured ``timeout_s`` and raises an error
naming this rank, the peer, the ring step and the operation; the watchdog logs it the moment it
is raised (a ``"comm_error"`` event) with the training step and layer, so the cause is in the log
even when a launcher kills the process right after. With ``step_timeout_s`` a training step still
running after that long (a hang outside ds_ring's waits) makes the process log it, dump every
thread's stack and exit with code 1.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

from ds_ring.hooks import Event, current_labels
from ds_ring.monitor.deepspeed_collectives import running_collective

__all__ = ["Watchdog", "EXIT_CODE"]

EXIT_CODE = 1
logger = logging.getLogger("ds_ring.monitor")


class Watchdog:
    """A hook for ``"comm_error"`` events, and a step deadline (``step_timeout_s``, ``None``: none)."""

    def __init__(self, rank: int, step_timeout_s: float | None = None) -> None:
        self.rank = rank
        self.step_timeout_s = step_timeout_s
        self.errors: list[str] = []
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._step = -1
        self._closed = False
        self._thread: threading.Thread | None = None

    def __call__(self, event: Event) -> None:
        if event.kind != "comm_error":
            return
        labels = current_labels()
        where = [f"training step {labels['train_step']}"] if "train_step" in labels else []
        where += [f"layer {labels['layer']}"] if "layer" in labels else []
        context = f" [{', '.join(where)}]" if where else ""
        error = str(event.extra.get("error", event)).removeprefix("ds_ring: ")
        message = f"ds_ring watchdog: {error}{context}"
        self.errors.append(message)
        logger.error(message)

    def arm(self, step: int) -> None:
        """Start the deadline of training step ``step`` (no-op without ``step_timeout_s``)."""
        if self.step_timeout_s is None:
            return
        with self._cond:
            self._step, self._deadline = step, time.monotonic() + self.step_timeout_s
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="ds_ring-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed, self._deadline = True, None
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._expire()

    def _expire(self) -> None:
        collective = running_collective()
        inside = f" inside DeepSpeed's {collective}" if collective else ""
        logger.error(
            "ds_ring watchdog: rank %d: training step %d still running after %s s (step_timeout_s)%s; "
            "dumping every thread's stack and exiting with code %d",
            self.rank, self._step, self.step_timeout_s, inside, EXIT_CODE,
        )  # fmt: skip
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_CODE)
