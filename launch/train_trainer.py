"""The recall task of ``launch/train_hf.py`` through transformers' ``Trainer``: ``SequenceParallelTrainer``.

The lines a Trainer user changes are two: ``Trainer`` becomes ``SequenceParallelTrainer``, and the ds_config given
as ``TrainingArguments(deepspeed=...)`` gains a ``ring_attention`` section (``ds_configs/hf_trainer.json``).
Launch with any of (2 CPU ranks)::

    torchrun --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29633 launch/train_trainer.py
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/train_trainer.py
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        launch/train_trainer.py  # on a CPU machine too: --cpu would start one process

``use_cpu`` stays at its default (what a GPU job passes; on a CPU the job runs there all the same). ``--dataset
datasets`` gives the Trainer a ``datasets.Dataset`` of the same samples as the torch dataset (``--samples`` of them).
``--save-steps N`` checkpoints every N steps into ``--output-dir``; ``--resume`` continues from the last checkpoint
there (the Trainer's ``resume_from_checkpoint``). ``DS_RING_FAULT="kill:rank=R:step=S"`` SIGKILLs rank R when
step S begins, on a run started without ``--resume`` (the resume test).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python launch/train_trainer.py` from a checkout
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: no detection warning

from ds_ring.monitor import run_main  # noqa: E402
from launch.train import Fault, add_training_arguments  # noqa: E402
from launch.train_hf import RecallDataset, add_model_arguments, build_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default="ds_configs/hf_trainer.json", help="ds_config path")
    add_training_arguments(p, steps=60)
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=4, help="sequences per step per data-parallel replica")
    p.add_argument("--output-dir", default="runs/trainer")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    p.add_argument("--final-params", default=None, help="rank 0 saves the final parameters here (torch.save)")
    p.add_argument(
        "--dataset",
        choices=("torch", "datasets"),
        default="torch",
        help="the samples as a torch Dataset, or as a `datasets.Dataset` holding the same rows",
    )
    p.add_argument("--samples", type=int, default=10**6, help="samples in the dataset (the sampler's order)")
    return p.parse_args(argv)


def _dataset(args: argparse.Namespace) -> Any:
    """``--samples`` recall sequences of ``--seq`` tokens: the torch ``RecallDataset``, or a ``datasets.Dataset`` of
    the same rows (``input_ids`` and ``labels`` as int lists, which the Trainer's default collator stacks)."""
    dataset = RecallDataset(args.samples, args.seq, args.seed)
    if args.dataset == "torch":
        return dataset
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    rows = [dataset[i] for i in range(len(dataset))]
    table = pa.table({key: [row[key].tolist() for row in rows] for key in ("input_ids", "labels")})
    # a fingerprint given: Dataset.from_dict would hash the table with dill, which fails on pyarrow's MonthDayNano
    # type with the releases installed here (datasets 5.2, pyarrow 26, Python 3.11)
    return datasets.Dataset(InMemoryTable(table), fingerprint=f"recall-{args.samples}-{args.seq}-{args.seed}")


def _fault_callback(fault: Fault):
    from transformers import TrainerCallback

    class Strike(TrainerCallback):
        """SIGKILL this rank when step ``fault.step`` (1-based) begins."""

        def on_step_begin(self, args, state, control, **kwargs):
            if int(os.environ.get("RANK", "0")) == fault.rank and state.global_step + 1 == fault.step:
                os.kill(os.getpid(), signal.SIGKILL)

    return Strike()


def _clock_callback():
    """A callback whose ``elapsed`` is the seconds from the first step's start to the last step's end."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        started: float | None = None
        elapsed: float = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if self.started is None:
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.elapsed = time.perf_counter() - self.started

    return Clock()


def main(argv: list[str] | None = None) -> dict:
    from transformers import TrainingArguments

    from ds_ring.integrations.hf import SequenceParallelTrainer

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
        learning_rate=args.lr, weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=1.0,
        deepspeed=args.deepspeed_config, report_to=[], logging_steps=max(1, min(10, args.steps // 3)), seed=args.seed,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        include_num_input_tokens_seen="all", dataloader_drop_last=True,
    )  # fmt: skip
    dataset = _dataset(args)
    fault = Fault.parse(os.environ["DS_RING_FAULT"]) if os.environ.get("DS_RING_FAULT") and not args.resume else None
    callbacks = [_fault_callback(fault)] if fault is not None else []
    clock = _clock_callback()
    trainer = SequenceParallelTrainer(model=model, args=training, train_dataset=dataset, callbacks=[clock, *callbacks])
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    elapsed = clock.elapsed  # the steps alone, as launch/train_hf.py times its loop (not the engine's start)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    tokens = trainer.state.num_input_tokens_seen
    if trainer.is_world_process_zero():
        print(f"loss: first {losses[0]:.3f} -> last {losses[-1]:.3f} (chance ln(16) = 2.773)" if losses else "")
        ranks = trainer.args.world_size
        print(f"{trainer.state.global_step} steps, {tokens} tokens on {ranks} ranks in {elapsed:.1f} s "
              f"({tokens / max(elapsed, 1e-9):.0f} tokens/s)")  # fmt: skip
    if args.final_params:
        from ds_ring.tiles.zero import gathered

        params = list(trainer.model_wrapped.module.parameters())
        with gathered(params):
            state = [p.detach().clone() for p in params]
        if trainer.is_world_process_zero():
            torch.save(state, args.final_params)
    trainer.close()
    return {"train_loss": result.training_loss, "tokens": tokens, "elapsed_s": elapsed}


if __name__ == "__main__":
    run_main(main)
