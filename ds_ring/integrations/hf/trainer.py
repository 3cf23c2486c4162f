"""transformers' ``Trainer``, sequence parallel from the ds_config alone: change ``Trainer`` to
:class:`SequenceParallelTrainer` and add a ``ring_attention`` section to the ds_config passed as
``TrainingArguments(deepspeed=...)``.

What it changes in ``Trainer`` (and nothing else):

- **topology and attention**: reads the ds_config (:func:`ds_ring.config.read_section`), builds the
  :class:`~ds_ring.Topology` from the section once ``torch.distributed`` is up (collective), registers the model's
  attention (:func:`register_with_transformers`: ``trainer.session``) and applies the section's ``long_context`` to
  the model (:meth:`~ds_ring.integrations.hf.session.SequenceParallelSession.apply_long_context`);
- **the engine**: every ``deepspeed.initialize`` the Trainer (through accelerate) makes gets the topology as its
  ``mpu``, the batch size of the data-parallel replicas (not of every rank), ZeRO 3 on the all-reduce path and the
  parameters marked as ``ds_ring.initialize`` marks them (:mod:`ds_ring.engine.gradient_scale`);
- **the data**: every rank of a sequence-parallel group gets the same batches (the samplers split over the
  ``D = world ÷ sequence-parallel`` data-parallel replicas), then this rank's shard (:func:`shard_batch`: packed
  batches from ``DataCollatorWithFlattening`` included; a vision-language model's batch, its images and grids
  included, reaches the model whole and is cut before its language model); steps per epoch, the total batch size and
  the tokens logged count each sequence once;
- **the loss**: :func:`causal_lm_loss` (ds_ring's contract: the group's mean, each rank's gradient its share), or the
  model's own ``.loss`` when ``long_context.tiled_loss`` computes it; gradient accumulation as the Trainer does it;
- **evaluation and prediction**: sequence parallel, the loss the group's mean, logits gathered along the sequence
  and metrics over the data-parallel replicas; with ``disable_in_eval=True`` the original attention on whole
  sequences instead, each rank its own samples, as a plain ``Trainer`` would.

Checkpoints are the Trainer's (DeepSpeed's engine checkpoint, RNG states, sampler position): ``save_model`` writes
an ordinary Hugging Face checkpoint and ``resume_from_checkpoint`` continues where the run stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_ring.integrations.hf.batches import shard_batch
from ds_ring.integrations.hf.compat import trainer_counts_tokens_in_hook
from ds_ring.integrations.hf.loss import causal_lm_loss
from ds_ring.integrations.hf.preemption import StopOnPreemption
from ds_ring.integrations.hf.registration import register_with_transformers
from ds_ring.integrations.hf.router import add_router_aux_loss
from ds_ring.integrations.internal import (
    SECTION,
    DsConfig,
    Preemption,
    RingAttentionConfig,
    Topology,
    all_gather,
    control_world,
    gather_sequence,
    group_members,
    mark_parameters,
    read_ds_config,
    read_section,
    set_attribute,
)

__all__ = ["SequenceParallelTrainer"]


def _trainer_base() -> type:
    from transformers import Trainer

    return Trainer


class SequenceParallelTrainer(_trainer_base()):  # type: ignore[misc]
    """A ``transformers.Trainer`` whose model trains sequence parallel as the ds_config's ``ring_attention`` says.

    Takes the Trainer's arguments; ``args.deepspeed`` (a path or dict) must hold an enabled ``ring_attention``
    section. ``disable_in_eval``: evaluate and predict on whole sequences with the model's original attention.

    Raises:
        ValueError: before training, naming both sides: no ds_config or no enabled section, a
            ``parallelism_config`` that also asks for sequence parallelism (ALST's), or a section that does not fit
            the job (the world size, the model's heads).
    """

    def __init__(self, model: nn.Module | None = None, args: Any = None, *rest: Any, disable_in_eval: bool = False,
                 **kwargs: Any) -> None:  # fmt: skip
        self.loaded = _section_of(args)
        self.section = self.loaded.section
        _refuse_other_sequence_parallelism(args)
        args = _on_every_rank(args)
        super().__init__(model, args, *rest, **kwargs)
        _refuse_other_losses(self)
        self.model_accepts_loss_kwargs = False  # ds_ring's loss, not the model's with num_items_in_batch
        self.loss_is_scaled_for_ga = False  # the group mean of one micro-batch: the Trainer divides it by the steps
        self.disable_in_eval = disable_in_eval
        self._tokens_mode: str | None = None  # the user's setting while ds_ring counts (older transformers)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        model = self.accelerator.unwrap_model(self.model)
        _check_fits(self.section, world_size, model)
        self.loaded.agree(op="SequenceParallelTrainer")
        self.topology = Topology.from_config(self.section, world_size)
        self.session = register_with_transformers(
            model, config=self.loaded, topology=self.topology, disable_in_eval=disable_in_eval
        )
        self.session.apply_long_context(model)
        self.preemption = Preemption(
            self.section.preemption, group=control_world(), timeout_s=self.section.timeout_s
        ).install()
        self.add_callback(StopOnPreemption(self.preemption))

    # --- the engine ---------------------------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with _engine_over(self.topology, self.args), self._tokens_counted_here():
            return super().train(*args, **kwargs)

    @contextlib.contextmanager
    def _tokens_counted_here(self) -> Iterator[None]:
        """Where the Trainer counts input tokens inside its loop (no ``_track_num_input_tokens``: transformers
        5.0 and 5.2 among those tested), turn its count off for the loop and count in :meth:`training_step` instead."""
        if trainer_counts_tokens_in_hook():
            yield
            return
        self._tokens_mode, self.args.include_num_input_tokens_seen = self.args.include_num_input_tokens_seen, "no"
        try:
            yield
        finally:
            self.args.include_num_input_tokens_seen, self._tokens_mode = self._tokens_mode, None

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        with _engine_over(self.topology, self.args):
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with _engine_over(self.topology, self.args):
            return super().predict(*args, **kwargs)

    def close(self) -> None:
        """Put back transformers' attention and the model (the session lives as long as the trainer is used) and
        the signal handlers."""
        self.session.close()
        self.preemption.close()

    # --- arithmetic of the data-parallel replicas -----------------------------------------------------

    def get_total_train_batch_size(self, args: Any) -> int:
        return self._train_batch_size * args.gradient_accumulation_steps * self.topology.get_data_parallel_world_size()

    def _track_num_input_tokens(self, inputs: Mapping[str, Any]) -> None:
        """The Trainer's token count where it has this hook: :meth:`_count_input_tokens`."""
        self._count_input_tokens(inputs)

    def _count_input_tokens(self, inputs: Mapping[str, Any]) -> None:
        """Add the tokens of this step's batches over the data-parallel replicas to ``state.num_input_tokens_seen``:
        each sequence counted once (the ranks of a group hold the same batch), summed over the data-parallel group with
        ds_ring's collectives (accelerate's gather spans every rank, and so counts each batch once per sequence-parallel
        rank). ``include_num_input_tokens_seen`` as the Trainer reads it: ``"all"`` or ``"non_padding"`` (the attention
        mask's ones, else the tokens that are not the processing class's pad)."""
        mode = self._tokens_mode if self._tokens_mode is not None else self.args.include_num_input_tokens_seen
        main = getattr(self.model, "main_input_name", "input_ids")
        if mode == "no" or main not in inputs:
            return
        pad = getattr(self.processing_class, "pad_token_id", None)
        if mode == "non_padding" and "attention_mask" in inputs:
            count = inputs["attention_mask"].sum()
        elif mode == "non_padding" and pad is not None:
            count = (inputs[main] != pad).sum()
        else:
            count = torch.tensor(inputs[main].numel())
        control = self.topology.control_group(self.topology.data_parallel_group)  # CPU counts: gloo, or its twin
        counts = all_gather(count.reshape(1).to(torch.int64).cpu(), group_members(control), group=control,
                            op="num_input_tokens_seen", timeout_s=self.topology.timeout_s)  # fmt: skip
        self.state.num_input_tokens_seen += int(torch.cat(counts).sum())

    def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._tokens_mode is not None:  # older transformers: the Trainer's own count is off, ours counts
            self._count_input_tokens(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._tokens_mode not in (None, "no"):
            logs = {**logs, "num_input_tokens_seen": self.state.num_input_tokens_seen}
        super().log(logs, *args, **kwargs)

    # --- the data ----------------------------------------------------------------------------------------

    def _sequence_parallel(self, training: bool) -> bool:
        return training or not self.disable_in_eval

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        if not self._sequence_parallel(description == "Training"):
            return super()._get_dataloader(dataset, description, batch_size, *args, **kwargs)
        with _loaders_over_replicas(self.accelerator, self.topology):
            return super()._get_dataloader(dataset, description, batch_size, *args, **kwargs)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = super()._prepare_inputs(inputs)
        if not self._sequence_parallel(self.model.training):
            return inputs
        return shard_batch(self.session, inputs)

    # --- the loss ----------------------------------------------------------------------------------------

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if "shift_labels" not in inputs:  # whole sequences (disable_in_eval): the model's own loss
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs)  # with long_context.tiled_loss the model computes the loss from shift_labels
        loss = outputs.get("loss")
        if loss is None:
            loss = causal_lm_loss(self.session, outputs.logits, inputs["shift_labels"])
            loss = add_router_aux_loss(self.session, loss, outputs, self.model)
        return (loss, outputs) if return_outputs else loss

    # --- evaluation -----------------------------------------------------------------------------------

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        if self._sequence_parallel(False):
            self.gather_function = _DataParallelGather(self)  # the Trainer resets it at the end of the loop
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        if not self._sequence_parallel(False):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        labels = inputs.get("labels")
        sharded = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, outputs = self.compute_loss(model, sharded, return_outputs=True)
        if prediction_loss_only or outputs.get("logits") is None:
            return loss.detach(), None, None
        logits = gather_sequence(outputs.logits.detach(), self.topology, layout=self.section.layout)
        return loss.detach(), logits, None if labels is None else labels.to(logits.device)


def _section_of(args: Any) -> DsConfig:
    """``args.deepspeed`` read (:func:`~ds_ring.config.read_section`); ``ValueError`` unless its section is enabled."""
    ds_config = getattr(args, "deepspeed", None)
    if ds_config is None:
        raise ValueError(
            f"SequenceParallelTrainer needs TrainingArguments(deepspeed=...): a ds_config (path or dict) with a "
            f"{SECTION!r} section; pass the ds_config, or use transformers' Trainer"
        )
    loaded = read_section(ds_config)
    if not loaded.section.enabled:
        raise ValueError(
            f"SequenceParallelTrainer: the ds_config TrainingArguments(deepspeed=...) names has no enabled {SECTION!r} "
            f"section; add one (strategy, degrees, branches), or use transformers' Trainer"
        )
    return loaded


def _on_every_rank(args: Any) -> Any:
    """``args``, or a copy with ``use_cpu=True`` where accelerate counts one process in a job of several ranks.

    ``use_cpu`` left unset on a machine without an accelerator (a GPU job's arguments run on a CPU): DeepSpeed starts
    ``torch.distributed`` over every rank, but accelerate finds no device backend and counts one process, so every rank
    would be the Trainer's process 0 (logging, saving ``trainer_state.json`` and the model, printing). The job runs on
    the CPU either way; with ``use_cpu=True`` accelerate counts the ranks, as it does on a GPU."""
    import dataclasses

    counted = args.world_size  # sets up the devices (DeepSpeed starts torch.distributed from the launcher's env)
    if args.use_cpu or not dist.is_initialized() or counted == dist.get_world_size():
        return args
    return dataclasses.replace(args, use_cpu=True)


def _check_fits(section: RingAttentionConfig, world_size: int, model: nn.Module) -> None:
    """``ValueError`` naming the section and the job when its degrees do not fit the world; no communication: the
    same on every rank. (The model's heads and features: :func:`register_with_transformers` refuses them.)"""
    try:
        section.degrees(world_size)
    except ValueError as err:
        raise ValueError(
            f"SequenceParallelTrainer: the ds_config's {SECTION} section does not fit this job ({world_size} ranks, "
            f"{type(model).__name__}): {err}"
        ) from None


def _refuse_other_losses(trainer: Any) -> None:
    """The loss is ds_ring's sequence-group mean: a loss function or label smoothing would be silently ignored."""
    if trainer.compute_loss_func is not None:
        raise ValueError(
            "SequenceParallelTrainer(compute_loss_func=...): the loss is ds_ring's sequence-parallel cross-entropy "
            "(each rank holds a shard of the sequence); drop compute_loss_func, or override compute_loss with a "
            "loss that is the group's mean"
        )
    if trainer.args.label_smoothing_factor:
        raise ValueError(
            f"TrainingArguments(label_smoothing_factor={trainer.args.label_smoothing_factor}): ds_ring's "
            f"sequence-parallel cross-entropy has no label smoothing; set label_smoothing_factor=0"
        )
    if getattr(trainer.args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError(
            "TrainingArguments(train_sampling_strategy='batch_rebalance') splits batches over every rank, and the "
            "ranks of a sequence-parallel group need the same batches; use 'random' or 'sequential'"
        )


def _refuse_other_sequence_parallelism(args: Any) -> None:
    config = getattr(args, "parallelism_config", None)
    sp_size = getattr(config, "sp_size", 1) or 1
    if sp_size > 1:
        raise ValueError(
            f"TrainingArguments(parallelism_config=...) asks for sequence parallelism (sp_backend="
            f"{getattr(config, 'sp_backend', None)!r}, sp_size={sp_size}) and the ds_config's {SECTION!r} section "
            f"asks for ds_ring's; remove sp_size/sp_backend from parallelism_config (ds_ring's section sets the "
            f"degrees), or use transformers' Trainer for ALST"
        )


@contextlib.contextmanager
def _engine_over(topology: Topology, args: Any) -> Iterator[None]:
    """Every ``deepspeed.initialize`` inside gets ``mpu=topology`` and the ds_config ``ds_ring.initialize`` gives."""
    import deepspeed

    from ds_ring.integrations.internal import deepspeed_config_for

    original = deepspeed.initialize

    def initialize(*positional: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("mpu", topology)
        key = "config_params" if "config_params" in kwargs else "config"
        config = deepspeed_config_for(read_ds_config(kwargs[key]), topology)
        micro, steps = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps", 1)
        if isinstance(micro, int) and isinstance(steps, int):  # the Trainer counted every rank as a replica
            config["train_batch_size"] = micro * steps * topology.get_data_parallel_world_size()
        kwargs[key] = config
        initialized = original(*positional, **kwargs)
        model = kwargs.get("model", positional[1] if len(positional) > 1 else None)
        if model is not None:
            mark_parameters(model, config, topology.get_sequence_parallel_world_size())
        return initialized

    patch = set_attribute(deepspeed, "initialize", initialize, library="deepspeed")
    try:
        yield
    finally:
        patch.undo()


@contextlib.contextmanager
def _loaders_over_replicas(accelerator: Any, topology: Topology) -> Iterator[None]:
    """Inside: every ``DataLoader`` the Trainer prepares through ``accelerator`` is split over the ``D`` data-parallel
    replicas, not over accelerate's processes, so the ranks of a sequence-parallel group load the same batches.

    The loader goes through accelerate's public ``prepare_data_loader`` with ``num_processes=D`` and
    ``process_index`` the replica (batch ``i`` of replica ``d`` is batch ``i·D + d`` of the sampler, as accelerate
    splits a job's batches over its processes), with the accelerator's own settings (device placement, seedable
    sampler, ``even_batches``, ``split_batches``, RNG synchronisation). What accelerate counts as its processes does
    not enter (every rank on a GPU job or with ``use_cpu=True``; one process with ``use_cpu`` unset on a CPU, which
    :func:`_on_every_rank` turns into ``use_cpu=True``). Each rank loads (``dispatch_batches`` would send rank 0's
    batches over every rank, split per rank).
    """
    from accelerate.data_loader import prepare_data_loader

    replicas, replica = topology.get_data_parallel_world_size(), topology.get_data_parallel_rank()

    def prepare(data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None) -> Any:
        return prepare_data_loader(
            data_loader, accelerator.device, num_processes=replicas, process_index=replica,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement if device_placement is None else device_placement,
            rng_types=list(accelerator.rng_types), dispatch_batches=False, even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )  # fmt: skip

    # accelerator.prepare calls it for every DataLoader; undone: the class's method again
    patch = set_attribute(accelerator, "prepare_data_loader", prepare, library="accelerate")
    try:
        yield
    finally:
        patch.undo()


class _DataParallelGather:
    """The Trainer's ``gather_function`` during sequence-parallel evaluation: every tensor gathered over the
    data-parallel replicas (the ranks of a group hold the same), the padding of the last batches dropped as
    accelerate's ``gather_for_metrics`` drops it."""

    def __init__(self, trainer: SequenceParallelTrainer) -> None:
        self.trainer = trainer
        self.topology = trainer.topology

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self.topology.data_parallel_group
        ranks = group_members(group)
        flat = tensor.contiguous()
        parts = all_gather(flat.reshape(-1), ranks, group=group, op="gather_for_metrics",
                           timeout_s=self.topology.timeout_s)  # fmt: skip
        gathered = torch.cat([p.view(flat.shape) for p in parts])
        state = self.trainer.accelerator.gradient_state  # its remainder counts the D replicas the loader splits over
        if state.end_of_dataloader and state.remainder > 0:
            gathered = gathered[: state.remainder]
        return gathered
