"""The one owner of ds_ring's run-time state in a process: a :class:`Job` per job, instead of module globals.

A *job* is what runs over one default process group (``torch.distributed``'s world): its :class:`Job` holds the
facts its first :class:`~ds_ring.Topology` gathered (every rank's host and CPU place), the caches kept per owner (a
topology's or a group's placement, a placement's prepared calls, the calls a group agreed on, probed links, control
twins), ``strategy="auto"``'s decisions and the DeepSpeed collectives running. A process that has no process group
(or has destroyed it) is its own job. What belongs to the process whatever job it runs — the interruptible waits'
checks and helper thread, the stream-ordered waits' watchdog, the CPU heap setting, the exit flushes, a patched
library class — is held by :func:`process`'s job. A job's state goes with its process group: a new
``init_process_group`` starts a new job, and nothing of the previous one (hosts, prepared calls, agreed calls) is
taken for it.

:data:`_JOBS` is the one module-level name here that changes at run time (a registry, like the plug-ins'
:data:`~ds_ring.strategies.registry.PLUGINS`).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["Job", "job", "process"]

T = TypeVar("T")


class _Process:
    """The key of the job of a process without a process group (weak-referenceable, lives as long as the module)."""


_PROCESS = _Process()
_JOBS: weakref.WeakKeyDictionary[object, Job] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class Job:
    """What one job has learned and prepared in this process (see the module's docstring)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.hosts: tuple[str, ...] = ()
        """The host of every global rank, in rank order, as the job's first Topology gathered them."""
        self.places: tuple[Any, ...] = ()
        """Every global rank's :class:`~ds_ring.comm.cores.CpuPlace`, in rank order (the same Topology's)."""
        self.decisions: deque[Any] = deque(maxlen=64)
        """``strategy="auto"``'s last choices, oldest first."""
        self.running: list[str] = []
        """DeepSpeed collectives running now, innermost last (the monitor's)."""
        self.checks: list[Callable[[], None]] = []
        """Process: the open interruptible blocks' checks, innermost last (:func:`ds_ring.comm.wait.interruptible`)."""
        self.helper: Any = None
        """Process: the thread host waits run on inside an interruptible block (``None``: not started)."""
        self.watch: Any = None
        """Process: the stream-ordered waits' watchdog (:func:`ds_ring.comm.wait.watchdog`; ``None``: none yet)."""
        self.heap: Any = None
        """Process: the CPU heap setting in force (:mod:`ds_ring.cpu_heap`; ``None``: not configured yet)."""
        self.flushes: dict[int, Callable[[], Any]] = {}
        """Process: what :func:`ds_ring.run_main` runs before a clean exit."""
        self.patches: dict[str, Any] = {}
        """Process: the :class:`ds_ring.engine.patches.Patch` of a library's class in force, by name (until undone)."""
        self._owned: weakref.WeakKeyDictionary[object, dict[str, Any]] = weakref.WeakKeyDictionary()

    def record_facts(self, hosts: Sequence[str], places: Sequence[Any]) -> bool:
        """Keep ``hosts`` and ``places`` as the job's unless a Topology recorded them already (a later Topology keeps
        its own facts and never overwrites these). Returns whether they were recorded."""
        with self.lock:
            if self.hosts:
                return False
            self.hosts, self.places = tuple(hosts), tuple(places)
            return True

    def owned(self, owner: object, name: str, make: Callable[[], T]) -> T:
        """The ``name`` entry kept for ``owner`` (a topology, a process group, a placement), made by ``make()`` on
        first use (outside the lock: making one may be collective); it goes when ``owner`` does."""
        entries = self._owned.get(owner)
        if entries is not None and name in entries:  # the steady state: no lock (a dict read is atomic)
            return entries[name]
        with self.lock:
            entries = self._owned.setdefault(owner, {})
            if name in entries:
                return entries[name]
        made = make()
        with self.lock:
            return entries.setdefault(name, made)


def job() -> Job:
    """The job this process runs now: the one of ``torch.distributed``'s default group, or :func:`process`'s."""
    world = dist.group.WORLD if dist.is_initialized() else None
    key = _PROCESS if world is None else world
    found = _JOBS.get(key)
    if found is None:
        with _lock:
            found = _JOBS.setdefault(key, Job())
    return found


def process() -> Job:
    """The job of this process itself, whatever process group it runs: the state of the process as a whole."""
    found = _JOBS.get(_PROCESS)
    if found is None:
        with _lock:
            found = _JOBS.setdefault(_PROCESS, Job())
    return found
