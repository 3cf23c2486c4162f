"""Fine-tune with TRL's ``SFTTrainer`` (or transformers' ``Trainer``) under accelerate's sequence parallelism, run by
ds_ring: the script a TRL user already has, plus one line, ``ds_ring.integrations.hf.apply_to_accelerate()``.

Sequence parallelism is turned on the way accelerate documents it: ``parallelism_config_sp_size`` in the accelerate
config (``launch/accelerate_sp.yaml``) or ``TrainingArguments(parallelism_config=ParallelismConfig(sp_size=2))``
(``--sp-size 2``); the strategy comes from the ``ring_attention`` section of the ds_config passed as
``TrainingArguments(deepspeed=...)`` (``ds_configs/sft_ring.json``: ring, ZeRO 2). A tiny random Llama with 3 heads
(which 2 Ulysses ranks cannot split: ALST refuses it), a word-level tokenizer built here (nothing downloaded), 16
prompt-completion pairs, packed (TRL's padding-free batches) with the loss on the completions only. 2 CPU ranks::

    accelerate launch --config_file launch/accelerate_sp.yaml launch/train_sft.py
    torchrun --nproc-per-node 2 launch/train_sft.py --sp-size 2

``--trainer trainer``: transformers' ``Trainer`` over tokenized rows of the same pairs instead; ``--lora``: a LoRA
adapter (PEFT's ``get_peft_model``; TRL's ``peft_config=``); ``--reference``: one process, no DeepSpeed, no sequence
parallelism (what the runs above must equal); ``--alst``: without the ds_ring line (DeepSpeed's ALST).
``--final-params PATH``: rank 0 saves the trained parameters (those with ``requires_grad``) there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python launch/train_sft.py` from a checkout
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: no detection warning

WORDS = 60


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default="ds_configs/sft_ring.json", help="ds_config path")
    p.add_argument("--trainer", choices=("sft", "trainer"), default="sft")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (r=4) instead of the whole model")
    p.add_argument("--sp-size", type=int, default=0, help="TrainingArguments(parallelism_config=...(sp_size=N))")
    p.add_argument("--heads", type=int, default=3, help="attention heads (3: more than ALST can split over 2 ranks)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--pad-to", type=int, default=None, help="SFTConfig(pad_to_multiple_of=N) (packed rows padded)")
    p.add_argument("--length", type=int, default=0, help="--trainer trainer: every row this long (0: as they come)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD's learning rate (a gradient ×2 shows)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="runs/sft")
    p.add_argument("--final-params", default=None)
    p.add_argument("--reference", action="store_true", help="one process: no DeepSpeed, no sequence parallelism")
    p.add_argument("--alst", action="store_true", help="leave ds_ring out: accelerate runs DeepSpeed's ALST")
    return p.parse_args(argv)


def build_tokenizer() -> Any:
    """A word-level tokenizer over ``<pad>``, ``<eos>`` and ``w0``..``w59`` (64 ids with 2 unused)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def build_model(seed: int, heads: int = 3) -> torch.nn.Module:
    """A random Llama: ``heads`` heads of 8 (as many K/V heads), 2 layers, hidden 24, vocab 64, fp32, sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads, head_dim=8, max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def pairs(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` prompt-completion pairs of random words (prompts of 4-17 words, completions of 3-10)."""
    rng = random.Random(seed)

    def words(low: int, high: int) -> str:
        return " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(low, high)))

    return [{"prompt": words(4, 17) + " ", "completion": words(3, 10)} for _ in range(count)]


def tokenized(rows: list[dict[str, str]], tokenizer: Any, length: int = 0) -> list[dict[str, list[int]]]:
    """Rows for transformers' ``Trainer``: prompt and completion ids, labels -100 over the prompt, ``position_ids``
    (ALST needs them); lengths vary (batch 1) and are even (ALST needs lengths that split in 2: a second ``<eos>``),
    or are all ``length`` (``<eos>`` added, or the completion cut: ALST's loader needs one length on every rank)."""
    out = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"])["input_ids"] + [tokenizer.eos_token_id]
        completion += [tokenizer.eos_token_id] * ((len(prompt) + len(completion)) % 2)
        if length:
            completion = (completion + [tokenizer.eos_token_id] * length)[: length - len(prompt)]
        ids = prompt + completion
        out.append(
            {"input_ids": ids, "labels": [-100] * len(prompt) + completion, "position_ids": list(range(len(ids)))}
        )
    return out


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # LoRA's A matrices: the same in every run
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def training_arguments(args: argparse.Namespace) -> dict[str, Any]:
    common: dict[str, Any] = dict(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=1, learning_rate=args.lr,
        gradient_accumulation_steps=args.accumulation,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, logging_steps=1,
        per_device_eval_batch_size=1, save_strategy="no", report_to=[], seed=args.seed,
        train_sampling_strategy="sequential", dataloader_drop_last=True, bf16=False,
    )  # fmt: skip
    if args.reference:
        return {**common, "use_cpu": True}
    common["deepspeed"] = json.loads(Path(args.deepspeed_config).read_text())
    if args.sp_size:
        from accelerate.parallelism_config import ParallelismConfig

        common["parallelism_config"] = ParallelismConfig(sp_size=args.sp_size, sp_backend="deepspeed")
    return common


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.reference and not args.alst:
        import ds_ring.integrations.hf

        ds_ring.integrations.hf.apply_to_accelerate()  # the one ds_ring line: before the arguments and the trainer
    import datasets

    tokenizer, model, rows = build_tokenizer(), build_model(args.seed, args.heads), pairs(args.samples, args.seed)
    held_out = pairs(4, args.seed + 1)
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**training_arguments(args), packing=True, max_length=48, completion_only_loss=True,
                           pad_to_multiple_of=args.pad_to)  # fmt: skip
        peft_config = None
        if args.lora:
            from peft import LoraConfig

            torch.manual_seed(1)
            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        trainer = SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                             eval_dataset=datasets.Dataset.from_list(held_out), processing_class=tokenizer,
                             peft_config=peft_config)  # fmt: skip
    else:
        from transformers import Trainer, TrainingArguments

        model = lora(model) if args.lora else model
        train, evaluation = (datasets.Dataset.from_list(tokenized(x, tokenizer, args.length)) for x in (rows, held_out))
        trainer = Trainer(model=model, args=TrainingArguments(**training_arguments(args)), train_dataset=train,
                          eval_dataset=evaluation)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    evaluated = trainer.evaluate()["eval_loss"]  # whole sequences, each rank its share of the held-out pairs
    trained = _gathered([p for p in trainer.model.parameters() if p.requires_grad])
    if trainer.is_world_process_zero():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(f"{args.trainer}{' + LoRA' if args.lora else ''}: {trainer.state.global_step} steps on {world} "
              f"rank(s) in {elapsed:.1f} s; loss per step: {', '.join(f'{x:.4f}' for x in losses)}; held-out loss "
              f"{evaluated:.6f}")  # fmt: skip
        if args.final_params:
            torch.save(trained, args.final_params)


def _gathered(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Copies of ``params``, whole: ZeRO 3 partitions them (gathered on every rank), other stages keep them whole."""
    if not any(hasattr(p, "ds_id") for p in params):
        return [p.detach().cpu().clone() for p in params]
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().cpu().clone() for p in params]


if __name__ == "__main__":
    main()
