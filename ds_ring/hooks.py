"""Observation hooks: the strategy and communication layers emit events, monitors subscribe.

This module imports nothing else of ds_ring, so the lowest layers (``comm``, ``kernels``,
``strategies``) can emit without knowing who listens. Hooks observe; they never change results.
An exception raised by a hook propagates: a broken monitor should fail loudly, not silently.

Hook points (``kind``; each observed region emits a ``phase="start"`` event before it and a
``phase="end"`` event after it):

- ``"attention"``: one sharded attention call, forward or backward (``extra["direction"]``);
  the forward's end event carries the local output and LSE (``extra["out"]``, ``extra["lse"]``);
- ``"ring_step"``: one posted step of a point-to-point ring (``RingComm.commit`` to ``wait``);
- ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"``, ``"all_reduce"``: one collective.

Also emitted (end events only): ``"send"`` and ``"recv"`` per ring transfer, ``"comm_error"``
just before a communication error is raised (``extra["error"]``), and ``"offload"`` when a disk store
of checkpointed inputs takes (``op="disk_write"``) or lets go of (``op="disk_release"``) an entry. A
hook gets end events unless it asks for start events too (``register_hook(hook, phases=("start", "end"))``).

*Labels* are context the observed code does not know (which layer, which training step): a
monitor sets them around a region (:func:`labelled`) and hooks read them (:func:`current_labels`).
"""

from __future__ import annotations

import itertools
import resource
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Event",
    "HookHandle",
    "PHASES",
    "register_hook",
    "emit",
    "hooks_active",
    "labelled",
    "muted",
    "push_labels",
    "pop_labels",
    "current_labels",
    "peak_memory_bytes",
]

PHASES = ("start", "end")


@dataclass(frozen=True)
class Event:
    """One observation.

    kind: what happened, e.g. ``"send"``, ``"recv"``, ``"all_gather"``, ``"ring_step"``,
        ``"attention"``, ``"comm_error"``.
    rank: global rank that emitted it.
    op: name of the operation within its strategy (``"ring_kv"``, ``"ring_dkv"``, ...).
    step: index of the ring step / call (``-1`` when not applicable).
    peer: global rank of the other side of a point-to-point transfer (``-1`` otherwise).
    nbytes: bytes moved by this rank (sent for ``send`` and ``ring_step``, received for ``recv``
        and collectives).
    seconds: wall time of the observed region (0 when not timed); for transfers, from posting
        to completion (the time *in flight*; ``extra["wait_s"]`` is the part spent blocked).
    extra: anything strategy-specific (``live_remote_blocks``, ``wait_s``, ``direction``...).
    phase: ``"start"`` (before the region) or ``"end"`` (after it).
    strategy: the exchange or strategy of an attention event (``"ring"``, ``"allgather"``).
    peak_bytes: peak memory of this process so far (accelerator allocator on CUDA, else peak
        resident set), on attention end events; 0 elsewhere.
    """

    kind: str
    rank: int
    op: str = ""
    step: int = -1
    peer: int = -1
    nbytes: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    phase: str = "end"
    strategy: str = ""
    peak_bytes: int = 0


Hook = Callable[[Event], None]


class _Hooks:
    """The registry of hooks: every registered hook with its phases, and how many listen to each phase."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[int, tuple[Hook, frozenset[str]]] = {}
        self.ids = itertools.count()
        self.listening: dict[str, int] = dict.fromkeys(PHASES, 0)


_HOOKS = _Hooks()


class HookHandle:
    """Returned by :func:`register_hook`; ``remove()`` (or leaving a ``with`` block) unregisters."""

    def __init__(self, hook_id: int) -> None:
        self._id = hook_id

    def remove(self) -> None:
        with _HOOKS.lock:
            entry = _HOOKS.entries.pop(self._id, None)
            if entry is not None:
                for phase in entry[1]:
                    _HOOKS.listening[phase] -= 1

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_hook(hook: Hook, *, phases: Collection[str] = ("end",)) -> HookHandle:
    """Call ``hook(event)`` for every event of ``phases`` emitted in this process until the handle is removed."""
    wanted = frozenset(phases)
    if not wanted or not wanted <= set(PHASES):
        raise ValueError(f"ds_ring: register_hook phases must be a non-empty subset of {PHASES}, got {phases!r}")
    with _HOOKS.lock:
        hook_id = next(_HOOKS.ids)
        _HOOKS.entries[hook_id] = (hook, wanted)
        for phase in wanted:
            _HOOKS.listening[phase] += 1
    return HookHandle(hook_id)


def hooks_active(phase: str = "end") -> bool:
    """True when at least one hook listens to ``phase`` events (lets emitters skip building events), outside
    :func:`muted`."""
    return _HOOKS.listening[phase] > 0 and not getattr(_context, "muted", False)


def emit(event: Event) -> None:
    """Deliver ``event`` to every hook registered for its phase, in registration order."""
    if not _HOOKS.listening[event.phase] or getattr(_context, "muted", False):
        return
    with _HOOKS.lock:
        hooks = [hook for hook, phases in _HOOKS.entries.values() if event.phase in phases]
    for hook in hooks:
        hook(event)


_context = threading.local()


def current_labels() -> Mapping[str, Any]:
    """The labels set in this thread (read-only; empty when none)."""
    return getattr(_context, "labels", {})


def push_labels(**labels: Any) -> Mapping[str, Any]:
    """Add ``labels`` to this thread's labels; returns a token for :func:`pop_labels`."""
    previous = current_labels()
    _context.labels = {**previous, **labels}
    return previous


def pop_labels(token: Mapping[str, Any]) -> None:
    """Restore the labels as they were before the :func:`push_labels` that returned ``token``."""
    _context.labels = token


@contextmanager
def labelled(**labels: Any) -> Iterator[None]:
    """Set ``labels`` (e.g. ``layer="blocks.0.attn"``) for events emitted in this thread inside the block."""
    token = push_labels(**labels)
    try:
        yield
    finally:
        pop_labels(token)


@contextmanager
def muted() -> Iterator[None]:
    """No event is delivered from this thread inside the block: work that repeats what was already reported (a
    compiled attention's backward recomputing its forward, ds_ring/compiler/custom_ops.py)."""
    before = getattr(_context, "muted", False)
    _context.muted = True
    try:
        yield
    finally:
        _context.muted = before


def peak_memory_bytes() -> int:
    """Peak memory of this process: the CUDA allocator's when CUDA is in use, else peak resident set size."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def emit_attention(strategy: str, direction: str, phase: str, rank: int, started: float = 0.0, **extra: Any) -> None:
    """Emit one ``"attention"`` event for ``direction`` (``"forward"``/``"backward"``) of ``strategy``.

    ``started``: ``time.perf_counter()`` at the start event (end events report the elapsed seconds
    and the peak memory). The caller checks ``hooks_active(phase)`` first.
    """
    end = phase == "end"
    emit(
        Event(
            kind="attention",
            rank=rank,
            op=f"attention_{direction}",
            seconds=time.perf_counter() - started if end else 0.0,
            extra={"direction": direction, **extra},
            phase=phase,
            strategy=strategy,
            peak_bytes=peak_memory_bytes() if end else 0,
        )
    )
