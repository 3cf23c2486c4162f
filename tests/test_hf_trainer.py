"""transformers' Trainer, sequence parallel from the ds_config alone: ``SequenceParallelTrainer``.

On gloo ranks (a tiny fp32 Llama, SGD, constant learning rate, no clipping; batches in order):

- 3 optimizer steps equal the README's hand-written ds_ring loop (``ds_ring.initialize``,
  ``register_with_transformers``, ``shard_batch``, ``causal_lm_loss``) on the same data: ZeRO 2 and 3 at 2 ranks,
  packed batches from ``DataCollatorWithFlattening``, gradient accumulation 2, the long_context tiles (ZeRO 3;
  fp32 tolerance), and 2 data × 2 sequence-parallel ranks at 4 (each replica its own batches);
- ``evaluate()`` (sequence parallel) gives the whole model's loss; ``disable_in_eval`` the same on whole sequences;
  ``predict()`` the whole model's logits; the tokens logged count each sequence once; ``save_model`` writes a
  checkpoint ``from_pretrained`` reads back;
- refused with a ValueError naming both sides, before training: a section that does not fit the job (its degrees,
  the model's heads), a ``parallelism_config`` that also asks for sequence parallelism, and what would be ignored
  or split the groups' batches (``compute_loss_func``, label smoothing, ``batch_rebalance``).
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from ds_ring.tiles.zero import gathered
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.hf_cases import VOCAB, full_batch, llama, shifted

STEPS, BATCH, SEQ = 3, 2, 32


def _ds_config(stage: int, sequence_parallel: int = 2, **section) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "ring_attention": {"strategy": "ring", "sequence_parallel_size": sequence_parallel, "timeout_s": 60, **section},
    }  # fmt: skip


def _samples(n: int, packed: bool = False) -> list[dict]:
    """``n`` samples; packed: documents of 3 lengths (``DataCollatorWithFlattening`` packs them)."""
    samples = []
    for s in range(n):
        ids = full_batch(seed=s)["input_ids"][0]
        if packed:
            ids = ids[: (10, 12, 16)[s % 3]]
        samples.append({"input_ids": ids.tolist() if packed else ids, "labels": ids.tolist() if packed else ids})
    return samples


def _collator(packed: bool):
    if packed:
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening(return_position_ids=True)
    from transformers import default_data_collator

    return default_data_collator


def _trainer(config: dict, data, packed: bool, output: str, eval_data=None, accumulation: int = 1,
             use_cpu: bool = True, **trainer_kwargs):  # fmt: skip
    """``use_cpu=False``: ``TrainingArguments`` without ``use_cpu``, as a GPU job builds them."""
    from transformers import TrainingArguments

    from ds_ring.integrations.hf import SequenceParallelTrainer

    class InOrder(SequenceParallelTrainer):  # the hand-written loop's order (the Trainer shuffles by default)
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = llama(torch.float32)
    args = TrainingArguments(
        output_dir=output, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH, max_steps=STEPS,
        gradient_accumulation_steps=accumulation,
        learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, deepspeed=config, report_to=[],
        save_strategy="no", include_num_input_tokens_seen="all", remove_unused_columns=False,
        optim="sgd",  # under DeepSpeed the Trainer builds it from the args (5.0 ignores optim_args for SGD)
        **({"use_cpu": True} if use_cpu else {}),
    )  # fmt: skip
    return InOrder(model=model, args=args, train_dataset=data, eval_dataset=eval_data,
                   data_collator=_collator(packed), **trainer_kwargs)  # fmt: skip


def _parameters(engine) -> list[torch.Tensor]:

    params = list(engine.module.parameters())
    with gathered(params):
        return [copy.deepcopy(p.detach()) for p in params]


def _hand_written(config: dict, data: list[dict], packed: bool, accumulation: int = 1) -> list[torch.Tensor]:
    """The README's loop: ds_ring.initialize, register, shard_batch, causal_lm_loss; this replica's batches."""
    import ds_ring
    from ds_ring.integrations.hf import causal_lm_loss, register_with_transformers, shard_batch

    section = {k: v for k, v in config["ring_attention"].items() if k != "long_context"}  # the untiled model
    ds_config = {**config, "train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": accumulation,
                 "gradient_clipping": 0.0, "ring_attention": section}  # fmt: skip
    ds_config.pop("train_batch_size")
    model = llama(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config={**ds_config, "ring_attention": section})
    session = register_with_transformers(model, config=ds_config, topology=engine.mpu)
    topology = session.topology
    replicas, replica = topology.get_data_parallel_world_size(), topology.get_data_parallel_rank()
    collate = _collator(packed)
    try:
        for micro_step in range(STEPS * accumulation):  # the engine steps the optimizer every `accumulation`
            first = (micro_step * replicas + replica) * BATCH
            batch = shard_batch(session, collate(data[first : first + BATCH]))
            labels = batch.pop("shift_labels")
            engine.backward(causal_lm_loss(session, engine(**batch).logits, labels))
            engine.step()
    finally:
        session.close()
    got = _parameters(engine)
    engine.destroy()
    return got


def _check_saved(trainer, got: list[torch.Tensor], directory: str) -> None:
    """``save_model`` writes an ordinary HF checkpoint: ``from_pretrained`` reads back the trained parameters."""
    from transformers import LlamaForCausalLM

    trainer.save_model(directory)
    if not trainer.is_world_process_zero():  # rank 0 writes it (each rank has its own temporary directory)
        return
    loaded = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    _assert_parameters(list(loaded.parameters()), got)


def _assert_parameters(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _rank(rank: int, world: int) -> list[str]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    with tempfile.TemporaryDirectory() as output:
        tiled = {"long_context": {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": 6}}
        cases = [("zero 2", 2, False, {}, 1), ("zero 3", 3, False, {}, 1), ("zero 2, packed", 2, True, {}, 1),
                 ("zero 3, long_context tiles", 3, False, tiled, 1),
                 ("zero 2, gradient accumulation 2", 2, False, {}, 2)] if world == 2 else [
            ("2 data x 2 sequence, zero 2", 2, False, {}, 1)]  # fmt: skip
        for name, stage, packed, section, accumulation in cases:
            with log.case(f"3 steps = the hand-written loop: {name}"):
                config = _ds_config(stage, **section)
                samples = STEPS * accumulation * BATCH * (world // 2)
                data = _samples(samples + BATCH, packed)
                trainer = _trainer(config, data, packed, output, accumulation=accumulation)
                try:
                    trainer.train()
                    got = _parameters(trainer.model_wrapped)
                    seen = trainer.state.num_input_tokens_seen
                    if stage == 2 and not packed and not section and accumulation == 1:
                        _check_saved(trainer, got, os.path.join(output, "saved"))
                finally:
                    trainer.close()
                want_tokens = sum(len(sample["input_ids"]) for sample in data[:samples])
                assert seen == want_tokens, (seen, want_tokens)
                _assert_parameters(got, _hand_written(config, data, packed, accumulation))
        if world == 2:
            _check_evaluation(log, output)
            _check_refusals(log, output)
    return log.failures


def _whole_model_loss(batches: list[dict]) -> float:
    """The mean over batches of the unsharded model's mean token loss (what the Trainer's eval_loss is)."""
    model = llama(torch.float32)
    losses = []
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"]).logits
            losses.append(F.cross_entropy(logits.flatten(0, 1), shifted(batch["labels"]).flatten(), ignore_index=-100))
    return torch.stack(losses).mean().item()


def _check_evaluation(log: CaseLog, output: str) -> None:
    """Before any training the Trainer runs inference under DeepSpeed at ZeRO 3 only (transformers' rule)."""
    data = _samples(2 * BATCH)
    batches = [_collator(False)(data[i : i + BATCH]) for i in range(0, len(data), BATCH)]
    want = _whole_model_loss(batches)
    for disable_in_eval in (False, True):
        with log.case(f"evaluate() = the whole model's loss (disable_in_eval={disable_in_eval})"):
            trainer = _trainer(_ds_config(3), data, False, output, eval_data=data, disable_in_eval=disable_in_eval)
            try:
                metrics = trainer.evaluate()
            finally:
                trainer.close()
            assert abs(metrics["eval_loss"] - want) < 1e-5 * abs(want), (metrics, want)
    with log.case("predict() = the whole model's logits"):
        trainer = _trainer(_ds_config(3), data, False, output)
        try:
            prediction = trainer.predict(data)
        finally:
            trainer.close()
        model = llama(torch.float32)
        with torch.no_grad():
            logits = torch.cat([model(input_ids=b["input_ids"]).logits for b in batches])
        torch.testing.assert_close(torch.as_tensor(prediction.predictions), logits, rtol=1e-5, atol=1e-5)
        assert prediction.predictions.shape == (len(data), SEQ, VOCAB)


def _check_refusals(log: CaseLog, output: str) -> None:
    from accelerate.parallelism_config import ParallelismConfig

    three_heads = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 3}
    ulysses = _ds_config(2) | {"ring_attention": {"strategy": "ulysses", "sequence_parallel_size": 2}}
    cases = [
        ("a section whose degrees do not fit the world", _ds_config(2, sequence_parallel=3), {},
         ["ring_attention", "2 ranks", "world size 2"]),
        ("a section whose heads do not split", ulysses, three_heads, ["num_attention_heads = 3", "ulysses"]),
    ]  # fmt: skip
    for name, config, overrides, needles in cases:
        with log.case(f"refuses {name}"):
            with pytest.raises(ValueError) as raised:
                _refused_trainer(config, overrides, output)
            for needle in needles:
                assert needle in str(raised.value), str(raised.value)
    losses = [
        ("a compute_loss_func (it would be ignored)", {"compute_loss_func": lambda *a, **k: None}, {},
         ["compute_loss_func", "sequence-parallel"]),
        ("label smoothing (it would be ignored)", {}, {"label_smoothing_factor": 0.1}, ["label_smoothing_factor"]),
    ]  # fmt: skip
    from transformers import TrainingArguments

    if "train_sampling_strategy" in TrainingArguments.__dataclass_fields__:  # not in transformers 5.0
        losses.append(("batches rebalanced over every rank", {}, {"train_sampling_strategy": "batch_rebalance"},
                       ["batch_rebalance", "same batches"]))  # fmt: skip
    for name, trainer_kwargs, arguments, needles in losses:
        with log.case(f"refuses {name}"):
            with pytest.raises(ValueError) as raised:
                _refused_trainer(_ds_config(2), {}, output, trainer_kwargs, **arguments)
            for needle in needles:
                assert needle in str(raised.value), str(raised.value)
    alst = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    refused = pytest.raises(ValueError, match="parallelism_config.*ring_attention")
    with log.case("refuses a parallelism_config asking for ALST's sequence parallelism too"), refused:
        _refused_trainer(_ds_config(2), {}, output, parallelism_config=alst)


def _refused_trainer(config: dict, overrides: dict, output: str, trainer_kwargs: dict | None = None, **arguments):
    from transformers import TrainingArguments

    from ds_ring.integrations.hf import SequenceParallelTrainer

    args = TrainingArguments(output_dir=output, deepspeed=config, report_to=[], use_cpu=True, max_steps=1, **arguments)
    SequenceParallelTrainer(model=llama(torch.float32, **overrides), args=args, train_dataset=_samples(2),
                            **(trainer_kwargs or {}))  # fmt: skip


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: CI's second step (time)
def test_sequence_parallel_trainer(world: int) -> None:
    assert_no_failures(run_distributed(_rank, world, timeout=360))
