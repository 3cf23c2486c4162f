"""Preemption: on SIGTERM / SIGUSR1 every rank saves the same step within the grace period, and exits 0.

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

**A step longer than the grace period.** A loop that wraps each step in :meth:`Preemption.step_in_flight` lets
a signal abandon the step in flight instead: before the optimizer update the parameters and optimizer state
are still the last completed step's, so each rank writes its own part of that checkpoint with no collective
(:func:`ds_ring.save_rank_checkpoint`; peers may be anywhere in the step) and the last part published makes
it ``latest``. The handler raises :class:`StepAbandoned` out of the step; ds_ring's waits wake every
:data:`ds_ring.comm.wait.POLL_S` seconds so a rank blocked on a peer sees its signal, and a rank that
abandons leaves a notice in the save directory that ends its peers' waits. The optimizer update is fenced:
a gate (one all-reduce of one integer) before it decides on every rank whether anyone was signalled, and
from the gate to the end of the update a signal is deferred, so every rank abandons before the same update
or none does. A step measured at most half the grace is finished instead (nothing lost): the ranks stop at
its end as above.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.comm.collectives import all_reduce
from ds_ring.comm.wait import interruptible
from ds_ring.config import PreemptionConfig

__all__ = ["Preemption", "StepAbandoned", "GRACE_EXPIRED", "NOTICE"]

GRACE_EXPIRED = 124
"""Exit code of a process whose grace period ran out before it had saved and exited."""

NOTICE = ".ds_ring_abandoned.{token}"
"""File in the save directory by which the first rank to abandon a step tells its peers (JSON: step, rank)."""

logger = logging.getLogger("ds_ring.engine.preemption")
_Handler = Callable[[int, FrameType | None], Any] | int | None


class StepAbandoned(BaseException):  # noqa: N818 - not an error: the step is given up on purpose
    """Raised out of :meth:`Preemption.step_in_flight` when a preemption gives up the step in flight.

    ``completed``: the last step (1-based) whose optimizer update completed; every rank of the job abandons with
    the same value. The loop saves it with :func:`ds_ring.save_rank_checkpoint` and exits. A ``BaseException``,
    so that an ``except Exception`` in a loop or a library does not swallow it.
    """

    def __init__(self, completed: int, step: int, reason: str) -> None:
        super().__init__(f"step {step} abandoned ({reason}); step {completed} is the last completed")
        self.completed, self.step, self.reason = completed, step, reason


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
        self._recheck: threading.Timer | None = None
        self._rechecking = False
        self.token = (
            "local"  # the same on every rank of one run (ds_ring.engine.initialize.attach_preemption agrees on it)
        )
        self.abandoned: StepAbandoned | None = None
        self._step: int | None = None  # the step in flight (step_in_flight), 1-based
        self._phase: str | None = None  # "step", "gate", "update", "done" while a step is in flight
        self._save_dir: Path | None = None
        self._step_s: float | None = None  # seconds of the last step completed in flight
        self._covered = False  # the loop uses step_in_flight: a long step is abandoned, not waited for
        self._last_poll: float | None = None
        self._warned = False
        self.uncovered_fix = (
            "wrap each step in `with engine.preemption.step_in_flight(step, save_dir)` and save the "
            "StepAbandoned's completed step with ds_ring.save_rank_checkpoint (docs/elastic.md)"
        )

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
        for timer in (self._timer, self._recheck):
            if timer is not None:
                timer.cancel()

    def stop_requested(self, step: int = -1) -> bool:
        """Collective over ``group``, at the end of every step: whether any rank has been signalled.

        ``step`` (1-based) is named in a timeout error. Once true it stays true (no more exchanges).
        """
        self._polled = True
        self._time_step(step)
        if self.stopping:
            return True
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int64)
        if dist.is_initialized():
            flag = all_reduce(flag, group=self.group, op="preemption", step=step, timeout_s=self.timeout_s)
        self.stopping = bool(flag.item())
        if self.stopping:
            self._log_stop(step)
        return self.stopping

    def _log_stop(self, step: int) -> None:
        elapsed = "" if self.signalled_at is None else f" ({time.monotonic() - self.signalled_at:.1f} s after it)"
        received = f"received {self.signalled}{elapsed}" if self.signalled else "another rank was signalled"
        logger.warning("ds_ring: rank %s %s: stopping after step %s to save it", _rank(), received, step)

    @contextlib.contextmanager
    def step_in_flight(self, step: int, save_dir: str | os.PathLike) -> Iterator[None]:
        """Run training step ``step`` (1-based; ``step - 1`` completed) so that a preemption may abandon it.

        The block holds the whole step: forward, backward and ``engine.step()`` (whose optimizer update ds_ring
        fences: :meth:`updating`). A signal while the block runs, before the update's gate, raises
        :class:`StepAbandoned` at once (or, in a wait on a peer, within :data:`ds_ring.comm.wait.POLL_S`), unless
        the last step took at most half of ``grace_s``: that step is finished and the loop's
        :meth:`stop_requested` stops after it. So does an error while another rank abandons (its notice in
        ``save_dir``, or this rank's signal): the peer that stopped is why. From the gate to the end of the
        update a signal is deferred to the end of the step. An error inside the update propagates as it is
        (the state is torn there: nothing to save).
        """
        self._polled = self._covered = True
        self._step, self._phase, self._save_dir = step, "step", Path(save_dir)
        started = time.monotonic()
        try:
            if self.signalled and not self.stopping and not self._finishing():
                raise self._abandon(f"{self.signalled} received before step {step}")
            with interruptible(self._check):
                yield
        except StepAbandoned:
            raise
        except BaseException as exc:
            if self.abandoned is not None and self.abandoned.step == step:  # raised inside a callback that wrapped it
                raise self.abandoned from exc
            if self._phase in ("step", "gate") and (self.signalled or self._peer_abandoned() is not None):
                raise self._abandon(f"{type(exc).__name__} while a preemption is under way: {exc}") from exc
            raise
        else:
            self._step_s = time.monotonic() - started
        finally:
            self._step, self._phase = None, None

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Fence the optimizer update of the step in flight (``ds_ring.initialize`` wraps ``engine.step`` in it).

        First a gate: one all-reduce of one integer over ``group``, true once any rank was signalled (then every
        rank finishes this update and stops after it); no rank abandons after contributing to it. Signals are
        deferred from the gate to the end of the update; after it the step counts as completed. Outside
        :meth:`step_in_flight` it does nothing.
        """
        if self._step is None or self._phase != "step":
            yield
            return
        self._phase = "gate"
        flag = torch.tensor([1 if self.signalled else 0], dtype=torch.int64)
        if dist.is_initialized():
            flag = all_reduce(flag, group=self.group, op="preemption gate", step=self._step, timeout_s=self.timeout_s)
        if flag.item():
            self.stopping = True
            self._log_stop(self._step)
        self._phase = "update"
        yield
        self._phase = "done"

    def seconds_left(self) -> float | None:
        """Seconds of the grace period left (``None``: no signal received by this rank)."""
        if self.signalled_at is None:
            return None
        return self.config.grace_s - (time.monotonic() - self.signalled_at)

    def _finishing(self) -> bool:
        """Whether a signal mid-step lets the step finish: the last one took at most half the grace."""
        return self._step_s is not None and self._step_s <= self.config.grace_s / 2

    def _abandonable(self) -> bool:
        return self._phase == "step" and not self.stopping and self.abandoned is None

    def _check(self) -> None:
        """Between the wakes of an interruptible wait: abandon when a peer did, or when this rank's signal is due."""
        if self._phase not in ("step", "gate") or self.abandoned is not None:
            return
        peer = self._peer_abandoned()
        if peer is not None:
            raise self._abandon(f"rank {peer} abandoned it")
        if self.signalled and self._abandonable():
            late = self.signalled_at is not None and time.monotonic() - self.signalled_at > self.config.grace_s / 2
            if late or not self._finishing():
                raise self._abandon(f"{self.signalled} received; the step did not end within half the grace")

    def _notice(self) -> Path | None:
        return None if self._save_dir is None else self._save_dir / NOTICE.format(token=self.token)

    def _peer_abandoned(self) -> int | None:
        """The rank whose notice says it abandoned the step in flight, or ``None``."""
        notice = self._notice()
        try:
            told = json.loads(notice.read_text()) if notice is not None else None
        except (FileNotFoundError, ValueError):  # none, or half-written: seen at the next wake
            return None
        return told["rank"] if told and told["step"] == self._step else None

    def _abandon(self, reason: str) -> StepAbandoned:
        """Give up the step in flight: the exception to raise; the first rank to do so leaves the notice."""
        completed = self._step - 1 if self._phase in ("step", "gate") else self._step
        self.abandoned = StepAbandoned(completed, self._step, reason)
        self.stopping = True
        notice = self._notice()
        if notice is not None and not notice.exists():
            with contextlib.suppress(OSError):  # the peers also see this rank's exit
                notice.parent.mkdir(parents=True, exist_ok=True)
                temporary = notice.with_name(f"{notice.name}.tmp{_rank()}")
                temporary.write_text(json.dumps({"step": self._step, "rank": _rank()}))
                os.replace(temporary, notice)
        _say(f"ds_ring: rank {_rank()} abandons step {self._step} in flight ({reason}): saving step {completed}")
        return self.abandoned

    def _time_step(self, step: int) -> None:
        """Warn once when a step (poll to poll) outlasts the grace and the loop cannot abandon a step in flight."""
        now, last = time.monotonic(), self._last_poll
        self._last_poll = now
        if last is None or self._covered or self._warned or now - last <= self.config.grace_s:
            return
        self._warned = True
        logger.warning(
            "ds_ring: step %s took %.1f s, longer than ring_attention.preemption.grace_s = %g s, and this loop saves "
            "only at the end of a step: a preemption signal mid-step would end the process (code %d) before "
            "anything is saved, losing everything since the last periodic save. Fix: %s; or make grace_s (and "
            "the time the scheduler waits before SIGKILL) longer than a step",
            step, now - last, self.config.grace_s, GRACE_EXPIRED, self.uncovered_fix,
        )  # fmt: skip

    def _interrupt_main(self, number: int) -> None:
        """Timer thread: deliver ``number`` to the main thread (a sleep or a wait there ends), marked as a recheck."""
        self._rechecking = True
        signal.pthread_kill(threading.main_thread().ident, number)

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        name = signal.Signals(number).name
        if self._rechecking:  # from _interrupt_main, not from outside
            self._rechecking = False
            if self._abandonable():
                raise self._abandon(f"{self.signalled} received; the step did not end within half the grace")
            return
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
            grace = f"grace {self.config.grace_s:g} s"
            if self._abandonable() and not self._finishing():
                _say(f"ds_ring: rank {_rank()} received {name} in step {self._step} ({grace})")
                raise self._abandon(f"{name} received")
            if self._abandonable():  # finishing a short step: if it has not ended by half the grace, abandon it
                self._recheck = threading.Timer(self.config.grace_s / 2, self._interrupt_main, (number,))
                self._recheck.daemon = True
                self._recheck.start()
            _say(f"ds_ring: rank {_rank()} received {name}: stopping at the end of the current step to save it "
                 f"({grace})")  # fmt: skip
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
