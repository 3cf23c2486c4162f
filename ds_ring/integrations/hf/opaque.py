"""The handles and the autograd that ds_ring's ``torch.compile`` custom ops share.

A custom op (``torch.library.custom_op``) takes tensors and plain values only, and the compiler neither traces nor
splits it: ds_ring's attention runs inside one, its communication, agreement and caches as in eager mode. The
objects a call needs (the attention function with its topology, the settings of one call site) reach the op as
an ``int`` handle into a process-wide table (:func:`register` once, :func:`lookup` in the op).

The backward op recomputes the forward with autograd and differentiates it (:func:`autograd_inside`): a custom op
runs below the autograd dispatch keys, so the autograd graph of ds_ring's ``autograd.Function``\\ s is built only
once those keys are let through again.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ds_ring.integrations.internal import process

__all__ = ["register", "lookup", "autograd_inside"]

_lock = threading.Lock()


class _Handles:
    """The process's table of handles (owned by its :func:`~ds_ring.comm.job.process` job)."""

    def __init__(self) -> None:
        self.table: dict[int, Any] = {}
        self.keys: dict[Any, int] = {}
        self.counter = itertools.count(1)


def _handles() -> _Handles:
    owner = process()
    return owner.owned(owner, "custom op handles", _Handles)


def register(value: Any, key: Any = None) -> int:
    """The handle of ``value`` (kept for the life of the process); ``key``: a hashable that names it, so the
    same ``key`` gives the same handle (``None``: a new handle every call)."""
    handles = _handles()
    with _lock:
        if key is not None and key in handles.keys:
            return handles.keys[key]
        handle = next(handles.counter)
        handles.table[handle] = value
        if key is not None:
            handles.keys[key] = handle
        return handle


def lookup(handle: int) -> Any:
    """What :func:`register` gave ``handle`` for."""
    return _handles().table[handle]


_AUTOGRAD = (
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
)


@contextlib.contextmanager
def autograd_inside() -> Iterator[None]:
    """Grad mode on and the autograd dispatch keys no longer excluded (a custom op's kernel runs with them
    excluded): operations record their graph again. Everything else excluded (autocast, ...) stays excluded."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with (
        torch.enable_grad(),
        torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude - _AUTOGRAD),
    ):
        yield
