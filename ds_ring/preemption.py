"""Preemption: on SIGTERM / SIGUSR1 every rank stops at the end of the same step, which is then saved.

A scheduler that preempts a job signals it and kills it a grace period later (SLURM: ``--signal=USR1@90``
or SIGTERM then SIGKILL after ``KillWait``; Kubernetes: SIGTERM, SIGKILL after
``terminationGracePeriodSeconds``; ``torchrun`` and the ``deepspeed`` launcher forward SIGTERM to their
workers and SIGKILL them 30 s later). :class:`Preemption` turns the first signal on any rank into an agreed
stop:

- the handler only records the signal (and starts the grace timer); the rank carries on with its step;
- at the end of every step the training loop calls :meth:`Preemption.stop_requested`, one all-reduce of
  one integer over the control group (CPU, bounded by the section's ``timeout_s``): it is true on every
  rank as soon as one rank has been signalled, so all ranks stop after the same step, save it
  (:func:`ds_ring.save_checkpoint`: published atomically) and exit 0;
- past ``grace_s`` seconds after the signal, or on another signal later than ``repeat_window_s`` seconds
  after the first, the process ends at once (``os._exit``, codes :data:`GRACE_EXPIRED` and 128 + signal).
  A save cut short that way never becomes the checkpoint ``latest`` names.

Until the loop first polls, a signal keeps its old effect (the default action runs): a loop that never
asks is never left running on a swallowed SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.comm.collectives import all_reduce
from ds_ring.config import PreemptionConfig

__all__ = ["Preemption", "GRACE_EXPIRED"]

GRACE_EXPIRED = 124
"""Exit code of a process whose grace period ran out before it had saved and exited."""

logger = logging.getLogger("ds_ring.preemption")
_Handler = Callable[[int, FrameType | None], Any] | int | None


class Preemption:
    """Signal handlers plus the per-step agreement to stop (``engine.preemption`` after :func:`ds_ring.initialize`).

    Args:
        config: the section's ``preemption`` entry.
        group: the ranks that stop together; a group whose backend takes CPU tensors (the topology's control group).
        timeout_s: bound in seconds on the per-step all-reduce.
        exit: how the process ends past the grace or on a second signal (tests replace it); default ``os._exit``.
    """

    def __init__(
        self,
        config: PreemptionConfig,
        *,
        group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        self.config, self.group, self.timeout_s, self._exit = config, group, timeout_s, exit
        self.signalled: str | None = None  # name of the first signal this rank received
        self.signalled_at: float | None = None  # time.monotonic() of it
        self.stopping = False  # the ranks agreed to stop
        self._polled = False
        self._previous: dict[signal.Signals, _Handler] = {}
        self._timer: threading.Timer | None = None

    def install(self) -> Preemption:
        """Catch the configured signals (main thread only; elsewhere, or with ``enabled: false``, nothing)."""
        if not self.config.enabled or threading.current_thread() is not threading.main_thread():
            return self
        for name in self.config.signals:
            number = signal.Signals[name]
            self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def close(self) -> None:
        """Restore the handlers :meth:`install` replaced and stop the grace timer."""
        for number, handler in self._previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def stop_requested(self, step: int = -1) -> bool:
        """Collective over ``group``, at the end of every step: whether any rank has been signalled.

        ``step`` (1-based) is named in a timeout error. Once true it stays true (no more exchanges).
        """
        self._polled = True
        if self.stopping:
            return True
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int64)
        if dist.is_initialized():
            flag = all_reduce(flag, group=self.group, op="preemption", step=step, timeout_s=self.timeout_s)
        self.stopping = bool(flag.item())
        if self.stopping:
            elapsed = "" if self.signalled_at is None else f" ({time.monotonic() - self.signalled_at:.1f} s after it)"
            received = f"received {self.signalled}{elapsed}" if self.signalled else "another rank was signalled"
            logger.warning("ds_ring: rank %s %s: stopping after step %s to save it", _rank(), received, step)
        return self.stopping

    def seconds_left(self) -> float | None:
        """Seconds of the grace period left (``None``: no signal received by this rank)."""
        if self.signalled_at is None:
            return None
        return self.config.grace_s - (time.monotonic() - self.signalled_at)

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if not self._polled:  # a loop that does not poll: the signal does what it did without ds_ring
            previous = self._previous.get(signal.Signals(number))
            self.close()
            if callable(previous):
                previous(number, frame)
            else:
                os.kill(os.getpid(), number)
            return
        now = time.monotonic()
        if self.signalled_at is None:
            self.signalled, self.signalled_at = name, now
            self._timer = threading.Timer(self.config.grace_s, self._grace_expired)
            self._timer.daemon = True
            self._timer.start()
            _say(f"ds_ring: rank {_rank()} received {name}: stopping at the end of the current step to save it "
                 f"(grace {self.config.grace_s:g} s)")  # fmt: skip
        elif now - self.signalled_at <= self.config.repeat_window_s:
            window = self.config.repeat_window_s
            _say(f"ds_ring: rank {_rank()} received {name} again {now - self.signalled_at:.2f} s after the first: "
                 f"the same preemption (within repeat_window_s {window:g} s), ignored")  # fmt: skip
        else:
            _say(f"ds_ring: rank {_rank()} received a second signal ({name}) {now - self.signalled_at:.1f} s after "
                 f"the first: exiting now with code {128 + number}; the last complete checkpoint is kept")  # fmt: skip
            self._exit(128 + number)

    def _grace_expired(self) -> None:
        _say(f"ds_ring: rank {_rank()}: preemption grace of {self.config.grace_s:g} s ran out before the save "
             f"finished; exiting with code {GRACE_EXPIRED}; the last complete checkpoint is kept")  # fmt: skip
        self._exit(GRACE_EXPIRED)


def _say(message: str) -> None:
    """To stderr at once (inside a signal handler or a timer: no logging locks)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _rank() -> str:
    return str(dist.get_rank()) if dist.is_initialized() else os.environ.get("RANK", "?")
