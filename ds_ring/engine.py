"""DeepSpeed glue: read the ``ring_attention`` section, build the topology, install the strategy,
and hand the topology to ``deepspeed.initialize`` as its ``mpu`` so ZeRO reduces gradients over
the sequence-data-parallel group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import timedelta
from os import PathLike
from typing import Any

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from ds_ring.attention import MultiheadRingDilatedAttention, RingDilatedAttention
from ds_ring.comm.wait import set_default_timeout
from ds_ring.config import SECTION, RingAttentionConfig, load_config
from ds_ring.launch_env import discover_launch_env
from ds_ring.topology import Topology

__all__ = ["initialize", "install", "init_distributed"]


def _read(config: str | PathLike | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    with open(config) as handle:
        return json.load(handle)


def init_distributed(timeout_s: float = 300.0) -> None:
    """Start ``torch.distributed`` once, from whatever launcher started this process.

    Reads the rank from the launcher's environment (``deepspeed``, ``torchrun``, SLURM, or
    ``mpirun`` through mpi4py — keeping ``MASTER_ADDR`` if set), then calls
    ``deepspeed.init_distributed`` with the accelerator's backend (gloo on CPU, NCCL on CUDA).
    """
    if dist.is_initialized():
        return
    discover_launch_env()
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        auto_mpi_discovery=False,
        timeout=timedelta(seconds=timeout_s),
    )


def _attention_modules(model: nn.Module) -> list[RingDilatedAttention]:
    return [m for m in model.modules() if isinstance(m, RingDilatedAttention)]


def install(model: nn.Module, section: RingAttentionConfig, topology: Topology) -> int:
    """Set every ds_ring attention module of ``model`` to the section's strategy; returns how many.

    With ``enabled: false`` every module attends over the whole sequence its rank holds.
    """
    modules = _attention_modules(model)
    for module in modules:
        settings: dict[str, Any] = dict(topology=topology, timeout_s=section.timeout_s)
        if section.enabled:
            settings.update(
                strategy=section.strategy,
                communication=section.communication,
                layout=section.layout,
                causal=section.causal,
                segment_lengths=section.segment_lengths,
                dilation_rates=section.dilation_rates,
            )
        module.configure(**settings)
    return len(modules)


def _check_heads(model: nn.Module, section: RingAttentionConfig, world_size: int, seq_len: int | None) -> None:
    for module in model.modules():
        if isinstance(module, MultiheadRingDilatedAttention):
            section.check(
                world_size=world_size, num_heads=module.num_heads, num_kv_heads=module.num_kv_heads, seq_len=seq_len
            )


def _zero3_over_sequence_data_parallel(model: nn.Module, ds_config: dict[str, Any], topology: Topology) -> dict:
    """Make ZeRO-3 reduce gradients over the sequence-data-parallel group, like stages 1 and 2.

    DeepSpeed 0.19's stage 3 partitions parameters over ``mpu.get_data_parallel_group()`` (the pure
    data-parallel group, so sequence-parallel ranks never add up their gradient shares) and its
    default reduce-scatter path divides by the whole partition group (``dp·sp``) where stages 1-2
    divide by ``dp``. Partitioning the parameters over the sequence-data-parallel group here and
    taking the all-reduce path (``reduce_scatter: false``, which divides by ``group size / sp``)
    gives every stage the same gradients.
    """
    zero = dict(ds_config.get("zero_optimization", {}))
    if int(zero.get("stage", 0)) != 3 or topology.get_sequence_parallel_world_size() == 1:
        return ds_config
    zero["reduce_scatter"] = False
    ds_config = {**ds_config, "zero_optimization": zero}
    deepspeed.zero.Init(
        module=model, data_parallel_group=topology.sequence_data_parallel_group, config_dict_or_path=ds_config
    )
    return ds_config


def initialize(
    *,
    model: nn.Module,
    config: str | PathLike | Mapping[str, Any],
    model_parameters: Any = None,
    optimizer: Any = None,
    seq_len: int | None = None,
    **deepspeed_kwargs: Any,
) -> tuple[Any, ...]:
    """``deepspeed.initialize`` with sequence parallelism from the ds_config's ``ring_attention`` section.

    Args:
        model: a model whose attention modules are :class:`ds_ring.RingDilatedAttention` (or
            :class:`ds_ring.MultiheadRingDilatedAttention`).
        config: the whole ds_config (JSON path or dict); DeepSpeed gets it as it is.
        model_parameters, optimizer: as for ``deepspeed.initialize``.
        seq_len: the training sequence length, to check shards and segments now rather than at
            the first step (optional).
        **deepspeed_kwargs: passed on (``args``, ``training_data``, ``lr_scheduler``, ...).

    Returns:
        What ``deepspeed.initialize`` returns: ``(engine, optimizer, dataloader, lr_scheduler)``;
        ``engine.mpu`` is the :class:`ds_ring.Topology`.

    Raises:
        ValueError: a malformed section or one inconsistent with the world size, the model's heads
            or ``seq_len`` — before any collective.
    """
    if "mpu" in deepspeed_kwargs:
        raise ValueError("ds_ring.initialize builds the mpu from the ds_config; do not pass mpu=")
    ds_config = _read(config)
    section = load_config(ds_config)
    discover_launch_env()
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if section.enabled:
        _check_heads(model, section, world_size, seq_len)
    else:
        section = RingAttentionConfig(enabled=False, sequence_parallel_size=1, timeout_s=section.timeout_s)
    init_distributed(section.timeout_s)
    set_default_timeout(section.timeout_s)
    topology = Topology.from_config(section, world_size)
    install(model, section, topology)
    config_for_deepspeed = {key: value for key, value in ds_config.items() if key != SECTION}
    config_for_deepspeed = _zero3_over_sequence_data_parallel(model, config_for_deepspeed, topology)
    return deepspeed.initialize(
        model=model,
        model_parameters=model_parameters,
        optimizer=optimizer,
        config=config_for_deepspeed,
        mpu=topology,
        **deepspeed_kwargs,
    )
