"""How DeepSpeed's ZeRO stages reduce a :class:`~ds_ring.Topology`'s gradients, and what ds_ring's losses scale for it.

ds_ring's losses give every rank its tokens' *share* of the gradient: the sum over all ranks is
``D`` times the whole model's gradient (``D`` data-parallel replicas). DeepSpeed 0.19 with a
sequence-parallel mpu divides that all-rank sum by ``D`` at ZeRO 0–2 and on ZeRO 3's all-reduce path
(``zero_optimization.reduce_scatter: false``), but by *every* rank (``D·S``, ``S`` the
sequence-parallel degree) on ZeRO 3's reduce-scatter path, its default. So a loss feeding that path
scales each rank's share by ``S``, and every other one by 1 (:func:`gradient_scale`).

``ds_ring.initialize`` (and ``SequenceParallelTrainer``) take the all-reduce path at ZeRO 3
(:func:`engine_config`) and record the scale their engine needs on every parameter (:func:`mark_parameters`).
A model handed to ``deepspeed.initialize(..., mpu=topology)`` directly (DeepSpeed ALST's order) carries no such
record; its attention reads the scale off its parameters at the first forward (:func:`parameter_gradient_scale`),
before any gradient exists. This module is the only owner of the rule: every loss asks it (through the session of
``register_with_transformers``, or :func:`require_marked` for ds_ring's own modules) and nothing else computes it.
ZeRO-3 parameters are recognised by their ``ds_id`` attribute; meeting one installs
:func:`~ds_ring.engine.zero_gathers.wait_for_every_gather` (the only DeepSpeed import here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.engine.zero_gathers import wait_for_every_gather

__all__ = [
    "gradient_scale", "engine_config", "mark_parameters", "parameter_gradient_scale", "require_marked", "is_zero3",
]  # fmt: skip

_MARK = "ds_ring_gradient_scale"


def gradient_scale(zero_optimization: Mapping[str, Any] | None, sequence_parallel: int) -> int:
    """The factor on each rank's gradient share that makes DeepSpeed's reduction give the whole model's
    gradient: ``sequence_parallel`` on ZeRO 3's reduce-scatter path (``reduce_scatter`` defaults to
    true), else 1. ``zero_optimization``: the ds_config's section (``None``: ZeRO 0)."""
    zero = zero_optimization or {}
    reduce_scatter = zero.get("reduce_scatter", True)
    return sequence_parallel if int(zero.get("stage", 0)) == 3 and reduce_scatter else 1


def engine_config(ds_config: Mapping[str, Any], sequence_parallel: int) -> dict[str, Any]:
    """``ds_config`` as ds_ring hands it to DeepSpeed with a sequence-parallel mpu: at ZeRO 3 with
    ``sequence_parallel > 1``, on the all-reduce path (``reduce_scatter: false``), which divides the all-rank
    gradient sum by the data-parallel degree as stages 0-2 do; otherwise unchanged (a copy)."""
    config = dict(ds_config)
    zero = dict(config.get("zero_optimization") or {})
    if int(zero.get("stage", 0)) != 3 or sequence_parallel == 1:
        return config
    return {**config, "zero_optimization": {**zero, "reduce_scatter": False}}


def mark_parameters(model: torch.nn.Module, ds_config: Mapping[str, Any], sequence_parallel: int) -> None:
    """Record on every parameter of ``model`` the gradient scale of the engine built with ``ds_config`` (what
    :func:`engine_config` gave DeepSpeed) over ``sequence_parallel`` ranks per sequence; and make that engine's
    blocking ZeRO-3 gathers whole when they return (:func:`~ds_ring.engine.zero_gathers.wait_for_every_gather`)."""
    wait_for_every_gather()
    scale = gradient_scale(ds_config.get("zero_optimization"), sequence_parallel)
    for param in model.parameters():
        setattr(param, _MARK, scale)


def is_zero3(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is a ZeRO-3 (partitioned) parameter."""
    return hasattr(param, "ds_id")


def parameter_gradient_scale(
    params: Iterable[torch.nn.Parameter],
    zero_optimization: Mapping[str, Any] | None,
    sequence_parallel: int,
    *,
    where: str,
) -> int:
    """The gradient scale for a model whose parameters include ``params``, read off them.

    A parameter marked by ``ds_ring.initialize`` carries its engine's scale. An unmarked ZeRO-3
    parameter was partitioned by ``deepspeed.initialize(..., mpu=topology)``: it must be partitioned
    over every rank (the topology's :meth:`~ds_ring.Topology.get_data_parallel_group`), and the scale
    follows ``zero_optimization``: the ds_config section the caller was given with the model (``None``:
    not given, so DeepSpeed's defaults). A parameter that is neither: ZeRO 0–2 or no engine, 1.

    Raises:
        ValueError: a ZeRO-3 parameter partitioned over fewer than every rank, or a ``zero_optimization``
            that is not stage 3 for a ZeRO-3 model (``where`` names the module).
    """
    listed = list(params)  # not next(iter(params), None): torch 2.6's compiler does not trace it (docs/hf.md)
    param = listed[0] if listed else None
    if param is None or hasattr(param, _MARK):
        return 1 if param is None else int(getattr(param, _MARK))
    if not is_zero3(param):
        return 1
    wait_for_every_gather()
    group = getattr(param, "ds_process_group", None)
    ranks, world = (dist.get_world_size(group), dist.get_world_size()) if dist.is_initialized() else (1, 1)
    if ranks != world:
        raise ValueError(
            f"{where}: its ZeRO-3 parameters are partitioned over {ranks} of the {world} ranks, so the "
            f"sequence-parallel ranks would never add up their gradient shares; build the engine with "
            f"ds_ring.initialize, or pass the ds_ring Topology as deepspeed.initialize(..., mpu=topology) so that "
            f"ZeRO-3 partitions over every rank"
        )
    if zero_optimization is not None and int(zero_optimization.get("stage", 0)) != 3:
        raise ValueError(
            f"{where}: its parameters are ZeRO-3 partitioned, but the ds_config ds_ring was given says "
            f"zero_optimization.stage {zero_optimization.get('stage', 0)}; give register_with_transformers the "
            f"ds_config the engine was built with"
        )
    return gradient_scale(zero_optimization if zero_optimization is not None else {"stage": 3}, sequence_parallel)


def require_marked(param: torch.nn.Parameter, sequence_parallel: int, *, where: str) -> None:
    """``ValueError`` naming ``ds_ring.initialize`` for a ZeRO-3 parameter of a sequence-parallel model whose
    engine was not built by it: ds_ring's own losses (``sequence_parallel_cross_entropy``) cannot know
    that such an engine divides by every rank."""
    if not is_zero3(param):
        return
    wait_for_every_gather()
    if sequence_parallel > 1 and not hasattr(param, _MARK):
        raise ValueError(
            f"{where}: the model was given to deepspeed.initialize(..., mpu=topology) at ZeRO 3, whose default "
            f"reduce-scatter path divides the gradient sum by every rank where ds_ring's losses expect the "
            f"data-parallel degree; build the engine with ds_ring.initialize (it partitions over the same ranks "
            f"and reduces like ZeRO 0-2), or use stage 0-2"
        )
