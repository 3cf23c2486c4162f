"""DeepSpeed's own collectives, named when they fail or hang.

DeepSpeed reduces gradients, clips norms and partitions ZeRO state with collectives of its own
(``deepspeed.comm``), outside ds_ring's bounded waits. When a peer dies or the network drops inside one
of them, the backend says only e.g. gloo's "Timed out waiting 20000ms for recv operation" — no rank, no
collective, no step, no host. :class:`NamedCollectives` wraps the collective methods of DeepSpeed's
communication backend (``deepspeed.comm.comm.cdb``, through which every ``deepspeed.comm`` collective
goes) so that such a failure raises :class:`~ds_ring.comm.CommTimeoutError` / :class:`~ds_ring.comm.CommError`
naming this rank and its host, the collective, the training step and the group's ranks by host, announced
to the hooks like ds_ring's own (the watchdog logs it); :func:`running_collective` tells the watchdog's
step deadline which collective the training thread is inside. Asynchronous collectives
(``async_op=True``) fail later, in their ``wait()``, and are not renamed.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ds_ring.comm.errors import CommError, CommTimeoutError
from ds_ring.comm.hosts import hosts_of
from ds_ring.comm.job import job
from ds_ring.comm.wait import failed, resolve_timeout
from ds_ring.engine.patches import Patch, set_attribute, undo_all
from ds_ring.hooks import current_labels

__all__ = ["NamedCollectives", "running_collective", "COLLECTIVES"]

COLLECTIVES = (
    "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "all_to_all_single", "all_to_all", "broadcast",
    "broadcast_object_list", "all_gather_object", "gather", "scatter", "barrier", "monitored_barrier",
)  # fmt: skip
"""The methods of DeepSpeed's communication backend that are wrapped (where it has them)."""


def running_collective() -> str | None:
    """The DeepSpeed collective the process is inside now (``"deepspeed.comm.all_reduce"``), or ``None`` (the job's
    :class:`~ds_ring.comm.job.Job` keeps the ones running)."""
    running = job().running
    return running[-1] if running else None


class NamedCollectives:
    """Wrap the collectives of DeepSpeed's backend for as long as this object is open (see the module).

    ``timeout_s`` is the process group's timeout (named in a :class:`CommTimeoutError`; ``None``: 300 s).
    Nothing is wrapped when DeepSpeed has no backend yet, or another instance already wrapped it.
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = resolve_timeout(timeout_s)
        self._patches: list[Patch] = []
        comm = sys.modules.get("deepspeed.comm.comm")
        backend = getattr(comm, "cdb", None)
        if backend is None or getattr(backend, "_ds_ring_named", False):
            return
        for name in COLLECTIVES:
            method = getattr(backend, name, None)
            if callable(method):
                self._patches.append(set_attribute(backend, name, self._named(name, method), library="deepspeed"))
        self._patches.append(set_attribute(backend, "_ds_ring_named", True, library="deepspeed"))

    def close(self) -> None:
        """Restore the backend's own methods."""
        undo_all(self._patches)

    def _named(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(method)
        op = f"deepspeed.comm.{name}"

        def collective(*args: Any, **kwargs: Any) -> Any:
            running = job().running
            running.append(op)
            try:
                return method(*args, **kwargs)
            except CommError:
                raise
            except RuntimeError as exc:
                try:
                    group = signature.bind(*args, **kwargs).arguments.get("group")
                except TypeError:
                    group = None
                raise failed(self._error(op, group, exc)) from exc
            finally:
                running.pop()

        collective.__wrapped__ = method  # type: ignore[attr-defined]
        return collective

    def _error(self, op: str, group: dist.ProcessGroup | None, exc: RuntimeError) -> CommError:
        rank = dist.get_rank()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        step = int(current_labels().get("train_step", -1))
        what = f"in DeepSpeed's {op.rsplit('.', 1)[1]} over ranks {hosts_of(ranks)} at training step {step}"
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return CommTimeoutError(rank, -1, step, op, what, self.timeout_s)
        return CommError(rank, -1, step, op, what, str(exc))
