"""The deadline of stream-ordered waits: a watchdog thread that names the rank, peer and step of a GPU
transfer still incomplete ``timeout_s`` after it was waited on.

On NCCL ``Work.wait()`` without a timeout makes the *current CUDA stream* wait for the work and returns at once: the
host runs ahead and queues the next layer. Nothing then bounds the wait on the host, so every such work is handed to
the process's :class:`StreamWatch` (:func:`ds_ring.comm.wait.watchdog`), which checks ``work.is_completed()`` (a
non-blocking query of the work's CUDA event) about every :data:`POLL_S` seconds. A work past its deadline becomes a
:class:`~ds_ring.comm.errors.CommTimeoutError` naming the rank, the peer, the step and the op: announced at once to
the hooks (a ``"comm_error"`` event, logged by ds_ring's watchdog hook) and by ``logging``, and raised on the
training thread by its next ds_ring wait (:meth:`StreamWatch.raise_expired`). NCCL's own watchdog (the process
group's timeout, twice ``timeout_s``: :func:`ds_ring.comm.wait.process_group_timeout_s`) stays the backstop that
aborts the communicator and ends the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ds_ring.comm.errors import CommTimeoutError
from ds_ring.comm.hosts import name_hosts

__all__ = ["StreamWatch", "POLL_S"]

POLL_S = 1.0
"""Seconds between two checks of the watched works (a deadline is noticed at most this late)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Watched:
    """One stream-ordered work and what its timeout error says."""

    pending: object  # ds_ring.comm.wait.Pending
    deadline: float
    timeout_s: float
    rank: int
    op: str
    step: int


class StreamWatch:
    """Works waited on in stream order, checked against their deadlines by :meth:`poll` (a daemon thread
    calls it every :data:`POLL_S` seconds once something is watched; tests call it with their own clock).

    ``announce``: called with each expired work's error on the thread that finds it (``wait.failed``);
    ``background``: whether :meth:`watch` starts the polling thread (``False``: the caller polls)."""

    def __init__(
        self, announce: Callable[[CommTimeoutError], object] | None = None, *, background: bool = True
    ) -> None:
        self.background = background
        self._lock = threading.Lock()
        self._watched: list[_Watched] = []
        self._expired: list[CommTimeoutError] = []
        self._thread: threading.Thread | None = None
        self.announce = announce

    def watch(self, pending: Sequence[object], *, timeout_s: float, rank: int, op: str, step: int,
              now: float | None = None) -> None:  # fmt: skip
        """Watch ``pending`` (``Pending`` items) until complete, at most ``timeout_s`` seconds from ``now``."""
        deadline = (time.monotonic() if now is None else now) + timeout_s
        with self._lock:
            self._watched += [_Watched(item, deadline, timeout_s, rank, op, step) for item in pending]
            if self.background and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ds_ring-stream-watch", daemon=True)
                self._thread.start()

    def poll(self, now: float | None = None) -> list[CommTimeoutError]:
        """Drop completed works; turn those past their deadline into errors (announced, kept for
        :meth:`raise_expired`). Returns the new errors."""
        now = time.monotonic() if now is None else now
        with self._lock:
            watched, self._watched = self._watched, []
        kept, errors = [], []
        for item in watched:
            if item.pending.work.is_completed():
                continue
            if now < item.deadline:
                kept.append(item)
                continue
            what = f"waiting (stream-ordered) for {item.pending.what}"
            error = CommTimeoutError(item.rank, item.pending.peer, item.step, item.op, what, item.timeout_s)
            errors.append(name_hosts(error))
        with self._lock:
            self._watched = kept + self._watched
            self._expired += errors
        for error in errors:
            _log.error("%s", error)
            if self.announce is not None:
                self.announce(error)
        return errors

    def raise_expired(self) -> None:
        """Raise the first error :meth:`poll` found since the last call (on the training thread)."""
        with self._lock:
            expired, self._expired = self._expired, []
        if expired:
            raise expired[0]

    @property
    def watched(self) -> int:
        """Works still watched."""
        with self._lock:
            return len(self._watched)

    def _run(self) -> None:
        while True:
            time.sleep(POLL_S)
            self.poll()
