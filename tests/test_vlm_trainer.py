"""Vision-language models through the Trainer: ``SequenceParallelTrainer`` and ``apply_to_accelerate`` + ``Trainer``.

On 2 gloo ranks (ring, ZeRO 2, SGD at a constant learning rate, no clipping, batches in order), tiny float64 models of
the VLM zoo (:mod:`tests.vlm_zoo`: random weights, two images per row, one across the shard boundary) train 3
optimizer steps from multimodal batches as the family's processor makes them; the parameters, the vision tower's
included, equal those of one process training the whole model on the same batches:

- Qwen2-VL (MRoPE ids from ``image_grid_thw``, ``mm_token_type_ids``; the vision encoder's frames divided) and
  Gemma 3 (``token_type_ids``: bidirectional image spans), each under ``SequenceParallelTrainer`` (every rank of the
  group loads the same batch) and under ``apply_to_accelerate()`` with transformers' ``Trainer`` and
  ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")`` (each rank loads its own batch, the group runs each);
- ``evaluate()`` after training gives one process's held-out loss: sequence parallel under ``SequenceParallelTrainer``,
  whole sequences, each rank its own batch, under accelerate's path (its registration's ``disable_in_eval``: the
  vision encoder's frames are then not divided, transformers' masks built);
- a batch key the model does not take (a processor output the family has no input for) is refused by name.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from typing import Any

import pytest
import torch

from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.vlm_zoo import VOCAB, batch, build, reference
from tests.zoo import Float64Throughout

STEPS, LR = 3, 0.2
FAMILIES = ("qwen2_vl", "gemma3")
TOLERANCE = 1e-5
"""Relative to each parameter's largest update: with sequence parallelism DeepSpeed's ZeRO 1/2 all-reduce the
gradients in float32 (``stage_1_and_2``: ``communication_data_type = torch.float32`` when ``sequence_parallel_size >
1``; ZeRO 0 refuses float64 gradients), so the float64 model's updates carry float32 rounding (measured: 7e-8 for
Qwen2-VL, 2.4e-7 for Gemma 3); a gradient off by any share of a rank is off by far more."""


def _ds_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "ring_attention": {"strategy": "ring", "sequence_parallel_size": 2, "timeout_s": 120},
    }  # fmt: skip


def _batches(family: str, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` full batches of the family (the zoo's, with other text tokens and images in each)."""
    base = batch(family, build(family))
    made = []
    for step in range(count):
        generator = torch.Generator().manual_seed(100 + step)
        text = base["input_ids"] >= 8
        tokens = torch.randint(8, VOCAB, base["input_ids"].shape, generator=generator)
        full = {k: v.clone() for k, v in base.items()}
        full["input_ids"] = torch.where(text, tokens, base["input_ids"])
        full["labels"] = torch.where(text, tokens, base["labels"])
        full["pixel_values"] = base["pixel_values"] + 0.5 * step
        made.append(full)
    return made


def one_batch(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The collator: each dataset item is already a whole multimodal batch (as a processor makes it)."""
    (item,) = items
    return dict(item)


def _one_process(family: str, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole model (``eager``) trained on ``batches`` in order by SGD: its parameters after."""
    model = build(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with Float64Throughout():
        for full in batches:
            reference(model, full)
            optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _arguments(output: str, **extra: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output, per_device_train_batch_size=1, per_device_eval_batch_size=1, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, optim="sgd",
        deepspeed=_ds_config(), report_to=[], save_strategy="no", remove_unused_columns=False,
        dataloader_drop_last=True, use_cpu=True, **extra,
    )  # fmt: skip


def _in_order(base: type) -> type:
    class InOrder(base):  # the reference's order (the Trainer shuffles by default)
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def _trained(trainer: Any, held_out: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], float]:
    """The parameters after ``trainer.train()`` and ``evaluate()``'s loss on the ``held_out`` batches after it."""
    with Float64Throughout():
        trainer.train()
        loss = trainer.evaluate(eval_dataset=held_out)["eval_loss"]
    return {n: p.detach().clone() for n, p in trainer.model_wrapped.module.named_parameters()}, loss


def _sequence_parallel_trainer(family: str, batches: list[dict], held_out: list, output: str) -> tuple[dict, float]:
    from ds_ring.integrations.hf import SequenceParallelTrainer

    model = build(family)
    model.set_attn_implementation("sdpa")
    trainer = _in_order(SequenceParallelTrainer)(model=model, args=_arguments(output), train_dataset=batches,
                                                 data_collator=one_batch)  # fmt: skip
    try:
        return _trained(trainer, held_out)
    finally:
        trainer.close()


def _accelerate_trainer(family: str, batches: list[dict], held_out: list, output: str) -> tuple[dict, float]:
    """accelerate's sequence parallelism run by ds_ring (which registers with ``disable_in_eval=True``: ``evaluate``
    runs the whole model with transformers' masks)."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import Trainer

    from ds_ring.integrations.hf import apply_to_accelerate

    handle = apply_to_accelerate()
    try:
        model = build(family)
        model.set_attn_implementation("sdpa")
        args = _arguments(output, parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
        trainer = _in_order(Trainer)(model=model, args=args, train_dataset=batches, data_collator=one_batch)
        return _trained(trainer, held_out)
    finally:
        handle.undo()


def _held_out_loss(family: str, parameters: dict[str, torch.Tensor], held_out: list[dict[str, torch.Tensor]]) -> float:
    """The mean over the ``held_out`` batches of the whole model's token-mean loss with ``parameters`` (one process's
    after training): what the Trainer's ``eval_loss`` is."""
    model = build(family)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # tied ones (Gemma 3's head) once
            parameter.copy_(parameters[name])
    with torch.no_grad(), Float64Throughout():
        return sum(float(model(**full).loss) for full in held_out) / len(held_out)


def _assert_parameters(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                       initial: dict[str, torch.Tensor]) -> float:  # fmt: skip
    """Each parameter's update equals one process's to :data:`TOLERANCE` of that update's largest entry; the worst
    such relative error."""
    assert list(got) == list(want)
    worst = 0.0
    for name, expected in want.items():
        update = float((expected - initial[name]).abs().max())
        error = float((got[name] - expected).abs().max())
        assert error <= TOLERANCE * update + 1e-15, (name, error, update)  # 1e-15: parameters that barely move
        worst = max(worst, error / update if update > 1e-12 else 0.0)  # rounding-level updates: the floor above
    moved = [name for name, expected in want.items() if bool((expected != initial[name]).any())]
    assert len(moved) > len(want) // 2, moved  # training moved the parameters: the comparison means something
    vision = [name for name in moved if "visual" in name or "vision_tower" in name]
    assert len(vision) > 4, moved  # the vision tower's among them
    return worst


def _refuses_unknown_inputs(family: str, batches: list[dict], output: str) -> None:
    """A key the model's forward does not take (Qwen's ``image_grid_thw`` given to Gemma 3): refused by name, on
    the first step, before any exchange."""
    from ds_ring.integrations.hf import SequenceParallelTrainer

    model = build(family)
    model.set_attn_implementation("sdpa")
    extra = [{**b, "image_grid_thw": torch.tensor([[1, 4, 4]] * 4)} for b in batches]
    trainer = _in_order(SequenceParallelTrainer)(model=model, args=_arguments(output), train_dataset=extra,
                                                 data_collator=one_batch)  # fmt: skip
    try:
        with pytest.raises(ValueError, match="'image_grid_thw' is not an input of Gemma3ForConditionalGeneration"):
            trainer.train()
    finally:
        trainer.close()


def _rank(rank: int, world: int) -> list[str]:
    import transformers

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    log = CaseLog()
    with tempfile.TemporaryDirectory() as output:
        for family in FAMILIES:
            made = _batches(family, STEPS + 3)
            batches, held_out = made[: STEPS + 1], made[STEPS + 1 :]
            start = time.perf_counter()
            want = _one_process(family, batches[:STEPS])
            want_loss = _held_out_loss(family, want, held_out)
            initial = dict(build(family).named_parameters())
            print(f"{family}: one process {time.perf_counter() - start:.1f} s")
            for name, train in (("SequenceParallelTrainer", _sequence_parallel_trainer),
                                ("apply_to_accelerate + Trainer", _accelerate_trainer)):  # fmt: skip
                with log.case(f"{family}: {name}, 3 steps and evaluate() = one process"):
                    start = time.perf_counter()
                    got, loss = train(family, batches, held_out, output)
                    worst = _assert_parameters(got, want, initial)
                    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss), (loss, want_loss)
                    seconds = time.perf_counter() - start
                    print(f"{family}: {name}: worst update error {worst:.1e} relative, held-out loss {loss:.10f} "
                          f"(one process {want_loss:.10f}), {seconds:.1f} s")  # fmt: skip
        with log.case("gemma3: a key the model does not take is refused by name"):
            _refuses_unknown_inputs("gemma3", _batches("gemma3", 2), output)
    return log.failures


@pytest.mark.slow  # 84 s at a load of 13-15 (DeepSpeed's start on each rank): CI's second step
@pytest.mark.timeout(600)
def test_vlm_trains_through_the_trainer_like_one_process() -> None:
    assert_no_failures(run_distributed(_rank, 2, timeout=560))
