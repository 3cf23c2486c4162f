"""The one place where ``ds_ring`` waits on ``torch.distributed`` work: always with a deadline.

gloo honours ``Work.wait(timeout=...)`` for point-to-point ops and async collectives (measured on
torch 2.13: an ``irecv`` whose peer never sends raises after the timeout, not the group's timeout),
so the wait is delegated to it rather than polled. A wait that raises is turned into
:class:`CommTimeoutError` (deadline reached) or :class:`CommError` (failed early, e.g. the peer died).
Every such error is announced to the hooks (a ``"comm_error"`` event, :func:`failed`) before it is
raised, so a watchdog logs it where it happens even if a caller swallows it.

**Interruptible waits.** While an :func:`interruptible` block is open (:mod:`ds_ring.engine.preemption` opens one
around a training step in flight), a host wait runs in a helper thread and the main thread wakes every
:data:`POLL_S` seconds: Python runs signal handlers only in the main thread between bytecodes, so a rank
blocked on a peer that stopped would otherwise not see its own SIGTERM until the wait ends. Between wakes
the block's check runs and may raise (a peer abandoned the step). Slicing ``Work.wait(timeout)`` instead
does not work on gloo: a point-to-point wait that times out closes the connection (torch 2.13, measured),
and ``Work.is_completed()`` of a send or receive never turns true without a wait.

**NCCL** (``ProcessGroupNCCL``, as PyTorch documents it; not yet run here, the project has no GPU):

- ``Work.wait()`` *without* a timeout only makes the current CUDA stream wait for the work: the host goes on.
  That is what ds_ring calls for CUDA data on NCCL (:func:`stream_ordered`): a ring step, an all-to-all or
  the loss all-reduce is no host-device sync, so the host queues the next layer while the GPU works. The
  deadline is then kept by a watchdog thread (:mod:`ds_ring.comm.stream_watch`): a work still incomplete
  ``timeout_s`` after its wait becomes a :class:`CommTimeoutError` naming rank, peer, step and op, announced
  at once and raised by the next wait. ``Work.wait(timeout)`` (which would *block the host thread* until
  the work completes) is kept for gloo and CPU data; on NCCL its "... ran for N milliseconds before timing
  out." counts as a timeout like gloo's "timed out"; any other error is a :class:`CommError`.
- Independently, the group's **watchdog** thread checks every work against the *process group's* timeout
  (``init_process_group(timeout=...)``, 10 min by default for NCCL), counted from when the work was enqueued.
  With ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` on (the default, as torchrun also sets it) a work past that timeout
  makes the watchdog abort the communicators and *end the process*, whatever the host is doing — also when it
  is stuck somewhere no ds_ring deadline reaches (a hung kernel, a collective outside ds_ring).
- So on NCCL ds_ring's bounded wait says who and where (rank, peer, step, op) and the watchdog is the
  backstop; for that order the process group's timeout must be at least ds_ring's ``timeout_s``, with room
  for the compute enqueued ahead of a transfer: :func:`process_group_timeout_s` gives the one
  ``ds_ring.initialize`` starts NCCL with (twice ``timeout_s``). A job that starts ``torch.distributed``
  itself should do the same; with a shorter group timeout the watchdog ends the process first and the named
  error is never raised. gloo has no such watchdog: its group timeout stays ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_ring.comm.backends import device_backend
from ds_ring.comm.errors import CommError, CommTimeoutError
from ds_ring.comm.hosts import name_hosts
from ds_ring.comm.job import process
from ds_ring.comm.stream_watch import StreamWatch
from ds_ring.hooks import Event, current_labels, emit, hooks_active, pop_labels, push_labels

__all__ = [
    "Pending",
    "wait_all",
    "watchdog",
    "failed",
    "stream_ordered",
    "DEFAULT_TIMEOUT_S",
    "resolve_timeout",
    "process_group_timeout_s",
    "interruptible",
    "POLL_S",
]

DEFAULT_TIMEOUT_S = 300.0
"""Bound in seconds on a wait whose caller names none (a call on a plain group; a
:class:`ds_ring.Topology` carries its own, the ds_config section's ``timeout_s``)."""


def resolve_timeout(timeout_s: float | None) -> float:
    """``timeout_s`` validated, or :data:`DEFAULT_TIMEOUT_S` when it is ``None``."""
    return DEFAULT_TIMEOUT_S if timeout_s is None else _checked_timeout(timeout_s)


def _checked_timeout(seconds: float) -> float:
    seconds = float(seconds)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"ds_ring: a communication timeout must be a finite number of seconds > 0, got {seconds}")
    return seconds


def process_group_timeout_s(timeout_s: float) -> float:
    """The timeout of every process group ds_ring starts or makes (the world in ``ds_ring.initialize``, each
    :class:`ds_ring.Topology` group, each gloo twin) under ds_ring's ``timeout_s``: twice it, so the backend's
    own bound (NCCL's watchdog, gloo's group timeout) stays the backstop behind ds_ring's bounded waits,
    which name the rank, peer and step first."""
    return 2 * _checked_timeout(timeout_s)


POLL_S = 0.1
"""Seconds between two wakes of the main thread in an :func:`interruptible` wait."""


@contextlib.contextmanager
def interruptible(check: Callable[[], None]) -> Iterator[None]:
    """While the block runs, host waits (:func:`wait_all` without ``in_stream``) wake every :data:`POLL_S`
    seconds, let pending signal handlers run and call ``check()``, whose exception ends the wait (the work
    is left behind: the caller is abandoning what it was doing). Main thread only. The process's
    :class:`~ds_ring.comm.job.Job` holds the open blocks' checks."""
    checks = process().checks
    checks.append(check)
    try:
        yield
    finally:
        checks.remove(check)


_TIMEOUT_WORDS = ("timed out", "timing out")  # gloo's wait; NCCL's Work.wait(timeout) and watchdog


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(word in text for word in _TIMEOUT_WORDS)


@dataclass(frozen=True)
class Pending:
    """One posted operation: its ``Work``, the global rank on the other side (``-1`` for a
    collective) and what it is, for error messages, such as ``"recv from rank 1"``."""

    work: dist.Work
    peer: int
    what: str


def stream_ordered(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether waits on work over ``device`` data in ``group`` are stream-ordered: CUDA data moved by NCCL
    (``"nccl"`` or the ``cuda:nccl`` part of a per-device backend)."""
    return device.type == "cuda" and device_backend(dist.get_backend(group), "cuda") == "nccl"


def watchdog() -> StreamWatch:
    """The process's watchdog of stream-ordered waits (held by :func:`~ds_ring.comm.job.process`'s job, made on
    first use); it announces each expired work through :func:`failed`."""
    owner = process()
    if owner.watch is None:
        with owner.lock:
            if owner.watch is None:
                owner.watch = StreamWatch(failed)
    return owner.watch


def wait_all(
    pending: Sequence[Pending], *, timeout_s: float, rank: int, op: str, step: int, in_stream: bool = False
) -> float:
    """Wait for every operation in ``pending`` under one shared deadline ``timeout_s`` seconds away.

    ``in_stream`` (NCCL on CUDA data, :func:`stream_ordered`): ``Work.wait()`` without a timeout, which makes
    the current CUDA stream wait and returns at once; the deadline is kept by the watchdog thread
    (:mod:`ds_ring.comm.stream_watch`), whose error for an earlier wait is raised here. Returns 0.0: the
    host did not block. Otherwise (gloo, CPU data) a bounded host wait: returns the seconds spent blocked
    here. Raises :class:`CommTimeoutError` naming the first operation still incomplete at the deadline, or
    :class:`CommError` when the backend reports a failure before it.
    """
    if in_stream:
        watch = watchdog()
        watch.raise_expired()
        for item in pending:
            try:
                item.work.wait()
            except RuntimeError as exc:
                raise failed(CommError(rank, item.peer, step, op, f"waiting for {item.what}", str(exc))) from exc
        watch.watch(pending, timeout_s=timeout_s, rank=rank, op=op, step=step)
        return 0.0
    if process().checks and threading.current_thread() is threading.main_thread():
        return _wait_in_helper(pending, timeout_s=timeout_s, rank=rank, op=op, step=step)
    return _wait_host(pending, timeout_s=timeout_s, rank=rank, op=op, step=step)


class _Helper:
    """A daemon thread that runs host waits handed to it, one at a time (started once: a thread per wait costs
    ~0.3 ms on a loaded core, a hand-over to a running one a fraction of it)."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="ds_ring waits", daemon=True).start()

    def _serve(self) -> None:
        while True:
            wait, outcome, done = self._requests.get()
            try:
                outcome.append((True, wait()))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                outcome.append((False, exc))
            finally:
                done.set()

    def run(self, wait: Callable[[], float]) -> float:
        """``wait()`` on the helper; the main thread wakes every :data:`POLL_S` s to run the checks. A check that
        raises leaves the helper blocked in the wait: the next wait gets a new helper."""
        owner = process()
        outcome: list[tuple[bool, object]] = []
        done = threading.Event()
        self._requests.put((wait, outcome, done))
        try:
            while not done.wait(POLL_S):
                for check in list(owner.checks):
                    check()
        except BaseException:
            owner.helper = None
            raise
        ok, value = outcome[0]
        if not ok:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]


def _wait_in_helper(pending: Sequence[Pending], *, timeout_s: float, rank: int, op: str, step: int) -> float:
    """:func:`_wait_host` on the helper thread; the main thread wakes every :data:`POLL_S` s for signals and checks."""
    owner = process()
    if owner.helper is None:
        owner.helper = _Helper()
    helper = owner.helper
    labels = current_labels()  # thread-local: the events a failed wait emits name the caller's step and layer

    def wait() -> float:
        token = push_labels(**labels)
        try:
            return _wait_host(pending, timeout_s=timeout_s, rank=rank, op=op, step=step)
        finally:
            pop_labels(token)

    return helper.run(wait)


def _wait_host(pending: Sequence[Pending], *, timeout_s: float, rank: int, op: str, step: int) -> float:
    """The bounded host wait of :func:`wait_all`: seconds blocked."""
    started = time.monotonic()
    deadline = started + timeout_s
    for item in pending:
        what = f"waiting for {item.what}"
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not item.work.is_completed():
            raise failed(CommTimeoutError(rank, item.peer, step, op, what, timeout_s), started)
        # At least 1 ms: a zero timeout means "use the process group's timeout" to c10d.
        wait_for = timedelta(milliseconds=max(1, math.ceil(remaining * 1000)))
        try:
            completed = item.work.wait(timeout=wait_for)
        except RuntimeError as exc:
            if time.monotonic() >= deadline or _is_timeout(exc):
                raise failed(CommTimeoutError(rank, item.peer, step, op, what, timeout_s), started) from exc
            raise failed(CommError(rank, item.peer, step, op, what, str(exc)), started) from exc
        if completed is False:  # backends that report a timeout by returning instead of raising
            raise failed(CommTimeoutError(rank, item.peer, step, op, what, timeout_s), started)
    return time.monotonic() - started


def failed(error: CommError, since: float | None = None) -> CommError:
    """``error``, naming the hosts when the job spans several (:func:`~ds_ring.comm.hosts.name_hosts`), after
    emitting a ``"comm_error"`` event for it (``seconds``: blocked since the ``time.monotonic()`` value
    ``since``, when given; ``extra["error"]``: the error)."""
    name_hosts(error)
    if hooks_active():
        seconds = 0.0 if since is None else time.monotonic() - since
        emit(
            Event(
                kind="comm_error",
                rank=error.rank,
                op=error.op,
                step=error.step,
                peer=error.peer,
                seconds=seconds,
                extra={"error": error},
            )
        )
    return error
