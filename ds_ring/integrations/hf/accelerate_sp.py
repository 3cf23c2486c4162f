"""accelerate's sequence parallelism (``ParallelismConfig(sp_size=N, sp_backend="deepspeed")``) run by ds_ring.

transformers' ``Trainer`` and TRL's trainers turn on sequence parallelism through accelerate: ``Accelerator.prepare``
imports DeepSpeed ALST's ``UlyssesSPAttentionHF`` and ``UlyssesSPDataLoaderAdapter`` by their module path
(``deepspeed.runtime.sequence_parallel.ulysses_sp``) and the Trainer computes the loss of a shard with
``transformers.trainer.deepspeed_sp_compute_loss``. None of the three libraries offers another extension point for
them, so :func:`apply_to_accelerate` replaces exactly those names where accelerate and the Trainer look them up, and
accelerate's ``PartialState._prepare_backend``, with dispatchers that call what they replaced unless the ds_config has
an enabled section (one hook, version-checked by :func:`check_hooked_libraries`, undone by the handle):

- **registration**: when the ds_config the ``Accelerator`` holds has an enabled ``ring_attention`` section, ds_ring's
  drop-in (:class:`~ds_ring.integrations.hf.alst.UlyssesSPAttentionHF`) registers with that ds_config: every strategy,
  dense or dilated, windows, sinks, ``long_context`` (applied to the model accelerate prepares). Without a section,
  DeepSpeed's own class: ALST, unchanged.
- **the loader adapter**: for a ds_ring registration, ds_ring's adapter (each rank's batch gathered and run whole in
  turn, as ALST's; packed documents, TRL's padding-free batches and lengths that do not split into the shards: padded
  with label -100); otherwise DeepSpeed's.
- **the loss**: for a ds_ring registration each shard's loss (the model's own, or TRL's fused LM head's) weighted by
  its counted tokens and divided by the counted tokens of the whole gradient-accumulation window over every rank, as
  one process divides by ``num_items_in_batch``; each rank's gradient its tokens' share, scaled for the engine (the
  session's gradient scale). transformers' instead back-propagates the whole group's loss on every rank through a
  differentiable all-gather: ``sp ×`` the gradient at ZeRO 0-2.
- **counting ranks on a CPU**: transformers builds a DeepSpeed job's ``PartialState`` without a backend
  (``ddp_backend`` is dropped when ``deepspeed`` is set); on a machine without an accelerator accelerate then finds
  none and counts one process on every rank (all of them process 0, every rank loading the same samples). While
  applied, ``PartialState._prepare_backend`` names ``gloo`` for such a DeepSpeed job (DeepSpeed starts
  ``torch.distributed`` with it, as it does on a CPU anyway), so accelerate counts every rank as it does on a GPU;
  arguments built before :func:`apply_to_accelerate` are refused at registration, naming the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.integrations.hf.session import SequenceParallelSession
from ds_ring.integrations.internal import SECTION, Patch, process, set_attribute, undo_all

__all__ = ["AccelerateHandle", "apply_to_accelerate", "check_hooked_libraries", "TESTED"]

ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"
LOSS_MODULE = "transformers.trainer"
LOSS_NAME = "deepspeed_sp_compute_loss"

LIBRARIES = ("deepspeed", "deepspeed", "transformers", "accelerate")
"""Whose object each replacement of :func:`apply_to_accelerate` changes (:mod:`ds_ring.engine.patches` checks the
release)."""

TESTED = {"accelerate": ("1.15.0", "1.15.0"), "transformers": ("5.24.0", "5.24.0")}
"""The releases the hook was tested on (the newest pinned, launch/newest-constraints.txt, and the main venv). The
lowest declared releases cannot run accelerate's sequence parallelism at all: DeepSpeed 0.16 has no ALST module, and
transformers 5.0 computes the loss in a ``Trainer`` method (``_deepspeed_sp_compute_loss``), not the module function
the hook replaces; :func:`check_hooked_libraries` refuses both, naming the library."""


@dataclass
class AccelerateHandle:
    """What :func:`apply_to_accelerate` replaced; :meth:`undo` puts it back (idempotent)."""

    replaced: list[Patch] = field(default_factory=list)
    session: SequenceParallelSession | None = None
    """The ds_ring registration made through accelerate's ``prepare`` (``None``: none, or ALST's)."""

    @property
    def applied(self) -> bool:
        return bool(self.replaced)

    def undo(self) -> None:
        """Put back DeepSpeed's classes, transformers' loss and accelerate's backend choice; close the registration."""
        undo_all(self.replaced)
        if self.session is not None:
            self.session.close()
            self.session = None
        if process().patches.get(HOOK) is self:
            del process().patches[HOOK]

    def __enter__(self) -> AccelerateHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


HOOK = "accelerate sequence parallelism"
"""The name the process's :class:`~ds_ring.comm.job.Job` keeps the applied hook's handle under."""


def apply_to_accelerate() -> AccelerateHandle:
    """Make accelerate's ``ParallelismConfig(sp_backend="deepspeed")`` run ds_ring where the ds_config has a section.

    Call once, before building ``TrainingArguments`` and the trainer (``Trainer``, TRL's ``SFTTrainer``, ...); the
    user's script is otherwise unchanged. A second call returns the same handle.

    Returns:
        The :class:`AccelerateHandle`; its ``undo()`` (or leaving it as a context manager) puts everything back.

    Raises:
        RuntimeError: accelerate or transformers no longer look the hooked names up where this hook replaces them
            (:func:`check_hooked_libraries`), naming the library, its version and the tested range.
    """
    if (applied := process().patches.get(HOOK)) is not None:
        return applied
    check_hooked_libraries()
    handle = AccelerateHandle()
    from accelerate.state import PartialState

    ulysses = importlib.import_module(ULYSSES_MODULE)
    trainer = importlib.import_module(LOSS_MODULE)
    originals = (ulysses.UlyssesSPAttentionHF, ulysses.UlyssesSPDataLoaderAdapter, getattr(trainer, LOSS_NAME),
                 PartialState.__dict__["_prepare_backend"])  # fmt: skip
    replacements = (
        (ulysses, "UlyssesSPAttentionHF", _attention_class(handle, originals[0])),
        (ulysses, "UlyssesSPDataLoaderAdapter", _adapter_class(handle, originals[1])),
        (trainer, LOSS_NAME, _compute_loss(handle, originals[2])),
        (PartialState, "_prepare_backend", _prepare_backend(originals[3])),
    )
    for (owner, name, replacement), library in zip(replacements, LIBRARIES, strict=True):
        handle.replaced.append(set_attribute(owner, name, replacement, library=library))
    process().patches[HOOK] = handle
    return handle


def check_hooked_libraries() -> None:
    """``RuntimeError`` unless accelerate and transformers look up the hooked names where the hook replaces them.

    Checked in their source: ``Accelerator._prepare_deepspeed`` and ``Accelerator.deepspeed_ulysses_dl_adapter`` import
    ``UlyssesSPAttentionHF`` / ``UlyssesSPDataLoaderAdapter`` from ``deepspeed.runtime.sequence_parallel.ulysses_sp``
    when they run, ``Trainer.compute_loss`` calls ``deepspeed_sp_compute_loss`` from its module's globals, and
    ``PartialState.__init__`` chooses its backend with ``self._prepare_backend(cpu, sagemaker_dp, backend)``.
    """
    import accelerate
    import deepspeed
    import transformers
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from transformers import Trainer

    def require(ok: bool, library: Any, what: str) -> None:
        if not ok:
            low, high = TESTED[library.__name__]
            raise RuntimeError(
                f"ds_ring.integrations.hf.apply_to_accelerate: {library.__name__} {library.__version__} no longer "
                f"{what}, which the hook replaces (tested on {library.__name__} {low} to {high}); use a release in "
                f"that range, or ds_ring's SequenceParallelTrainer"
            )

    if importlib.util.find_spec(ULYSSES_MODULE.rsplit(".", 1)[0]) is None:
        raise RuntimeError(
            f"ds_ring.integrations.hf.apply_to_accelerate: DeepSpeed {deepspeed.__version__} has no ALST "
            f"({ULYSSES_MODULE}), which accelerate's sequence parallelism imports; install a DeepSpeed release with "
            f"it (tested: 0.19.8), or use ds_ring's SequenceParallelTrainer"
        )
    prepare, adapter = (
        inspect.getsource(Accelerator._prepare_deepspeed),
        inspect.getsource(Accelerator.deepspeed_ulysses_dl_adapter),
    )
    require(
        f"from {ULYSSES_MODULE} import" in prepare and "UlyssesSPAttentionHF" in prepare,
        accelerate,
        f"imports UlyssesSPAttentionHF from {ULYSSES_MODULE} in Accelerator._prepare_deepspeed",
    )
    require(
        f"from {ULYSSES_MODULE} import UlyssesSPDataLoaderAdapter" in adapter,
        accelerate,
        f"imports UlyssesSPDataLoaderAdapter from {ULYSSES_MODULE} in Accelerator.deepspeed_ulysses_dl_adapter",
    )
    trainer_module = importlib.import_module(LOSS_MODULE)
    compute_loss = inspect.getsource(Trainer.compute_loss)
    require(
        callable(getattr(trainer_module, LOSS_NAME, None)) and f"{LOSS_NAME}(" in compute_loss,
        transformers,
        f"calls {LOSS_NAME} of {LOSS_MODULE} in Trainer.compute_loss",
    )
    backend = getattr(PartialState, "_prepare_backend", None)
    require(
        backend is not None
        and list(inspect.signature(backend).parameters) == ["self", "cpu", "sagemaker_dp", "backend"]
        and "self._prepare_backend(" in inspect.getsource(PartialState.__init__),
        accelerate,
        "chooses PartialState's backend with PartialState._prepare_backend(cpu, sagemaker_dp, backend)",
    )


def _prepare_backend(original: Callable[..., Any]) -> Callable[..., Any]:
    """accelerate's backend choice, with ``gloo`` where a launched DeepSpeed job on a machine without an accelerator
    would get none (and so be counted as one process on every rank)."""

    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        deepspeed_job = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
        if chosen is None and not cpu and deepspeed_job and launched and not torch.cuda.is_available():
            chosen = "gloo"
        return chosen, distributed_type

    return prepare_backend


def _accelerator_ds_config() -> Mapping[str, Any] | None:
    """The ds_config of the ``Accelerator`` being prepared (accelerate's shared state), or ``None``."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return None
    plugin = AcceleratorState().deepspeed_plugin
    return None if plugin is None else plugin.deepspeed_config


def _section_enabled(ds_config: Mapping[str, Any] | None) -> bool:
    section = None if ds_config is None else ds_config.get(SECTION)
    return isinstance(section, Mapping) and section.get("enabled", True) is not False


def _refuse_uncounted_ranks() -> None:
    """``ValueError`` naming the fix, before any communication, when accelerate counts fewer processes than ranks."""
    from accelerate.state import AcceleratorState

    counted, world = AcceleratorState().num_processes, dist.get_world_size() if dist.is_initialized() else 1
    if counted != world:
        raise ValueError(
            f"apply_to_accelerate: accelerate counts {counted} process(es) in a job of {world} ranks (on a machine "
            f"without an accelerator, TrainingArguments built before apply_to_accelerate() leave DeepSpeed's ranks "
            f"uncounted: every rank is process 0 and loads the same samples); call "
            f"ds_ring.integrations.hf.apply_to_accelerate() before TrainingArguments(...)"
        )


def _attention_class(handle: AccelerateHandle, original: type) -> type:
    """DeepSpeed's ``UlyssesSPAttentionHF`` where the ds_config has no section; ds_ring's drop-in where it has one."""
    from ds_ring.integrations.hf import alst

    class UlyssesSPAttentionHF(original):  # type: ignore[misc, valid-type]
        @classmethod
        def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str | None = None,
                                       sequence_parallel_size: int = 1, micro_batch_size: int = 1,
                                       seq_length: int | None = None, seq_length_is_variable: bool = True,
                                       disable_in_eval: bool = False, **kwargs: Any) -> Any:  # fmt: skip
            # disable_in_eval is named: accelerate passes it (True: the Trainer evaluates whole sequences) when the
            # signature has it
            ds_config = _accelerator_ds_config()
            if not _section_enabled(ds_config):
                if "disable_in_eval" in inspect.signature(original.register_with_transformers).parameters:
                    kwargs["disable_in_eval"] = disable_in_eval
                return original.register_with_transformers(
                    model_name_or_path=model_name_or_path, core_attn_implementation=core_attn_implementation,
                    sequence_parallel_size=sequence_parallel_size, micro_batch_size=micro_batch_size,
                    seq_length=seq_length, seq_length_is_variable=seq_length_is_variable, **kwargs,
                )  # fmt: skip
            _refuse_uncounted_ranks()
            if core_attn_implementation is None:  # accelerate's default: the model's own implementation
                core_attn_implementation = _attn_implementation(model_name_or_path)
            if handle.session is not None:
                handle.session.close()
                handle.session = None
            mpu = alst.UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path, core_attn_implementation, sequence_parallel_size, micro_batch_size,
                seq_length=seq_length, seq_length_is_variable=seq_length_is_variable, disable_in_eval=disable_in_eval,
                config=dict(ds_config), **kwargs,
            )  # fmt: skip
            handle.session = next(
                (s for s in alst.installed_sessions() if s.topology is mpu), None
            )  # what the drop-in installed
            return mpu

    return UlyssesSPAttentionHF


def _attn_implementation(model: Any) -> str:
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    return name if isinstance(name, str) else "sdpa"


def _adapter_class(handle: AccelerateHandle, original: type) -> Callable[..., Any]:
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter``, or ds_ring's for the group of the ds_ring registration."""
    from ds_ring.integrations.hf import alst

    def UlyssesSPDataLoaderAdapter(dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> Any:  # noqa: N802
        session = handle.session
        if session is None or not session.installed or session.topology.sequence_parallel_group is not sp_group:
            return original(dl, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size, device=device)
        steps = (_accelerator_ds_config() or {}).get("gradient_accumulation_steps", 1)
        return _windowed(alst.UlyssesSPDataLoaderAdapter)(
            dl,
            sp_rank,
            sp_group,
            sp_world_size,
            device,
            session=session,
            pad_to_multiple=True,
            accumulation_steps=steps if isinstance(steps, int) else 1,
        )

    return UlyssesSPDataLoaderAdapter


WINDOW_KEY = "ds_ring_accumulation_window"
"""The key of the adapter's batches under which the hook hands the loss its accumulation window (popped there)."""


@dataclass(eq=False)
class _Window:
    """One gradient-accumulation window of this rank: the counted tokens of the micro-batches it yielded."""

    counted: int = 0
    batches: int = 0
    total: float | None = None
    """The counted tokens of the window over every rank (its shards, the data-parallel replicas): at its first loss."""


def _windowed(adapter: type) -> type:
    """ds_ring's adapter, each yielded micro-batch carrying its accumulation window (:data:`WINDOW_KEY`)."""

    class WindowedAdapter(adapter):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, accumulation_steps: int, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.accumulation_steps = accumulation_steps

        def __iter__(self) -> Iterator[dict[str, Any]]:
            window = _Window()
            for index, batch in enumerate(super().__iter__()):
                if index % self.accumulation_steps == 0:  # the Trainer's windows: from the start of each epoch
                    window = _Window()
                window.counted += int((batch["shift_labels"] != -100).sum())
                window.batches += 1
                yield {**batch, WINDOW_KEY: window}

    return WindowedAdapter


def _compute_loss(handle: AccelerateHandle, original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``deepspeed_sp_compute_loss``, or ds_ring's window mean for the ds_ring registration.

    One process (the Trainer, TRL) divides the loss's token sum by the counted tokens of the whole accumulation window
    (``num_items_in_batch``, over every data-parallel process). Here: this micro-batch's sum over the sequence group,
    divided by the window's counted tokens over every rank (summed once per window, when the Trainer has fetched the
    whole window), times the window's micro-batches (the Trainer divides a sequence-parallel loss by them) and the
    data-parallel replicas (the engine averages over them). Each rank's gradient is its tokens' share, scaled for the
    engine (the session's gradient scale); ``return_outputs`` as transformers'.
    """
    from ds_ring.integrations.internal import all_reduce

    def deepspeed_sp_compute_loss(accelerator: Any, model: Any, inputs: dict[str, Any], return_outputs: bool,
                                  pc: Any) -> Any:  # fmt: skip
        session = handle.session
        window = inputs.pop(WINDOW_KEY, None)
        if session is None or not session.installed:
            return original(accelerator, model, inputs, return_outputs, pc)
        if "labels" not in inputs and "shift_labels" in inputs:  # as transformers: the model computes its loss
            inputs["labels"] = inputs["shift_labels"]
        outputs = model(**inputs)
        shard_mean = outputs.loss  # the mean over this shard's counted tokens (the model's loss or TRL's fused head)
        counted = (inputs["shift_labels"] != -100).sum()
        # a shard without counted tokens (a prompt's) has the mean nan (0 / 0): its sum is 0, its gradient none
        shard_sum = torch.where(counted > 0, shard_mean, torch.zeros_like(shard_mean)) * counted
        topology = session.topology
        if window is None:  # a batch of another loader than the hook's adapter: a window of its own
            window = _Window(counted=int(counted), batches=1)
        if window.total is None:
            counts = torch.tensor([float(window.counted)], dtype=torch.float64)
            window.total = float(all_reduce(counts, group=topology.control_group(None), op="accumulation_window",
                                            timeout_s=topology.timeout_s)[0])  # fmt: skip
        group_sum = all_reduce(shard_sum.detach(), group=topology.sequence_parallel_group, op="window_loss",
                               timeout_s=topology.timeout_s)  # fmt: skip
        factor = window.batches * topology.get_data_parallel_world_size() / max(window.total, 1.0)
        # the value: the group's share of the window mean; the gradient: this rank's tokens' share, scaled for the
        # engine (the model's loss was called with labels set: transformers' own, unscaled)
        share = shard_sum * (factor * session.gradient_scale)
        loss = share + (group_sum * factor - share).detach()
        return (loss, outputs) if return_outputs else loss

    return deepspeed_sp_compute_loss
