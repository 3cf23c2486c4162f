"""DeepSpeed glue: read the ``ring_attention`` section, build the topology, install the strategy,
and hand the topology to ``deepspeed.initialize`` as its ``mpu`` so ZeRO reduces gradients over
the sequence-data-parallel group; attach the monitoring hooks the section switches on.
"""

from __future__ import annotations

import os
import uuid
import weakref
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
from ds_ring.comm.backends import device_backend
from ds_ring.comm.job import process
from ds_ring.comm.wait import DEFAULT_TIMEOUT_S, process_group_timeout_s
from ds_ring.config import SECTION, MonitoringConfig, PreemptionConfig, RingAttentionConfig, read_section
from ds_ring.cpu_heap import configure_cpu_heap
from ds_ring.engine.build_locks import clear_stale_build_locks
from ds_ring.engine.gradient_scale import engine_config, mark_parameters
from ds_ring.engine.launch_env import discover_launch_env
from ds_ring.engine.patches import Patch, set_attribute
from ds_ring.engine.preemption import Preemption
from ds_ring.engine.zero_gathers import stop_waiting_for_every_gather
from ds_ring.monitor import RingMonitor, at_clean_exit, flush_writer
from ds_ring.parallel.topology import Topology

__all__ = [
    "initialize",
    "install",
    "init_distributed",
    "local_cuda_device",
    "process_group_backend",
    "deepspeed_config_for",
    "EngineAttachments",
    "attachments_of",
    "attach_monitor",
    "attach_preemption",
]

MONITOR_BACKENDS = ("csv_monitor", "tensorboard", "wandb", "comet")


class EngineAttachments:
    """What ds_ring attaches to one engine (``engine.ds_ring_attachments``): its monitor, the exit flush of the
    engine's DeepSpeed monitor, its preemption handlers, and every attribute of the engine ds_ring sets
    (``ring_monitor``, ``preemption``, the fenced ``step``, ``destroy``: :mod:`ds_ring.engine.patches`). :meth:`close`
    removes all of them and puts the engine's own attributes back; an engine that ``ds_ring.initialize`` built
    closes them in its ``destroy()``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.monitor: RingMonitor | None = None
        self.preemption: Preemption | None = None
        self.forget_flush: Callable[[], None] | None = None  # undoes the exit flush of the engine's monitor
        self.patches: dict[str, Patch] = {}

    def attach(self, name: str, value: Any) -> None:
        """``engine.<name> = value`` until :meth:`close` (ds_ring's earlier value of it undone first)."""
        self.detach(name)
        self.patches[name] = set_attribute(self.engine, name, value, library="deepspeed")

    def detach(self, name: str) -> None:
        """Put back the engine's own ``name`` (no-op where ds_ring set none)."""
        patch = self.patches.pop(name, None)
        if patch is not None:
            patch.undo()

    def close_monitor(self) -> None:
        """Remove the monitor's hooks and its exit flush (no-op if none)."""
        if self.monitor is not None:
            self.monitor.close()
        if self.forget_flush is not None:
            self.forget_flush()
        self.monitor, self.forget_flush = None, None
        self.detach("ring_monitor")

    def close(self) -> None:
        """Remove the monitor, its exit flush and the preemption handlers (no-op for those not attached), and put
        back every attribute of the engine ds_ring set."""
        self.close_monitor()
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None
        for name in reversed(list(self.patches)):
            self.detach(name)
        engines = _live_engines()
        engines.discard(self)
        if not engines:  # no engine of this process left: DeepSpeed's own ZeRO-3 gather again
            stop_waiting_for_every_gather()


def _live_engines() -> weakref.WeakSet[EngineAttachments]:
    """The attachments of this process's engines not closed yet (the process's :class:`~ds_ring.comm.job.Job`)."""
    owner = process()
    return owner.owned(owner, "engine attachments", weakref.WeakSet)


def attachments_of(engine: Any) -> EngineAttachments:
    """``engine``'s :class:`EngineAttachments` (made empty, and set as ``engine.ds_ring_attachments``, if none)."""
    attachments = getattr(engine, "ds_ring_attachments", None)
    if attachments is None:
        attachments = EngineAttachments(engine)
        attachments.attach("ds_ring_attachments", attachments)
        _live_engines().add(attachments)
    return attachments


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
    A lock left by a killed build of DeepSpeed's ops raises here, naming it (:mod:`ds_ring.engine.build_locks`).
    """
    if dist.is_initialized():
        return
    clear_stale_build_locks()
    discover_launch_env()
    backend = process_group_backend()
    if backend == "gloo":
        configure_cpu_heap()  # a CPU rank: freed tensors leave the RSS (ds_ring/cpu_heap.py)
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
            settings.update(section.call_settings(), strategy=section.strategy)
        module.configure(**settings)
    return len(modules)


def _check_heads(model: nn.Module, section: RingAttentionConfig, world_size: int, seq_len: int | None) -> None:
    for module in model.modules():
        if isinstance(module, MultiheadRingDilatedAttention):
            section.check(
                world_size=world_size, num_heads=module.num_heads, num_kv_heads=module.num_kv_heads, seq_len=seq_len
            )


def deepspeed_config_for(ds_config: Mapping[str, Any], topology: Topology) -> dict[str, Any]:
    """The ds_config DeepSpeed gets with ``topology`` as its mpu: without the ``ring_attention`` section, and the ZeRO
    reduction :func:`ds_ring.engine.gradient_scale.engine_config` chooses. DeepSpeed partitions the parameters itself,
    over every rank (the topology's ``get_data_parallel_group``), in the dtype the ds_config's ``bf16`` / ``fp16``
    give."""
    config = {key: value for key, value in ds_config.items() if key != SECTION}
    return engine_config(config, topology.get_sequence_parallel_world_size())


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
    bounded by ``timeout_s`` (``None``: 300 s). A monitor attached to this engine before is closed (the engine's
    :class:`EngineAttachments` hold both, and its exit flush)."""
    attachments = attachments_of(engine)
    attachments.close_monitor()
    writer = getattr(engine, "monitor", None)
    attachments.forget_flush = at_clean_exit(partial(flush_writer, writer)) if writer is not None else None
    attachments.monitor = RingMonitor(
        metrics=monitoring.metrics,
        watchdog=monitoring.watchdog,
        step_timeout_s=monitoring.step_timeout_s,
        numerics_guard=monitoring.numerics_guard,
        model=model,
        writer=getattr(engine, "monitor", None),
        timeout_s=timeout_s,
        group=group,
    )
    attachments.attach("ring_monitor", attachments.monitor)
    return attachments.monitor


def attach_preemption(
    engine: Any, config: PreemptionConfig, *, timeout_s: float | None = None, group: ProcessGroup | None = None
) -> Preemption:
    """Install the section's preemption handlers as ``engine.preemption``
    (:class:`ds_ring.engine.preemption.Preemption`; the training loop polls ``engine.preemption.stop_requested(step)``
    after every step); its all-reduce runs over ``group`` (the topology's control group), bounded by ``timeout_s``.
    Those attached to this engine before are removed (:class:`EngineAttachments`)."""
    attachments = attachments_of(engine)
    if attachments.preemption is not None:
        attachments.preemption.close()
    preemption = attachments.preemption = Preemption(config, group=group, timeout_s=timeout_s).install()
    if dist.is_initialized():  # names this run's notices and checkpoint parts (rank 0's, on every rank)
        token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        preemption.token = token[0]
    attachments.attach("preemption", preemption)
    _fence_updates(engine, attachments)
    return preemption


def _fence_updates(engine: Any, attachments: EngineAttachments) -> None:
    """``engine.step()`` runs the optimizer update inside ``engine.preemption.updating()`` at a gradient
    accumulation boundary (the gate that keeps a preemption from abandoning the step on some ranks only)."""
    step = getattr(engine, "step", None)
    if step is None or "step" in attachments.patches:
        return

    def fenced_step(*args: Any, **kwargs: Any) -> Any:
        preemption = getattr(engine, "preemption", None)
        if preemption is None or not engine.is_gradient_accumulation_boundary():
            return step(*args, **kwargs)
        with preemption.updating():
            return step(*args, **kwargs)

    attachments.attach("step", fenced_step)


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
        :class:`ds_ring.engine.preemption.Preemption` of its ``preemption`` entry (the loop polls its
        ``stop_requested`` after every step, then saves and returns: docs/elastic.md).

    The section is read by :func:`ds_ring.config.read_section` (``enabled: false``: no sequence parallelism).
    The ranks agree on it and ``seq_len`` (:meth:`ds_ring.config.DsConfig.agree`) before the checks that need the
    world size or the model, so a section that differs between ranks fails on every rank with each rank's values
    rather than on some ranks while the others wait. ``engine.destroy()`` also removes the monitor and the signal
    handlers (``engine.ds_ring_attachments``).

    Raises:
        ValueError: a malformed section or one inconsistent with the ds_config's monitors (before
            ``torch.distributed`` starts); a section or ``seq_len`` that differs between ranks (on
            every rank); a section inconsistent with the world size, the model's heads or ``seq_len``
            — all before any data moves.
    """
    if "mpu" in deepspeed_kwargs:
        raise ValueError("ds_ring.initialize builds the mpu from the ds_config; do not pass mpu=")
    loaded = read_section(config)
    section = loaded.section
    _check_monitor_backend(section, loaded.whole)
    discover_launch_env()
    init_distributed(section.timeout_s)
    loaded.agree(seq_len)
    world_size = dist.get_world_size()
    if section.enabled:
        _check_heads(model, section, world_size, seq_len)
    topology = Topology.from_config(section, world_size)
    install(model, section, topology)
    config_for_deepspeed = deepspeed_config_for(loaded.whole, topology)
    initialized = deepspeed.initialize(
        model=model,
        model_parameters=model_parameters,
        optimizer=optimizer,
        config=config_for_deepspeed,
        mpu=topology,
        **deepspeed_kwargs,
    )
    mark_parameters(model, config_for_deepspeed, topology.get_sequence_parallel_world_size())
    engine, control = initialized[0], topology.control_group(None)
    attach_monitor(engine, model, section.monitoring, timeout_s=section.timeout_s, group=control)
    attach_preemption(engine, section.preemption, timeout_s=section.timeout_s, group=control)
    _close_on_destroy(engine)
    return initialized


def _close_on_destroy(engine: Any) -> None:
    """``engine.destroy()`` first removes what ds_ring attached to it (:class:`EngineAttachments`, ``destroy``
    itself included)."""
    destroy = getattr(engine, "destroy", None)
    if destroy is None:
        return

    def destroy_and_detach(*args: Any, **kwargs: Any) -> Any:
        attachments_of(engine).close()
        return destroy(*args, **kwargs)

    attachments_of(engine).attach("destroy", destroy_and_detach)
