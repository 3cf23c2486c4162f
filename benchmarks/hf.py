"""Training a Hugging Face model sequence-parallel: ds_ring's strategies vs DeepSpeed's ALST.

    python -m benchmarks.hf [--quick] [--seqs 4096 8192 16384] [--impls ...] [--out DIR]

The model and task of ``launch/train_hf.py`` (a random-initialised ``LlamaForCausalLM``: hidden 64,
2 layers, 4 heads, 2 K/V heads, fp32; the recall task), batch 1, on 2 rank processes × 1 thread,
ZeRO 0, AdamW, no gradient clipping. One timed call is one whole training step on this rank's
shard: forward, loss, backward, optimizer step. Implementations:

- ``ds_ring`` (``ring``, ``ulysses``, ``hybrid``, ``ring dilated``): ``ds_ring.initialize`` +
  ``ds_ring.integrations.hf`` (``shard_batch``, ``causal_lm_loss``); dense ring on zigzag shards,
  Ulysses and hybrid (Ulysses 2 × ring 1: at 2 ranks the same exchange as Ulysses) on contiguous
  shards; ring dilated with ``w = [S/8, S/2, S]``, ``r = [1, 2, 4]``.
- ``alst``: DeepSpeed 0.19's ALST as its tutorial runs it: ``UlyssesSPAttentionHF.register_with_transformers``
  (core ``sdpa``), ``deepspeed.initialize(mpu=...)``, contiguous shards with global ``position_ids`` and
  ``shift_labels`` (what ``UlyssesSPDataLoaderAdapter`` yields), the tutorial's loss (per-rank means
  all-gathered with autograd, weighted by token counts) divided by the sequence-parallel size before
  ``backward`` so its gradients are the whole model's (MEASURED.md: without it they are 2×).

tokens/s = batch × S ÷ the slowest rank's median step time; memory = each rank's peak RSS during
the timed steps above its RSS before the first of them (model, optimizer state and batch already
there), and the process's peak RSS (interpreter, torch, DeepSpeed and transformers included).
``CPU s/step``: CPU time the largest rank's process used per timed step — on a shared machine it
compares the work done better than wall time, which also counts waiting for a core.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from benchmarks import driver
from benchmarks.driver import Case, Column, Protocol, RankResult, Session, Target, find, fmt_seq, ratio

IMPLS = ["ulysses", "ring", "hybrid", "ring dilated", "alst"]
LABELS = {
    "ulysses": "ds_ring Ulysses",
    "ring": "ds_ring ring (zigzag)",
    "hybrid": "ds_ring hybrid U2×R1",
    "ring dilated": "ds_ring ring dilated",
    "alst": "DeepSpeed ALST (UlyssesSPAttentionHF)",
}
MODEL = SimpleNamespace(dim=64, layers=2, heads=4, kv_heads=2, init_std=0.2, seed=0)
"""``launch/train_hf.py``'s default model."""
LR = 3e-3


def _case(impl: str, seq: int) -> Case:
    dilated = impl == "ring dilated"
    return Case(
        impl, seq, world=2, heads=MODEL.heads, head_dim=MODEL.dim // MODEL.heads,
        layout="zigzag" if impl == "ring" else "contiguous", ulysses=2 if impl in ("ulysses", "hybrid") else 1,
        segment_lengths=(seq // 8, seq // 2, seq) if dilated else None, dilation_rates=(1, 2, 4) if dilated else None,
        tag="dilated" if dilated else "dense",
    )  # fmt: skip


def _ds_config(case: Case) -> dict[str, Any]:
    section: dict[str, Any] = {"sequence_parallel_size": case.world, "layout": case.layout, "timeout_s": 600}
    if case.impl == "hybrid":
        section.update(strategy="hybrid", ulysses_degree=case.ulysses, ring_degree=case.world // case.ulysses)
    else:
        section["strategy"] = "ulysses" if case.impl == "ulysses" else "ring"
    if case.segment_lengths is not None:
        section.update(segment_lengths=list(case.segment_lengths), dilation_rates=list(case.dilation_rates))
    return {
        "train_micro_batch_size_per_gpu": case.batch,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "ring_attention": section,
    }


def _model_and_batch(case: Case) -> tuple[Any, dict[str, Any]]:
    import torch

    from launch.train_hf import RecallDataset, build_model

    torch.manual_seed(MODEL.seed)
    model = build_model(SimpleNamespace(**vars(MODEL), seq=case.seq))
    items = [RecallDataset(case.batch, case.seq, MODEL.seed)[i] for i in range(case.batch)]
    return model, {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _ds_ring_step(case: Case, rank: int) -> Callable[[], None]:
    import torch

    import ds_ring
    from ds_ring.integrations.hf import causal_lm_loss, register_with_transformers, shard_batch

    model, batch = _model_and_batch(case)
    config = _ds_config(case)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config=config, seq_len=case.seq)
    topology = register_with_transformers(model, config=config, topology=engine.mpu)
    inputs = shard_batch(batch, topology)
    shift_labels = inputs.pop("shift_labels")

    def step() -> None:
        loss = causal_lm_loss(engine(**inputs).logits, shift_labels, topology)
        engine.backward(loss)
        engine.step()

    return step


def _alst_step(case: Case, rank: int) -> Callable[[], None]:
    import deepspeed
    import torch
    import torch.distributed.nn.functional as dist_nn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    model, batch = _model_and_batch(case)
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=case.world,
        micro_batch_size=case.batch, seq_length=case.seq, seq_length_is_variable=True,
    )  # fmt: skip
    config = {k: v for k, v in _ds_config(case).items() if k != "ring_attention"}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    group, sp = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_world_size()
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # the adapter's shift_labels
    positions = torch.arange(case.seq).expand(case.batch, -1)
    shard = slice(rank * case.seq // sp, (rank + 1) * case.seq // sp)
    input_ids, position_ids, shift_labels = (x[:, shard] for x in (batch["input_ids"], positions, labels))

    def step() -> None:
        logits = engine(input_ids=input_ids, position_ids=position_ids).logits
        loss = engine.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)  # fmt: skip
        tokens = (shift_labels != -100).sum()
        losses, counts = dist_nn.all_gather(loss, group=group), dist_nn.all_gather(tokens, group=group)
        total = sum(loss_r * count_r for loss_r, count_r in zip(losses, counts, strict=True)) / max(sum(counts), 1)
        engine.backward(total / sp)
        engine.step()

    return step


def build(case: Case, rank: int, timeout_s: float) -> Callable[[], None]:
    """One training step of ``case`` on this rank (the model, optimizer and shard built once here)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case.world), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return _alst_step(case, rank) if case.impl == "alst" else _ds_ring_step(case, rank)


@dataclass
class StepResult(RankResult):
    """One rank's timed training steps (``fwdbwd``), and the CPU seconds its process used per step: on a
    shared machine a better comparison of the work than wall time, which includes waiting for a core."""

    cpu_s_per_step: float | None = None


def train_rank(
    rank: int, world: int, case: Case, build: Callable[[Case, int, float], Callable[[], None]], protocol: Protocol
) -> StepResult:
    """Rank function: build the step, run one untimed warm-up step, then ``protocol.calls`` timed steps."""
    import torch

    result = StepResult(threads=torch.get_num_threads())
    step = build(case, rank, protocol.timeout_s)
    step()
    driver.release_free_memory()
    result.rss_before_inputs_mib = driver.current_rss_bytes() / driver.MIB
    cpu0 = time.process_time()
    result.fwdbwd = driver.measure(step, calls=protocol.calls)
    result.cpu_s_per_step = (time.process_time() - cpu0) / len(result.fwdbwd.times_s)
    return result


def plan(session: Session) -> None:
    args = session.args
    for seq in args.seqs or ([2048, 4096] if args.quick else [4096, 8192, 16384]):
        for impl in args.impls or IMPLS:
            session.run(_case(impl, seq))


def _tokens_per_s(row: driver.Row) -> float | None:
    return row.case.batch * row.case.seq / row.fwdbwd_s if row.fwdbwd_s else None


def _largest(key: str) -> Callable[[driver.Row], float | None]:
    """The largest rank's raw ``key`` (None unless every rank has it)."""

    def get(row: driver.Row) -> float | None:
        values = [r.get(key) for r in row.raw]
        return max(values) if values and None not in values else None

    return get


def report(session: Session) -> str:
    rows = session.rows

    def versus_alst(attr: str) -> Callable[[driver.Row], float | None]:
        return lambda r: ratio(r, find(rows, impl="alst", seq=r.case.seq), attr)

    columns = [
        Column("impl", lambda r: r.label),
        Column("seq", lambda r: r.case.seq, fmt_seq),
        Column("procs × threads", lambda r: r.procs),
        Column("step s", lambda r: r.fwdbwd_s, "{:.3f}"),
        Column("tokens/s", _tokens_per_s, "{:.0f}"),
        Column("tokens/s ÷ ALST", lambda r: ratio(find(rows, impl="alst", seq=r.case.seq), r), "{:.2f}"),
        Column("step MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
        Column("step MiB ÷ ALST", versus_alst("peak_mib"), "{:.2f}"),
        Column("process peak MiB/rank", _largest("peak_rss_mib"), "{:.0f}"),
        Column("CPU s/step", _largest("cpu_s_per_step"), "{:.3f}"),
        Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"),
        Column("notes", lambda r: "; ".join(r.notes)),
    ]
    session.targets = _targets(rows)
    return driver.markdown_table(rows, columns) + "\n\n" + driver.format_targets(session.targets)


def _targets(rows: list[driver.Row]) -> list[Target]:
    targets = []
    seqs = sorted({r.case.seq for r in rows})
    for seq in seqs:
        speed = ratio(find(rows, impl="alst", seq=seq), find(rows, impl="ulysses", seq=seq))
        if speed is not None:
            cpu = [_largest("cpu_s_per_step")(find(rows, impl=impl, seq=seq)) for impl in ("alst", "ulysses")]
            work = f"; CPU s/step ALST ÷ ds_ring Ulysses {cpu[0] / cpu[1]:.2f}" if None not in cpu else ""
            targets.append(Target(f"ds_ring Ulysses ≥ ALST throughput, {fmt_seq(seq)}", speed, speed >= 1.0,
                                  f"ALST step time ÷ ds_ring Ulysses step time{work}"))  # fmt: skip
    if seqs:
        longest = seqs[-1]
        memory = ratio(find(rows, impl="ring", seq=longest), find(rows, impl="alst", seq=longest), "peak_mib")
        if memory is not None:
            targets.append(Target(f"ring uses less memory per rank than ALST, {fmt_seq(longest)}", memory,
                                  memory < 1.0, "ds_ring ring step MiB/rank ÷ ALST step MiB/rank"))  # fmt: skip
    return targets


def plots(session: Session) -> None:
    title = "HF Llama training step, 2 ranks × 1 thread, batch 1, fp32"
    for name, ylabel, y in (
        ("throughput", "tokens/s (whole job)", _tokens_per_s),
        ("memory", "step working memory, largest rank (MiB)", lambda r: r.peak_mib),
    ):
        driver.plot_rows(
            session.out / f"hf_{name}.png", session.rows, panel=lambda r: "", ylabel=ylabel, title=title,
            phases=(("", y, "-o"),), logy=False,
        )  # fmt: skip


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", type=int, nargs="+", help="sequence lengths, multiples of 64 (default 4K 8K 16K)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="implementations (default all)")


BENCHMARK = driver.Benchmark(
    name="hf", module="benchmarks.hf", title="HF Llama training steps: ds_ring strategies vs DeepSpeed ALST, p = 2",
    plan=plan, build=build, report=report, plots=plots, add_args=add_args, label=lambda case: LABELS[case.impl],
    flop=lambda case: MODEL.layers * driver.useful_gflop(case), packages=("deepspeed", "transformers"), calls=3,
    rank=train_rank,
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(driver.main(BENCHMARK))
