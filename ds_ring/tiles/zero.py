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
from contextlib import ExitStack, contextmanager
from functools import cache

import torch

from ds_ring.zero import is_zero3

__all__ = ["gathered"]


@contextmanager
def gathered(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Inside: every ZeRO-3 parameter of ``params`` whole (one all-gather over its partition group for those not
    available); after: those partitioned again. Other parameters are left alone (nothing is communicated)."""
    if not any(is_zero3(p) for p in params):
        yield
        return
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    # Available ones (persistent, or held by a module): whole already, and theirs to release.
    partitioned = [p for p in params if is_zero3(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if len(partitioned) < 2 or _coalesced_gather_waits_for_all(partitioned[0]):
        with GatheredParameters(partitioned):
            yield
        return
    with ExitStack() as stack:  # one blocking gather per parameter
        for param in partitioned:
            stack.enter_context(GatheredParameters([param]))
        yield


@cache
def _deepspeed_waits_on_every_handle() -> bool:
    import deepspeed
    from packaging.version import Version

    return Version(deepspeed.__version__.split("+")[0]) >= Version("0.19.8")


def _coalesced_gather_waits_for_all(param: torch.nn.Parameter) -> bool:
    """Whether a gather of several ZeRO-3 parameters has them all when it returns.

    DeepSpeed before 0.19.8 waits on the last of a coalesced gather's per-parameter handles only: right where the
    collectives finish in order (NCCL, one stream), not on gloo, which may finish them out of order — the other
    parameters would be read before they arrive (seen on CPU with DeepSpeed 0.16: a layer norm's weight read as
    1e28 once in a few runs). There, every parameter is gathered by a blocking call of its own.
    """
    return param.ds_tensor.device.type != "cpu" or _deepspeed_waits_on_every_handle()
