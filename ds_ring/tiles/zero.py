"""ZeRO-3 parameters whole for the length of a tiled computation: one all-gather, not one per tile.

A tiled computation reads its weights directly (never through the module, whose ZeRO-3 hooks would gather
and release them around every tile). Its autograd Function takes the parameters as inputs while they are
whole and returns each one's gradient, summed over the tiles, from its backward: the gradient reaches the
parameter's accumulator once, so ZeRO's reduction hook fires once per step, as for an untiled module
(what DeepSpeed's ``ds_grad_is_ready`` flag achieves for its tiles, without the flag).

The same context reads ZeRO-3 parameters whole anywhere else (a script's or a test's final parameters).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ds_ring.engine.gradient_scale import is_zero3
from ds_ring.engine.zero_gathers import wait_for_every_gather

__all__ = ["gathered"]


@contextmanager
def gathered(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Inside: every ZeRO-3 parameter of ``params`` whole (one all-gather over its partition group for those not
    available); after: those partitioned again. Other parameters are left alone (nothing is communicated)."""
    if not any(is_zero3(p) for p in params):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    wait_for_every_gather()  # DeepSpeed before 0.19.8 on CPU ranks: see ds_ring.engine.zero_gathers
    # Available ones (persistent, or held by a module): whole already, and theirs to release.
    partitioned = [p for p in params if is_zero3(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with GatheredParameters(partitioned):
        yield
