"""Fine-tune a Hugging Face Llama (or a hybrid) with ds_ring sequence parallelism on a long-range recall task.

The model is a small ``LlamaForCausalLM`` built from a ``LlamaConfig`` with random weights (nothing
is downloaded; ``--model-type bamba`` / ``lfm2``: a hybrid of Mamba2 mixers / short convolutions and attention,
whose recurrent layers carry their state across shards), its attention the transformers ``sdpa`` entry that
``register_with_transformers`` replaces with ds_ring's strategy from the ds_config's ``ring_attention`` section.
Every sequence starts with a key (one of 16 tokens, repeated over the first 64 positions) and ends with query
markers whose next-token target is the key: the key lives on the first rank's shard and the queries
on the last rank's, so the loss can only fall below ln(16) = 2.77 through attention across shards.

Launch with either of (2 CPU ranks)::

    deepspeed --num_gpus 2 launch/train_hf.py --deepspeed_config ds_configs/hf_ring.json
    torchrun --standalone --nproc-per-node 2 launch/train_hf.py --deepspeed_config ds_configs/hf_ring.json

``--long-context`` adds the section's ``long_context`` (tiled loss and MLP; ``--offload-dir`` puts the layer
inputs gradient checkpointing keeps on disk) and trains from the loss the model returns. At 131,072 tokens over
2 ranks (ring dilated attention, its longest segment the whole sequence)::

    torchrun --standalone --nproc-per-node 2 launch/train_hf.py --deepspeed_config ds_configs/hf_long_context.json \
        --long-context --seq 131072 --steps 3 --dim 128 --vocab 8192

``--offload-recompute`` (with ``--offload-dir``) sends the activations each layer's recompute saves to disk too,
and ``--memory-census`` has rank 0 print the tensors alive at its memory peak; with both, two million tokens over
4 CPU ranks in under 5 GiB per rank (docs/performance.md, "Two million tokens on one 24 GiB machine")::

    torchrun --standalone --nproc-per-node 4 launch/train_hf.py \
        --deepspeed_config ds_configs/hf_long_context_world.json --long-context --offload-dir /tmp \
        --offload-recompute --seq 2097152 --steps 1 --dim 256 --layers 4 --vocab 32000 --memory-census

With ``--save-dir`` it checkpoints every ``--save-every`` steps there and resumes from the latest checkpoint on
any shape (docs/elastic.md): the samples of step N are the same whatever the rank count (the sampler splits
the step's global batch over the data-parallel replicas). On SIGTERM or SIGUSR1 every rank stops after the
current step, which is saved (with ``--save-dir``), and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python launch/train_hf.py` from a checkout
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: no detection warning

import ds_ring  # noqa: E402
from ds_ring.config import read_ds_config  # noqa: E402
from ds_ring.integrations.hf import (  # noqa: E402
    SequenceParallelDataLoader,
    causal_lm_loss,
    register_with_transformers,
)
from ds_ring.monitor import TensorCensus, run_main  # noqa: E402
from launch.train import (  # noqa: E402
    FILLER,
    KEY_REPEAT,
    KEYS,
    QUERY,
    QUERY_TOKENS,
    VOCAB,
    add_training_arguments,
    final_parameters,
    report_run,
    save,
    shut_down,
)


class RecallDataset(Dataset):
    """``length`` full sequences ``{"input_ids": [seq], "labels": [seq]}``; item ``i`` depends on ``i`` only.

    Labels follow transformers' convention (token ``t`` is predicted from the tokens before it):
    -100 everywhere except after a query marker, where the next token's label is the key.
    """

    def __init__(self, length: int, seq: int, seed: int) -> None:
        self.length, self.seq, self.seed = length, seq, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        key = torch.randint(0, KEYS, (1,), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + index))
        input_ids = torch.full((self.seq,), FILLER)
        input_ids[:KEY_REPEAT] = key
        input_ids[-QUERY_TOKENS:] = QUERY
        labels = torch.full_like(input_ids, -100)
        labels[-QUERY_TOKENS + 1 :] = key
        return {"input_ids": input_ids, "labels": labels}


MODEL_TYPES = ("llama", "bamba", "lfm2")
"""``--model-type``: Llama (attention only), Bamba (Mamba2 state-space mixers + attention: a hybrid), LFM2 (short
causal convolutions + attention). The recurrent layers run sequence-parallel with their state carried across shards
(docs/recurrent.md)."""


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random-initialised ``--model-type`` causal LM with GQA, attention implementation ``sdpa``."""
    import transformers

    common = dict(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        use_cache=False, initializer_range=args.init_std,
    )  # fmt: skip
    if args.model_type == "bamba":  # every second layer attention, the others Mamba2 (8 heads of 2·dim/8 channels)
        extra = dict(
            attn_layer_indices=list(range(1, args.layers, 2)), mamba_n_heads=8, mamba_d_head=2 * args.dim // 8,
            mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=64, mamba_expand=2,
        )  # fmt: skip
        config = transformers.BambaConfig(**common, **extra)
    elif args.model_type == "lfm2":  # every second layer attention, the others short convolutions (width 3)
        layer_types = ["conv" if i % 2 == 0 else "full_attention" for i in range(args.layers)]
        config = transformers.Lfm2Config(**common, layer_types=layer_types, conv_L_cache=3)
    else:
        config = transformers.LlamaConfig(**common)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What :func:`build_model` reads beyond :func:`launch.train.add_training_arguments`."""
    p.add_argument("--init-std", type=float, default=0.2, help="weight init std (HF's 0.02 learns this task slowly)")
    p.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (the task uses {VOCAB} tokens)")
    p.add_argument("--model-type", choices=MODEL_TYPES, default="llama", help="llama, or a hybrid: bamba, lfm2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", default="ds_configs/hf_ring.json", help="ds_config.json path")
    add_training_arguments(p, steps=150)
    add_model_arguments(p)
    p.add_argument("--long-context", action="store_true", help="tiled loss and tiled MLP (ring_attention.long_context)")
    p.add_argument("--tile-tokens", type=int, default=4096, help="tokens per tile with --long-context")
    p.add_argument("--offload-dir", help="with --long-context: keep checkpointed layer inputs in files here")
    p.add_argument("--offload-recompute", action="store_true", help="with --offload-dir: recomputed activations too")
    p.add_argument("--memory-census", action="store_true", help="rank 0 prints the tensors alive at its peak")
    p.add_argument("--save-dir", default=None, help="checkpoints; an existing one is resumed (any shape)")
    p.add_argument("--save-every", type=int, default=0, help="with --save-dir: checkpoint every N steps (0: never)")
    p.add_argument("--final-params", default=None, help="rank 0 saves the final parameters here (torch.save), by name")
    args = p.parse_args(argv)
    if args.vocab < VOCAB:
        p.error(f"--vocab {args.vocab} is smaller than the task's {VOCAB} tokens; use at least {VOCAB}")
    if args.offload_dir and not args.long_context:
        p.error("--offload-dir goes with --long-context")
    if args.offload_recompute and not args.offload_dir:
        p.error("--offload-recompute goes with --offload-dir")
    return args


def ds_config(args: argparse.Namespace) -> dict:
    """The ds_config file, with ``ring_attention.long_context`` set from the command line."""
    config = read_ds_config(args.deepspeed_config)
    if args.long_context:
        section = {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": args.tile_tokens}
        if args.offload_dir:
            section.update(offload_checkpoints="disk", offload_dir=args.offload_dir)
            section.update(offload_recompute=args.offload_recompute)
        config["ring_attention"] = {**config["ring_attention"], "long_context": section}
    return json.loads(json.dumps(config))


class Abandoned(Exception):
    """A preemption abandoned a step; this rank saved its part of ``args[0]``, the step before (no collective)."""


def _train(
    args: argparse.Namespace, engine: Any, session: Any, progress: Any, start_step: int, losses: list[float]
) -> int | None:
    """Train over ``progress``'s batches, appending each step's loss; the step a preemption stopped after, or None.

    With ``--save-dir`` a preemption may abandon the step in flight (``ds_ring.StepAbandoned``): this rank then
    saves its part of the step before and raises :class:`Abandoned` (no collective from there on)."""
    monitor, rank = engine.ring_monitor, dist.get_rank()
    for step, batch in enumerate(progress, start=start_step):
        in_flight = (
            engine.preemption.step_in_flight(step + 1, args.save_dir) if args.save_dir else contextlib.nullcontext()
        )
        try:
            with in_flight:
                monitor.begin_step(step + 1)
                outputs = engine(**batch)  # with the tiled loss: the loss, and no logits
                loss = (
                    outputs.loss
                    if outputs.loss is not None
                    else causal_lm_loss(session, outputs.logits, batch["shift_labels"])
                )
                if not monitor.skip_step():  # numerics_guard "skip_step": the batch is dropped on every rank
                    engine.backward(loss)
                    engine.step()
        except ds_ring.StepAbandoned as stop:
            started = time.perf_counter()
            tag, token = f"step{stop.completed}", engine.preemption.token
            published = ds_ring.save_rank_checkpoint(engine, args.save_dir, tag, {"step": stop.completed}, token=token)
            print(f"preempted in step {stop.step}: abandoned it, saved rank {rank}'s part of step {stop.completed} "
                  f"in {time.perf_counter() - started:.2f} s ({'published' if published else 'not yet published'}); "
                  f"exiting 0", flush=True)  # fmt: skip
            raise Abandoned(stop.completed) from stop
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        saved = bool(args.save_dir and args.save_every and (step + 1) % args.save_every == 0)
        if saved:
            save(engine, Path(args.save_dir), step + 1)
        monitor.end_step(loss=losses[-1])
        if engine.preemption.stop_requested(step + 1):
            seconds = 0.0 if saved or not args.save_dir else save(engine, Path(args.save_dir), step + 1)
            if rank == 0:
                kept = f"saved step {step + 1} in {seconds:.2f} s" if args.save_dir else "no --save-dir, nothing saved"
                print(f"preempted after step {step + 1}: {kept}; exiting 0", flush=True)
            return step + 1
    return None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    config = ds_config(args)
    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config=config, seq_len=args.seq)
    session = register_with_transformers(model, config=config, topology=engine.mpu)
    session.apply_long_context(model)  # --long-context: tiled loss and MLP (and --offload-dir), else nothing
    topology = session.topology
    rank = dist.get_rank()
    micro, replicas = engine.train_micro_batch_size_per_gpu(), topology.get_data_parallel_world_size()
    # Every rank of a sequence-parallel group loads the same full batches: sample over the replicas only.
    dataset = RecallDataset(args.steps * micro * replicas, args.seq, args.seed)
    sampler = DistributedSampler(dataset, replicas, topology.get_data_parallel_rank(), shuffle=False)
    loader = SequenceParallelDataLoader(
        DataLoader(dataset, batch_size=micro, sampler=sampler), session, device=engine.device
    )

    start_step = 0
    resumed = ds_ring.load_checkpoint(engine, args.save_dir) if args.save_dir else None
    if resumed is not None:
        start_step = resumed.client_state["step"]
        if rank == 0:
            print(f"resumed from checkpoint {resumed.tag} at step {start_step} ({resumed.loaded_as})", flush=True)
    losses: list[float] = []
    batches = itertools.islice(loader, start_step, None)  # the data of the steps already taken is skipped
    progress = tqdm(batches, disable=rank != 0, desc="train", unit="step", initial=start_step, total=args.steps)
    census = TensorCensus(model) if args.memory_census else contextlib.nullcontext()
    started = time.perf_counter()
    try:
        with census:
            preempted = _train(args, engine, session, progress, start_step, losses)
    except Abandoned as abandoned:  # peers may be anywhere in the step: no collective from here on
        session.close()
        engine.ring_monitor.close()
        return {"losses": losses, "preempted": abandoned.args[0]}
    elapsed = time.perf_counter() - started
    if args.memory_census and rank == 0:
        print(f"tensors alive at rank 0's peak: {census.peak.bytes / 2**20:.1f} MiB")
        for label, mib in census.peak.table(top=int(os.environ.get("DS_RING_CENSUS_TOP", "12"))):
            print(f"  {mib:9.1f} MiB  {label}")

    reports = report_run(losses, micro * replicas * args.seq, elapsed)
    if args.final_params and preempted is None:
        params = final_parameters(engine)
        if rank == 0:
            torch.save(params, args.final_params)
    session.close()
    shut_down(engine)
    return {"losses": losses, "elapsed_s": elapsed, "reports": reports}


if __name__ == "__main__":
    run_main(main)  # exits 0 after success, 1 after logging any error; never hangs on teardown
