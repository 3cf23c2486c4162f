"""Observation hooks: the strategy and communication layers emit events, monitors subscribe.

This module imports nothing else of ds_ring, so the lowest layers (``comm``, ``kernels``,
``strategies``) can emit without knowing who listens. Hooks observe; they never change results.
An exception raised by a hook propagates: a broken monitor should fail loudly, not silently.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Event", "HookHandle", "register_hook", "emit", "hooks_active"]


@dataclass(frozen=True)
class Event:
    """One observation.

    kind: what happened, e.g. ``"send"``, ``"recv"``, ``"all_gather"``, ``"ring_step"``,
        ``"attention"``.
    rank: global rank that emitted it.
    op: name of the operation within its strategy (``"ring_kv"``, ``"ring_dkv"``, ...).
    step: index of the ring step / call (``-1`` when not applicable).
    peer: global rank of the other side of a point-to-point transfer (``-1`` otherwise).
    nbytes: bytes moved by this rank (sent for ``send``, received for ``recv``).
    seconds: wall time of the observed region (0 when not timed).
    extra: anything strategy-specific (``live_remote_blocks``, ``strategy``, ``layer``...).
    """

    kind: str
    rank: int
    op: str = ""
    step: int = -1
    peer: int = -1
    nbytes: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


Hook = Callable[[Event], None]

_lock = threading.Lock()
_hooks: dict[int, Hook] = {}
_ids = itertools.count()


class HookHandle:
    """Returned by :func:`register_hook`; ``remove()`` (or leaving a ``with`` block) unregisters."""

    def __init__(self, hook_id: int) -> None:
        self._id = hook_id

    def remove(self) -> None:
        with _lock:
            _hooks.pop(self._id, None)

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def register_hook(hook: Hook) -> HookHandle:
    """Call ``hook(event)`` for every event emitted in this process until the handle is removed."""
    with _lock:
        hook_id = next(_ids)
        _hooks[hook_id] = hook
    return HookHandle(hook_id)


def hooks_active() -> bool:
    """True when at least one hook is registered (lets emitters skip building events)."""
    return bool(_hooks)


def emit(event: Event) -> None:
    """Deliver ``event`` to every registered hook, in registration order."""
    if not _hooks:
        return
    with _lock:
        hooks = list(_hooks.values())
    for hook in hooks:
        hook(event)
