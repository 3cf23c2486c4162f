"""The main job: train a small GPT with ring dilated attention on a long-range recall task.

Every sequence starts with a key (one of 16 tokens, repeated over the first 8 positions so every
dilation offset sees it), continues with random filler, and ends with query markers whose target
is the key. The key lives on the first rank's shard and the queries on the last rank's, so the
loss can only fall below ln(16) = 2.77 through attention across shards.

Launch with any of (2 CPU ranks shown; see launch/README.md)::

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/cpu_default.json
    torchrun --standalone --nproc-per-node 2 launch/train.py --deepspeed_config ds_configs/cpu_default.json
    mpirun -np 2 python launch/train.py --deepspeed_config ds_configs/cpu_default.json

It checkpoints every ``--save-every`` steps into ``--save-dir`` and, when started again with the
same directory (a plain re-run, ``torchrun --max-restarts``, a requeued SLURM job), resumes from the
latest checkpoint (data position included) on any shape: another rank count, sequence-parallel degree
or ZeRO stage 1-3 (docs/elastic.md). The samples of step N are a function of N and the data-parallel
index only, so with the same global batch the data order continues exactly. On SIGTERM or SIGUSR1
(``ring_attention.preemption``) every rank stops after the current step, which is saved, and exits 0; a step
longer than half the grace period is abandoned instead, and the step before it saved (docs/elastic.md).

The ``ring_attention.monitoring`` section of the ds_config switches on
per-step metrics (written through DeepSpeed's monitor; a monitor ``output_path`` left empty means
``<save-dir>/monitor``), the watchdog and the numerics guard. Any error ends the process with
code 1 after logging it, never a hang.

Fault injection, for the recovery tests: ``DS_RING_FAULT="kill:rank=1:step=5"`` SIGKILLs rank 1 when
training step 5 (1-based) posts its first ring transfer; ``"sleep:rank=1:step=3:seconds=60"`` makes
it stop answering for 60 s there instead; ``"kill_in_save:rank=1:step=6"`` and
``"sleep_in_save:rank=1:step=6:seconds=60"`` strike while the rank writes its first checkpoint file
of step 6, after writing half of it; ``"sleep_in_reduce:rank=1:step=3:seconds=5"`` stalls the rank
when DeepSpeed's gradient all-reduce of step 3 starts (the other ranks wait inside DeepSpeed's
collective). A fault fires only in a run that started from scratch and is not a torchrun restart
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted or re-run job resumes and finishes.
Checkpoints are published atomically (``ds_ring.save_checkpoint``): a save cut short leaves the job
to resume from the previous one.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python launch/train.py` from a checkout
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: no detection warning

from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402

import ds_ring  # noqa: E402
from ds_ring.config import read_ds_config  # noqa: E402
from ds_ring.hooks import Event, HookHandle, peak_memory_bytes, register_hook  # noqa: E402
from ds_ring.monitor import run_main  # noqa: E402
from ds_ring.tiles.zero import gathered  # noqa: E402
from launch.model import TinyGPT  # noqa: E402

KEYS, KEY_REPEAT, QUERY_TOKENS = 16, 64, 64
FILLER, QUERY = KEYS, KEYS + 1
VOCAB = KEYS + 2


def make_batch(step: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full sequences ``[batch, seq]`` and labels for ``step`` (a pure function of it, so resuming is exact)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    keys = torch.randint(0, KEYS, (batch, 1), generator=g)
    tokens = torch.full((batch, seq), FILLER)
    tokens[:, :KEY_REPEAT] = keys
    tokens[:, -QUERY_TOKENS:] = QUERY
    labels = torch.full_like(tokens, -100)
    labels[:, -QUERY_TOKENS:] = keys
    return tokens, labels


def peak_memory_mib() -> float:
    """Peak memory of this rank: the accelerator allocator's when on CUDA, else peak RSS."""
    return peak_memory_bytes() / 2**20


MONITORS_WITH_OUTPUT_PATH = ("csv_monitor", "tensorboard")


@dataclass(frozen=True)
class Fault:
    """A fault to inject (tests): ``action`` (one of :data:`ACTIONS`) on ``rank`` in training step ``step``."""

    ACTIONS = ("kill", "sleep", "kill_in_save", "sleep_in_save", "sleep_in_reduce")

    action: str
    rank: int
    step: int
    seconds: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """``"ACTION:rank=R:step=S"``, with ``:seconds=X`` for the sleeps; ``ValueError`` naming what is wrong."""
        action, *fields = spec.split(":")
        try:
            values = dict(field.split("=", 1) for field in fields)
            fault = cls(action, int(values.pop("rank")), int(values.pop("step")), float(values.pop("seconds", 0)))
            sleeps = action.startswith("sleep")
            if action not in cls.ACTIONS or values or sleeps != (fault.seconds > 0):
                raise ValueError(f"unknown action or fields {sorted(values)}")
        except (KeyError, ValueError) as err:
            raise ValueError(
                f"DS_RING_FAULT={spec!r}: expected ACTION:rank=R:step=S (ACTION one of {list(cls.ACTIONS)}), with "
                f":seconds=X for the sleeps ({err})"
            ) from None
        return fault

    def install(self, rank: int, current_step: list[int], engine: Any) -> HookHandle | None:
        """On ``rank``, fire when training step ``current_step[0] == step`` starts its first ring step
        (``kill``, ``sleep``), writes its first checkpoint file (``*_in_save``) or starts DeepSpeed's gradient
        all-reduce (``sleep_in_reduce``)."""
        if rank != self.rank:
            return None
        if self.action.endswith("_in_save"):
            self._strike_in_save(rank, current_step, engine)
            return None
        if self.action == "sleep_in_reduce":
            self._stall_in_reduce(rank, current_step, engine)
            return None

        def fire(event: Event) -> None:
            if event.kind != "ring_step" or event.phase != "start" or current_step[0] != self.step:
                return
            print(f"ds_ring fault injection: rank {rank} {self.action}{f' {self.seconds} s' if self.seconds else ''} "
                  f"in training step {self.step} before {event.op} ring step {event.step} "
                  f"(unix time {time.time():.3f})", file=sys.stderr, flush=True)  # fmt: skip
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            current_step[0] = -1  # once
            time.sleep(self.seconds)

        return register_hook(fire, phases=("start",))

    def _stall_in_reduce(self, rank: int, current_step: list[int], engine: Any) -> None:
        reduce = engine.allreduce_gradients

        def stall_then_reduce(*args: Any, **kwargs: Any) -> Any:
            if current_step[0] == self.step:
                print(f"ds_ring fault injection: rank {rank} sleep_in_reduce {self.seconds} s in training step "
                      f"{self.step} (unix time {time.time():.3f})", file=sys.stderr, flush=True)  # fmt: skip
                current_step[0] = -1  # once
                time.sleep(self.seconds)
            return reduce(*args, **kwargs)

        engine.allreduce_gradients = stall_then_reduce

    def _strike_in_save(self, rank: int, current_step: list[int], engine: Any) -> None:
        """Make the engine's next checkpoint file of step ``step`` half-written, then kill or stall the rank."""
        save = engine.checkpoint_engine.save

        def half_then_strike(state_dict: dict, path: str) -> None:
            if current_step[0] != self.step:
                return save(state_dict, path)
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            Path(path).write_bytes(buffer.getbuffer()[: buffer.tell() // 2])
            print(f"ds_ring fault injection: rank {rank} {self.action} after writing half of {Path(path).name} in "
                  f"training step {self.step} (unix time {time.time():.3f})", file=sys.stderr, flush=True)  # fmt: skip
            if self.action == "kill_in_save":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(self.seconds)

        engine.checkpoint_engine.save = half_then_strike


def ds_config_for(path: str, save_dir: Path) -> dict:
    """The ds_config, with an empty monitor ``output_path`` set to ``<save_dir>/monitor``."""
    config = read_ds_config(path)
    for name in MONITORS_WITH_OUTPUT_PATH:
        backend = config.get(name)
        if isinstance(backend, dict) and backend.get("enabled") and not backend.get("output_path"):
            config[name] = {**backend, "output_path": str(save_dir / "monitor")}
    return config


def add_training_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The arguments every launch script takes after ``--deepspeed_config``: the launcher's, the task's
    (``--steps`` defaulting to ``steps``), the model's shape, the optimiser's and the run's."""
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (split over the sequence ranks)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")


def report_run(losses: list[float], tokens_per_step: int, elapsed: float) -> list[list[float]]:
    """Every rank's ``[peak memory MiB, tokens/s]`` over the ``len(losses)`` steps just run (one all-gather);
    rank 0 prints them after the mean loss of the first and of the last 5 steps."""
    rank, world, steps = dist.get_rank(), dist.get_world_size(), len(losses)
    report = torch.tensor([peak_memory_mib(), steps * tokens_per_step / max(elapsed, 1e-9)], dtype=torch.float64)
    reports = [torch.zeros_like(report) for _ in range(world)]
    dist.all_gather(reports, report)
    if rank == 0:
        if losses:
            first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
            print(f"loss: first 5 steps {first:.3f} -> last 5 steps {last:.3f} (chance ln(16) = 2.773)")
        print(f"{steps} steps of {tokens_per_step} tokens on {world} ranks in {elapsed:.1f} s")
        for r, (mem, tps) in enumerate(reports):
            print(f"  rank {r}: {float(tps):8.0f} tokens/s | peak memory {float(mem):7.1f} MiB")
    return [r.tolist() for r in reports]


def final_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """Collective: the whole parameters, by name (gathered under ZeRO 3)."""
    named = list(engine.module.named_parameters())
    with gathered([p for _, p in named]):
        return {name: p.detach().clone() for name, p in named}


def optimizer_state(engine: Any) -> dict[str, Any]:
    """Collective: what the optimizer holds, whole, to compare runs at other shapes.

    ``"params"``: each parameter's name → its fp32 master weight (``"fp32"``; the parameter itself where the optimizer
    keeps no other copy) and Adam moments (``"exp_avg"``, ``"exp_avg_sq"``; zeros before the first step), fp32, of
    the parameter's shape. ``"steps"``: the sorted distinct Adam step counts of this rank's state. ``"loss_scale"``:
    the fp16 loss scale (``None`` without fp16).
    """
    optimizer, basic = engine.optimizer, engine.basic_optimizer
    named = list(engine.module.named_parameters())
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in named:
        fp32 = safe_get_full_fp32_param(p)  # ZeRO 1-3 and BF16_Optimizer (collective)
        if fp32 is not None:
            held[name] = {"fp32": fp32, **{key: safe_get_full_optimizer_state(p, key) for key in _MOMENTS}}
    if not held:
        held = _whole_masters(optimizer, basic, named)
    steps = sorted({int(state["step"]) for state in basic.state.values() if "step" in state})
    scale = getattr(optimizer, "loss_scale", None) if engine.fp16_enabled() else None
    params = {name: {key: value.detach().float().cpu().clone() for key, value in d.items()} for name, d in held.items()}
    return {"params": params, "steps": steps, "loss_scale": None if scale is None else float(scale)}


def _whole_masters(optimizer: Any, basic: Any, named: list[tuple[str, torch.Tensor]]) -> dict[str, dict]:
    """Without ZeRO: DeepSpeed's FP16 optimizers (fp16; bf16 at ZeRO 0) keep one fp32 master per parameter (unfused:
    ``fp32_groups``) or one flat master per group (fused: ``fp32_groups_flat``, parameters sliced in group order);
    a plain optimizer steps the parameters themselves. Adam's state is keyed by the master."""
    names = {id(p): name for name, p in named}
    if hasattr(optimizer, "fp32_groups"):
        pieces = [(p, master, slice(None)) for group, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups,
                  strict=True) for p, master in zip(group, masters, strict=True)]  # fmt: skip
    elif hasattr(optimizer, "fp32_groups_flat"):
        pieces = []
        for group, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat, strict=True):
            ends = torch.tensor([p.numel() for p in group]).cumsum(0).tolist()
            pieces += [(p, flat, slice(end - p.numel(), end)) for p, end in zip(group, ends, strict=True)]
    else:
        pieces = [(p, p, slice(None)) for _, p in named]
    held = {}
    for p, master, piece in pieces:
        state = basic.state[master]
        tensors = {"fp32": master, **{key: state.get(key, torch.zeros_like(master)) for key in _MOMENTS}}
        held[names[id(p)]] = {key: t.reshape(-1)[piece].view(p.shape) for key, t in tensors.items()}
    return held


_MOMENTS = ("exp_avg", "exp_avg_sq")


def save(engine: Any, save_dir: Path, step: int) -> float:
    """Checkpoint ``step`` (tag ``step<N>``) into ``save_dir``; returns the seconds it took."""
    started = time.perf_counter()
    ds_ring.save_checkpoint(engine, save_dir, f"step{step}", {"step": step})
    return time.perf_counter() - started


def save_part(engine: Any, save_dir: Path, step: int) -> tuple[float, bool]:
    """This rank's part of checkpoint ``step`` (no collective: a preemption abandoned the step after it); the
    seconds it took and whether the checkpoint is published (every rank's part written)."""
    started = time.perf_counter()
    published = ds_ring.save_rank_checkpoint(engine, save_dir, f"step{step}", {"step": step},
                                             token=engine.preemption.token)  # fmt: skip
    return time.perf_counter() - started, published


def shut_down(engine: Any) -> None:
    """Close the engine's ring monitor, wait for every rank, then destroy the engine and the process group."""
    engine.ring_monitor.close()
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--deepspeed_config", default="ds_configs/cpu_default.json", help="ds_config path (.json, .yaml or .yml)"
    )
    add_training_arguments(p, steps=240)
    p.add_argument("--save-dir", default="runs/train", help="checkpoints; an existing one is resumed")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (0: never)")
    p.add_argument("--metrics-log", default=None, help="write per-step metrics as JSON lines here (rank 0)")
    p.add_argument("--final-params", default=None, help="rank 0 saves the final parameters here (torch.save) "
                   "when the run completes")  # fmt: skip
    p.add_argument("--final-optimizer-state", default=None, help="rank 0 saves the optimizer's fp32 master weights, "
                   "Adam moments, step and loss scale here (torch.save; launch/train.py's optimizer_state) when the "
                   "run completes")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fault = Fault.parse(os.environ["DS_RING_FAULT"]) if os.environ.get("DS_RING_FAULT") else None
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    save_dir = Path(args.save_dir)
    ds_config = ds_config_for(args.deepspeed_config, save_dir)
    section = ds_ring.load_config(ds_config)
    model = TinyGPT(
        VOCAB, args.dim, args.heads, args.layers, args.seq, kv_heads=args.kv_heads,
        segment_lengths=section.segment_lengths, dilation_rates=section.dilation_rates, causal=True,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config=ds_config, seq_len=args.seq)
    monitor = engine.ring_monitor
    topology = engine.mpu
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas, replica = topology.get_data_parallel_world_size(), topology.get_data_parallel_rank()
    micro = engine.train_micro_batch_size_per_gpu()
    positions = ds_ring.shard_sequence(torch.arange(args.seq, device=engine.device), topology, dim=0)

    start_step = 0
    resumed = ds_ring.load_checkpoint(engine, save_dir)
    if resumed is not None:
        start_step = resumed.client_state["step"]
        if rank == 0:
            print(f"resumed from checkpoint {resumed.tag} at step {start_step} ({resumed.loaded_as}: converted in "
                  f"{resumed.convert_s:.2f} s, loaded in {resumed.load_s:.2f} s)", flush=True)  # fmt: skip
    current_step = [0]  # read by the fault hook
    first_attempt = start_step == 0 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if fault is not None and first_attempt:
        fault.install(rank, current_step, engine)

    losses: list[float] = []
    preempted = None
    tokens_per_step = micro * replicas * args.seq
    progress = tqdm(range(start_step, args.steps), disable=rank != 0, desc="train", unit="step")
    started = time.perf_counter()
    abandoned = None
    for step in progress:
        current_step[0] = step + 1
        try:  # a preemption mid-step abandons it on every rank: each saves its part of the last completed step
            with engine.preemption.step_in_flight(step + 1, save_dir):
                monitor.begin_step(step + 1)
                tokens, labels = make_batch(step, micro * replicas, args.seq, args.seed)
                rows = slice(replica * micro, (replica + 1) * micro)
                local_tokens, local_labels = (
                    ds_ring.shard_sequence(x[rows].to(engine.device), topology) for x in (tokens, labels)
                )
                logits = engine(local_tokens, positions)
                loss = ds_ring.sequence_parallel_cross_entropy(logits, local_labels, topology)
                if not monitor.skip_step():  # numerics_guard "skip_step": the batch is dropped on every rank
                    engine.backward(loss)
                    engine.step()
        except ds_ring.StepAbandoned as stop:
            abandoned = preempted = stop.completed
            seconds, published = save_part(engine, save_dir, stop.completed)
            print(f"preempted in step {stop.step}: abandoned it, saved rank {rank}'s part of step {stop.completed} "
                  f"in {seconds:.2f} s ({'published' if published else 'not yet published'}); exiting 0",
                  flush=True)  # fmt: skip
            break
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        saved = args.save_every and (step + 1) % args.save_every == 0
        if saved:
            seconds = save(engine, save_dir, step + 1)
            if rank == 0:
                print(f"saved step {step + 1} in {seconds:.2f} s", flush=True)
        metrics = monitor.end_step(loss=losses[-1])
        if args.metrics_log and rank == 0:
            with open(args.metrics_log, "a") as handle:
                handle.write(json.dumps({"step": step + 1, "loss": losses[-1], **metrics}) + "\n")
        if engine.preemption.stop_requested(step + 1):
            seconds = 0.0 if saved else save(engine, save_dir, step + 1)
            preempted = step + 1
            if rank == 0:
                print(f"preempted: saved step {preempted} in {seconds:.2f} s; exiting 0", flush=True)
            break
    elapsed = time.perf_counter() - started

    summary = {"start_step": start_step, "steps": args.steps, "losses": losses, "world": world, "preempted": preempted}
    if abandoned is not None:  # peers may be anywhere: no collective from here on
        engine.ring_monitor.close()
        if os.environ.get("DS_RING_TRAIN_SUMMARY"):
            Path(os.environ["DS_RING_TRAIN_SUMMARY"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(summary))
        return summary
    report_run(losses, tokens_per_step, elapsed)
    if args.final_params and preempted is None:
        params = final_parameters(engine)
        if rank == 0:
            torch.save(params, args.final_params)
    if args.final_optimizer_state and preempted is None:
        state = optimizer_state(engine)
        if rank == 0:
            torch.save(state, args.final_optimizer_state)
    if os.environ.get("DS_RING_TRAIN_SUMMARY"):
        Path(os.environ["DS_RING_TRAIN_SUMMARY"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(summary))
    shut_down(engine)
    return summary


if __name__ == "__main__":
    # Everything is saved, printed and torn down by main(). run_main exits without C++ static
    # destructors (at interpreter exit DeepSpeed/gloo intermittently abort with "terminate called
    # without an active exception", ~1 run in 4 here), with code 1 after logging any error (a
    # communication timeout names the rank, peer, step and op), so a failed rank never hangs.
    run_main(main)
