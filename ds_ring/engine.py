"""DeepSpeed glue: read the ``ring_attention`` section, build the topology, install the strategy,
and hand the topology to ``deepspeed.initialize`` as its ``mpu`` so ZeRO reduces gradients over
the sequence-data-parallel group; attach the monitoring hooks the section switches on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from os import PathLike
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn
from torch.distributed import ProcessGroup

from ds_ring.attention import MultiheadRingDilatedAttention, RingDilatedAttention
from ds_ring.build_locks import refuse_stale_build_locks
from ds_ring.comm.agree import agree
from ds_ring.comm.backends import device_backend
from ds_ring.comm.wait import DEFAULT_TIMEOUT_S, process_group_timeout_s
from ds_ring.config import SECTION, MonitoringConfig, PreemptionConfig, RingAttentionConfig, load_config, read_ds_config
from ds_ring.launch_env import discover_launch_env
from ds_ring.monitor import RingMonitor, at_clean_exit, flush_writer
from ds_ring.parallel.groups import control_world
from ds_ring.parallel.topology import Topology
from ds_ring.preemption import Preemption
from ds_ring.zero import gradient_scale, mark_parameters

__all__ = [
    "initialize",
    "install",
    "init_distributed",
    "local_cuda_device",
    "process_group_backend",
    "agree_on_section",
    "attach_monitor",
    "attach_preemption",
]

MONITOR_BACKENDS = ("csv_monitor", "tensorboard", "wandb", "comet")
_attached: RingMonitor | None = None  # the monitor of the last ds_ring.initialize in this process
_forget_flush: Callable[[], None] | None = None  # undoes the exit flush of that engine's monitor
_preemption: Preemption | None = None  # the signal handlers of the last ds_ring.initialize in this process


def _restart_safe_store(timeout: timedelta) -> dist.Store | None:
    """Under ``torchrun``, a view of the agent's store private to this restart attempt (else ``None``).

    The agent keeps one TCPStore for every restart of a job, and ``torch.distributed``'s ``env://``
    rendezvous uses it with the same keys each time: ranks restarted after a failure could read the
    addresses their dead predecessors published, and then fail to connect or wait for the timeout
    (seen with the static rendezvous of ``--master-addr/--master-port``, torch 2.13). Prefixing the
    keys with ``TORCHELASTIC_RESTART_COUNT`` keeps each attempt to itself.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ds_ring/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def process_group_backend() -> str:
    """The backend ds_ring starts ``torch.distributed`` with: the accelerator's (gloo on a CPU), and on CUDA
    ``"cpu:gloo,cuda:nccl"`` (as torchtitan does), so every process group takes the small CPU tensors of
    control traffic (agreements, metrics, guards, checkpoint tags) on gloo and the data on NCCL."""
    backend = get_accelerator().communication_backend_name()
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def local_cuda_device(backend: str) -> torch.device | None:
    """This rank's GPU, ``cuda:<LOCAL_RANK>`` (0 when unset), when ``backend`` moves CUDA tensors with NCCL and
    CUDA is available; else ``None``."""
    if device_backend(backend, "cuda") != "nccl" or not torch.cuda.is_available():
        return None
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Start ``torch.distributed`` once, from whatever launcher started this process.

    Reads the rank from the launcher's environment (``deepspeed``, ``torchrun``, SLURM, or
    ``mpirun`` through mpi4py — keeping ``MASTER_ADDR`` if set), starts the process group with
    :func:`process_group_backend` and hands it to DeepSpeed (``deepspeed.init_distributed`` adopts it).
    Under ``torchrun`` the rendezvous keys are private to the restart attempt, so ``--max-restarts``
    restarts rendezvous afresh. The process group's timeout is :func:`~ds_ring.comm.wait.process_group_timeout_s`
    (twice ``timeout_s``, so NCCL's watchdog stays the backstop behind ds_ring's bounded waits). On NCCL the
    group is bound to this rank's GPU (``LOCAL_RANK``, :func:`local_cuda_device`) with ``device_id``: NCCL
    connects at start-up, and every group made from it later (:class:`ds_ring.Topology`'s) connects when made.
    A lock left by a killed build of DeepSpeed's ops raises here, naming it (:mod:`ds_ring.build_locks`).
    """
    if dist.is_initialized():
        return
    refuse_stale_build_locks()
    discover_launch_env()
    backend = process_group_backend()
    timeout = timedelta(seconds=process_group_timeout_s(timeout_s))  # NCCL's watchdog: the backstop
    store = _restart_safe_store(timedelta(seconds=timeout_s))
    device = local_cuda_device(backend)
    bound: dict[str, Any] = {}
    if device is not None:
        torch.cuda.set_device(device)
        bound["device_id"] = device
    if store is not None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bound)
    else:
        dist.init_process_group(backend, timeout=timeout, **bound)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)


def agree_on_section(section: RingAttentionConfig, seq_len: int | None = None) -> None:
    """Collective: ``ValueError`` on every rank unless all pass the same validated section and ``seq_len``.

    Fields are compared after validation (defaults filled in), so a key left at its default on one
    rank and written out on another agrees; the message names ``ring_attention.<field>`` and each
    rank's value. One small all-gather, bounded by the section's ``timeout_s``.
    """
    fields = {"seq_len": seq_len}
    for key, value in section.model_dump().items():
        if isinstance(value, Mapping):
            fields.update({f"{SECTION}.{key}.{inner}": v for inner, v in value.items()})
        else:
            fields[f"{SECTION}.{key}"] = value
    agree(fields, group=control_world(), op="ds_ring.initialize", timeout_s=section.timeout_s, fix=_SAME_SECTION,
          cache=False)  # fmt: skip


_SAME_SECTION = f"give every rank the same {SECTION} section (the same ds_config on every node) and the same seq_len"


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


def deepspeed_config_for(ds_config: Mapping[str, Any], topology: Topology) -> dict[str, Any]:
    """The ds_config DeepSpeed gets with ``topology`` as its mpu: without the ``ring_attention`` section, and at
    ZeRO 3 with sequence parallelism on DeepSpeed's all-reduce path, which divides the all-rank gradient sum by the
    data-parallel degree as stages 0-2 do (its reduce-scatter path divides by every rank: :mod:`ds_ring.zero`).
    DeepSpeed partitions the parameters itself, over every rank (the topology's ``get_data_parallel_group``), in
    the dtype the ds_config's ``bf16`` / ``fp16`` give."""
    config = {key: value for key, value in ds_config.items() if key != SECTION}
    zero = dict(config.get("zero_optimization") or {})
    if int(zero.get("stage", 0)) != 3 or topology.get_sequence_parallel_world_size() == 1:
        return config
    return {**config, "zero_optimization": {**zero, "reduce_scatter": False}}


def mark_engine_parameters(model: nn.Module | None, config: Mapping[str, Any], topology: Topology) -> None:
    """After ``deepspeed.initialize`` with ``config`` (from :func:`deepspeed_config_for`): record on ``model``'s
    parameters the gradient scale its engine needs (:func:`ds_ring.zero.mark_parameters`)."""
    if model is not None:
        scale = gradient_scale(config.get("zero_optimization"), topology.get_sequence_parallel_world_size())
        mark_parameters(model, scale)


def _check_monitor_backend(section: RingAttentionConfig, ds_config: Mapping[str, Any]) -> None:
    """``monitoring.metrics`` writes through DeepSpeed's monitor: one backend must be enabled."""
    if not section.monitoring.metrics:
        return
    enabled = [name for name in MONITOR_BACKENDS if (ds_config.get(name) or {}).get("enabled")]
    if not enabled:
        raise ValueError(
            f"{SECTION}.monitoring.metrics is true but the ds_config enables none of DeepSpeed's monitors "
            f'{list(MONITOR_BACKENDS)}; add e.g. "csv_monitor": {{"enabled": true, "output_path": '
            f'"runs/monitor", "job_name": "ring"}} to the ds_config, or set metrics to false'
        )


def attach_monitor(
    engine: Any,
    model: nn.Module,
    monitoring: MonitoringConfig,
    *,
    timeout_s: float | None = None,
    group: ProcessGroup | None = None,
) -> RingMonitor:
    """Attach the section's monitoring hooks to ``engine`` as ``engine.ring_monitor`` (metrics go to
    ``engine.monitor``, whose buffering backends :func:`ds_ring.run_main` flushes before the process
    ends); its collectives run over ``group`` (every rank, CPU tensors: the topology's control group) and are
    bounded by ``timeout_s`` (``None``: 300 s). The monitor of an earlier ``ds_ring.initialize`` in this
    process is closed."""
    global _attached, _forget_flush
    if _attached is not None:
        _attached.close()
    if _forget_flush is not None:
        _forget_flush()
    writer = getattr(engine, "monitor", None)
    _forget_flush = at_clean_exit(partial(flush_writer, writer)) if writer is not None else None
    _attached = RingMonitor(
        metrics=monitoring.metrics,
        watchdog=monitoring.watchdog,
        step_timeout_s=monitoring.step_timeout_s,
        numerics_guard=monitoring.numerics_guard,
        model=model,
        writer=getattr(engine, "monitor", None),
        timeout_s=timeout_s,
        group=group,
    )
    engine.ring_monitor = _attached
    return _attached


def attach_preemption(
    engine: Any, config: PreemptionConfig, *, timeout_s: float | None = None, group: ProcessGroup | None = None
) -> Preemption:
    """Install the section's preemption handlers as ``engine.preemption`` (:class:`ds_ring.preemption.Preemption`;
    the training loop polls ``engine.preemption.stop_requested(step)`` after every step); its all-reduce runs over
    ``group`` (the topology's control group), bounded by ``timeout_s``. Those of an earlier engine are removed."""
    global _preemption
    if _preemption is not None:
        _preemption.close()
    _preemption = Preemption(config, group=group, timeout_s=timeout_s).install()
    engine.preemption = _preemption
    return _preemption


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
        config: the whole ds_config (JSON or YAML path, or dict); DeepSpeed gets it as it is.
        model_parameters, optimizer: as for ``deepspeed.initialize``.
        seq_len: the training sequence length, to check shards and segments now rather than at
            the first step (optional).
        **deepspeed_kwargs: passed on (``args``, ``training_data``, ``lr_scheduler``, ...).

    Returns:
        What ``deepspeed.initialize`` returns: ``(engine, optimizer, dataloader, lr_scheduler)``;
        ``engine.mpu`` is the :class:`ds_ring.Topology`, ``engine.ring_monitor`` the
        :class:`ds_ring.monitor.RingMonitor` of the section's ``monitoring`` (the training loop
        calls its ``begin_step`` / ``skip_step`` / ``end_step``) and ``engine.preemption`` the
        :class:`ds_ring.preemption.Preemption` of its ``preemption`` entry (the loop polls its
        ``stop_requested`` after every step, then saves and returns: docs/elastic.md).

    The ranks agree on the validated section and ``seq_len`` (:func:`agree_on_section`) before the
    checks that need the world size or the model, so a section that differs between ranks fails
    on every rank with each rank's values rather than on some ranks while the others wait.

    Raises:
        ValueError: a malformed section or one inconsistent with the ds_config's monitors (before
            ``torch.distributed`` starts); a section or ``seq_len`` that differs between ranks (on
            every rank); a section inconsistent with the world size, the model's heads or ``seq_len``
            — all before any data moves.
    """
    if "mpu" in deepspeed_kwargs:
        raise ValueError("ds_ring.initialize builds the mpu from the ds_config; do not pass mpu=")
    ds_config = read_ds_config(config)
    section = load_config(ds_config)
    _check_monitor_backend(section, ds_config)
    discover_launch_env()
    init_distributed(section.timeout_s)
    agree_on_section(section, seq_len)
    world_size = dist.get_world_size()
    if section.enabled:
        _check_heads(model, section, world_size, seq_len)
    else:
        section = RingAttentionConfig(
            enabled=False, sequence_parallel_size=1, timeout_s=section.timeout_s, monitoring=section.monitoring,
            preemption=section.preemption,
        )  # fmt: skip
    topology = Topology.from_config(section, world_size)
    install(model, section, topology)
    config_for_deepspeed = deepspeed_config_for(ds_config, topology)
    initialized = deepspeed.initialize(
        model=model,
        model_parameters=model_parameters,
        optimizer=optimizer,
        config=config_for_deepspeed,
        mpu=topology,
        **deepspeed_kwargs,
    )
    mark_engine_parameters(model, config_for_deepspeed, topology)
    control = topology.control_group(None)
    attach_monitor(initialized[0], model, section.monitoring, timeout_s=section.timeout_s, group=control)
    attach_preemption(initialized[0], section.preemption, timeout_s=section.timeout_s, group=control)
    return initialized
