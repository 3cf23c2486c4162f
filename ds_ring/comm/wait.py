"""The one place where ``ds_ring`` waits on ``torch.distributed`` work: always with a deadline.

gloo honours ``Work.wait(timeout=...)`` for point-to-point ops and async collectives (measured on
torch 2.13: an ``irecv`` whose peer never sends raises after the timeout, not the group's timeout),
so the wait is delegated to it rather than polled. A wait that raises is turned into
:class:`CommTimeoutError` (deadline reached) or :class:`CommError` (failed early, e.g. the peer died).
Every such error is announced to the hooks (a ``"comm_error"`` event, :func:`failed`) before it is
raised, so a watchdog logs it where it happens even if a caller swallows it.

**NCCL** (``ProcessGroupNCCL``, as PyTorch documents it; not yet run here, the project has no GPU):

- ``Work.wait()`` *without* a timeout only makes the current CUDA stream wait for the work: the host goes on.
  ``Work.wait(timeout)``, which is all ds_ring calls, *blocks the host thread* until the work completes or
  ``timeout`` passes. On timeout it aborts the group's NCCL communicator and raises
  ``torch.distributed.DistBackendError`` (a ``RuntimeError``) whose message ends "... ran for N milliseconds
  before timing out." — counted here as a timeout like gloo's "timed out"; any other error is a
  :class:`CommError`. Either way the communicator is gone: the group cannot be used again.
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

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ds_ring.comm.errors import CommError, CommTimeoutError
from ds_ring.hooks import Event, emit, hooks_active

__all__ = ["Pending", "wait_all", "failed", "DEFAULT_TIMEOUT_S", "resolve_timeout", "process_group_timeout_s"]

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


def wait_all(pending: Sequence[Pending], *, timeout_s: float, rank: int, op: str, step: int) -> float:
    """Wait for every operation in ``pending`` under one shared deadline ``timeout_s`` seconds away.

    Returns the seconds spent blocked here. Raises :class:`CommTimeoutError` naming the first
    operation still incomplete at the deadline, or :class:`CommError` when the backend reports a
    failure before it.
    """
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
    """``error``, after emitting a ``"comm_error"`` event for it (``seconds``: blocked since the
    ``time.monotonic()`` value ``since``, when given; ``extra["error"]``: the error)."""
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
