"""``apply_to_accelerate``: the hook itself, in one process (the trainings it enables: ``test_hf_accelerate_sp.py``).

- the libraries it hooks still look the hooked names up where it replaces them (``check_hooked_libraries``: this test
  fails, naming the library, when accelerate or transformers change that), and a changed library is refused loudly;
- applied: DeepSpeed's ALST classes, transformers' sequence-parallel loss and accelerate's backend choice are the
  dispatchers; a second call returns the same handle; ``undo()`` puts back exactly what was there, twice is a no-op;
- without a ``ring_attention`` section (or without a ds_config) every dispatcher calls what it replaced: ALST as before;
- on a machine without an accelerator a launched DeepSpeed job gets ``gloo`` (its ranks counted), nothing else does;
- refused before any communication, naming the fix: arguments whose ranks accelerate counted as one process;
- the adapter hands each micro-batch the gradient-accumulation window it belongs to (the Trainer's windows), whose
  counted tokens normalise the loss as one process does.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from ds_ring.comm.job import process
from ds_ring.integrations.hf import accelerate_sp
from ds_ring.integrations.hf.accelerate_sp import apply_to_accelerate, check_hooked_libraries


def _deepspeed_has_alst() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed.runtime.sequence_parallel") is not None


pytestmark = pytest.mark.skipif(
    not _deepspeed_has_alst(),
    reason="DeepSpeed without ALST (the lowest declared, 0.16): accelerate's sequence parallelism cannot run",
)


def _hooked() -> list[object]:
    from accelerate.state import PartialState

    ulysses = importlib.import_module(accelerate_sp.ULYSSES_MODULE)
    trainer = importlib.import_module(accelerate_sp.LOSS_MODULE)
    return [ulysses.UlyssesSPAttentionHF, ulysses.UlyssesSPDataLoaderAdapter, getattr(trainer, accelerate_sp.LOSS_NAME),
            PartialState.__dict__["_prepare_backend"]]  # fmt: skip


def test_the_hooked_libraries_look_the_names_up_where_the_hook_replaces_them() -> None:
    check_hooked_libraries()  # fails here, naming the library and the tested range, when one changes


def test_a_changed_library_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    def _prepare_deepspeed(self, *args):  # an accelerate that no longer imports ALST's classes by their path
        return args

    monkeypatch.setattr(Accelerator, "_prepare_deepspeed", _prepare_deepspeed)
    with pytest.raises(RuntimeError, match=r"accelerate 1\.\d+\.\d+ no longer imports UlyssesSPAttentionHF"):
        apply_to_accelerate()
    assert process().patches.get(accelerate_sp.HOOK) is None


def test_applied_idempotent_and_undone_exactly() -> None:
    before = _hooked()
    handle = apply_to_accelerate()
    try:
        assert apply_to_accelerate() is handle
        during = _hooked()
        assert all(a is not b for a, b in zip(before, during, strict=True))
    finally:
        handle.undo()
    assert all(a is b for a, b in zip(before, _hooked(), strict=True))
    handle.undo()
    assert all(a is b for a, b in zip(before, _hooked(), strict=True))
    with apply_to_accelerate() as again:  # a new handle after undo; a context manager too
        assert again is not handle
    assert all(a is b for a, b in zip(before, _hooked(), strict=True))


def test_without_a_section_every_dispatcher_calls_what_it_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class ALST:
        @classmethod
        def register_with_transformers(cls, **kwargs):
            calls.append(("register", kwargs["sequence_parallel_size"]))
            return "alst-mpu"

    def adapter(dl, sp_rank, sp_group, sp_world_size, device):
        calls.append(("adapter", sp_world_size))
        return dl

    def loss(accelerator, model, inputs, return_outputs, pc):
        calls.append(("loss", return_outputs))
        return 1.0

    handle = accelerate_sp.AccelerateHandle()
    for ds_config in (None, {"zero_optimization": {"stage": 2}}, {"ring_attention": {"enabled": False}}):
        monkeypatch.setattr(accelerate_sp, "_accelerator_ds_config", lambda ds_config=ds_config: ds_config)
        attention = accelerate_sp._attention_class(handle, ALST)
        assert attention.register_with_transformers(object(), "sdpa", 2, 1) == "alst-mpu"
    assert accelerate_sp._adapter_class(handle, adapter)([1], 0, None, 2, "cpu") == [1]
    assert accelerate_sp._compute_loss(handle, loss)(None, None, {}, False, None) == 1.0
    assert calls == [("register", 2)] * 3 + [("adapter", 2), ("loss", False)]
    assert handle.session is None


def test_a_launched_deepspeed_job_on_a_cpu_gets_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import DistributedType

    def original(self, cpu=False, sagemaker_dp=False, backend=None):
        return backend, DistributedType.NO

    prepare = accelerate_sp._prepare_backend(original)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert prepare(None) == ("gloo", DistributedType.NO)
    assert prepare(None, cpu=True) == (None, DistributedType.NO)  # use_cpu: accelerate's own choice
    assert prepare(None, backend="mpi") == ("mpi", DistributedType.NO)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert prepare(None) == (None, DistributedType.NO)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("LOCAL_RANK")
    assert prepare(None) == (None, DistributedType.NO)  # not launched: one process
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert prepare(None) == (None, DistributedType.NO)  # a GPU: accelerate's choice


def test_uncounted_ranks_refused_before_any_communication(monkeypatch: pytest.MonkeyPatch) -> None:
    class State:
        num_processes = 1

    monkeypatch.setattr("accelerate.state.AcceleratorState", lambda: State())
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"counts 1 process\(es\) in a job of 2 ranks.*before TrainingArguments"):
        accelerate_sp._refuse_uncounted_ranks()
    State.num_processes = 2
    accelerate_sp._refuse_uncounted_ranks()


def test_the_adapter_hands_each_micro_batch_its_accumulation_window() -> None:
    class Adapter:
        def __init__(self, batches):
            self.batches = batches

        def __iter__(self):
            return iter(self.batches)

    counted = [3, 0, 5, 2, 4]  # tokens not -100 in each micro-batch's shard
    batches = [{"shift_labels": torch.tensor([[1] * n + [-100] * (6 - n)])} for n in counted]
    got = list(accelerate_sp._windowed(Adapter)(batches, accumulation_steps=2))
    windows = [batch[accelerate_sp.WINDOW_KEY] for batch in got]
    assert windows[0] is windows[1] and windows[2] is windows[3] and windows[4] is not windows[3]
    assert [(w.counted, w.batches) for w in (windows[0], windows[2], windows[4])] == [(3, 2), (7, 2), (4, 1)]
