"""ZeRO-3 blocking gathers that hold every parameter when they return, on the DeepSpeed releases before 0.19.8.

DeepSpeed's blocking gather of several ZeRO-3 parameters (``Init._allgather_params_coalesced``: what
``GatheredParameters`` runs, and what ZeRO 3 runs after every optimizer step to make its persistent parameters,
the small ones such as layer norms, whole again) launches one asynchronous all-gather per parameter and, before
0.19.8, waits on the last one's handle only. On one NCCL stream the collectives finish in order, so that is
enough; on CPU ranks gloo runs them on a pool of threads and may finish them out of order, so a parameter is read
before it arrives: seen with DeepSpeed 0.16 as a layer norm's weight read as zeros (or 1e28) in the next step's
forward, once in tens of ZeRO-3 runs, training silently wrong from there. DeepSpeed 0.19.8 waits on every handle.

:func:`wait_for_every_gather` makes the older releases do the same where their gathers run on the CPU: it wraps
the method so that it gathers one parameter per call (each call waits on its only handle), in the same order on
every rank. Nothing changes on an accelerator or on 0.19.8 and later. ds_ring installs it wherever it meets a
ZeRO-3 parameter before a step (``ds_ring.initialize``, the attention modules' first forward, the tiles' gathers),
through :mod:`ds_ring.engine.patches`; :func:`stop_waiting_for_every_gather` (an engine's ``destroy()``) puts
DeepSpeed's method back.
"""

from __future__ import annotations

from functools import cache, wraps
from typing import Any

from ds_ring.comm.job import process
from ds_ring.engine.patches import set_attribute

__all__ = ["wait_for_every_gather", "waits_for_every_gather", "stop_waiting_for_every_gather"]

FIXED_IN = "0.19.8"


@cache
def waits_for_every_gather() -> bool:
    """Whether the installed DeepSpeed's blocking gathers wait on every parameter's handle on their own."""
    import deepspeed
    from packaging.version import Version

    return Version(deepspeed.__version__.split("+")[0]) >= Version(FIXED_IN)


def wait_for_every_gather() -> None:
    """Install the one-parameter-per-call gather on DeepSpeed releases before 0.19.8 (idempotent; no-op on
    0.19.8 and later). It takes effect for every ZeRO-3 engine, built before or after the call, until
    :func:`stop_waiting_for_every_gather`."""
    if waits_for_every_gather() or NAME in process().patches:
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.partition_parameters import Init

    coalesced = Init._allgather_params_coalesced

    @wraps(coalesced)
    def one_at_a_time(self: Any, param_list: list, hierarchy: int = 0, quantize: bool = False) -> None:
        if len(param_list) < 2 or get_accelerator().device_name() != "cpu":  # where the method gathers
            return coalesced(self, param_list, hierarchy, quantize)
        for param in param_list:
            coalesced(self, [param], hierarchy, quantize)
        return None

    process().patches[NAME] = set_attribute(Init, "_allgather_params_coalesced", one_at_a_time, library="deepspeed")


def stop_waiting_for_every_gather() -> None:
    """Put DeepSpeed's own ``Init._allgather_params_coalesced`` back (no-op where it was not replaced)."""
    patch = process().patches.pop(NAME, None)
    if patch is not None:
        patch.undo()


NAME = "Init._allgather_params_coalesced"
