"""Training a Hugging Face model sequence-parallel: ds_ring's strategies vs DeepSpeed's ALST.

``python -m benchmarks.hf [--quick] [--seqs 4096 8192 16384] [--impls ...] [--out DIR]``: the model and task of
``launch/train_hf.py`` (a random-initialised ``LlamaForCausalLM``: hidden 64, 2 layers, 4 heads, 2 K/V heads, fp32;
the recall task), batch 1, on 2 rank processes × 1 thread, ZeRO 0, AdamW, no gradient clipping. One timed call is one
whole training step on this rank's shard: forward, loss, backward, optimizer step. ``ring``, ``ulysses``, ``hybrid``
(Ulysses 2 × ring 1: at 2 ranks the Ulysses exchange), ``ring dilated`` (``w = [S/8, S/2, S]``, ``r = [1, 2, 4]``):
``ds_ring.initialize`` + ``ds_ring.integrations.hf``, ring on zigzag shards, the others contiguous. ``alst``:
DeepSpeed 0.19's ALST as its tutorial runs it (``UlyssesSPAttentionHF``, core ``sdpa``,
``deepspeed.initialize(mpu=...)``, contiguous shards with global ``position_ids`` and ``shift_labels``, per-rank mean
losses all-gathered with autograd and weighted by token counts), its loss divided by the sequence-parallel size
before ``backward`` so its gradients are the whole model's (without: 2×).

tokens/s = batch × S ÷ the slowest rank's median step time; step MiB = each rank's peak RSS during the timed steps
above its RSS before them (model, optimizer state and batch there); process peak MiB: the whole process (interpreter,
torch, DeepSpeed, transformers). ``CPU s/step``: CPU time the largest rank's process used per timed step (on a shared
machine a fairer measure of work than wall time).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from benchmarks import driver
from benchmarks.driver import Case, Column, Protocol, RankResult, Session, Target, compare, find, fmt_seq, ratio

LABELS = {"ulysses": "ds_ring Ulysses", "ring": "ds_ring ring (zigzag)", "hybrid": "ds_ring hybrid U2×R1",
          "ring dilated": "ds_ring ring dilated", "alst": "DeepSpeed ALST (UlyssesSPAttentionHF)"}  # fmt: skip
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
    return {"train_micro_batch_size_per_gpu": case.batch, "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "ring_attention": section}  # fmt: skip


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

    (model, batch), config = _model_and_batch(case), _ds_config(case)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config=config, seq_len=case.seq)
    session = register_with_transformers(model, config=config, topology=engine.mpu)
    inputs = shard_batch(session, batch)
    shift_labels = inputs.pop("shift_labels")

    def step() -> None:
        loss = causal_lm_loss(session, engine(**inputs).logits, shift_labels)
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
    for seq in session.args.seqs:
        for impl in session.args.impls:
            session.run(_case(impl, seq))


def targets(session: Session) -> list[Target]:
    rows, out = session.rows, []
    seqs = sorted({r.case.seq for r in rows})
    for seq in seqs:
        alst, ulysses = find(rows, impl="alst", seq=seq), find(rows, impl="ulysses", seq=seq)
        cpu = [r.largest("cpu_s_per_step") if r else None for r in (alst, ulysses)]
        work = f"; CPU s/step ALST ÷ ds_ring Ulysses {cpu[0] / cpu[1]:.2f}" if None not in cpu else ""
        out += compare(f"ds_ring Ulysses ≥ ALST throughput, {fmt_seq(seq)}", alst, ulysses, met=lambda x: x >= 1.0,
                       note=f" step time (ALST vs ds_ring Ulysses){work}")  # fmt: skip
    if seqs:
        ring, alst = find(rows, impl="ring", seq=seqs[-1]), find(rows, impl="alst", seq=seqs[-1])
        text = f"ring uses less memory per rank than ALST, {fmt_seq(seqs[-1])}"
        out += compare(text, ring, alst, "peak_mib", lambda x: x < 1.0, " step MiB/rank (ds_ring ring vs ALST)")
    return out


def report(session: Session) -> str:
    rows = session.rows
    alst = lambda r: find(rows, impl="alst", seq=r.case.seq)
    return driver.markdown_table(rows, [
        "impl", "seq", "procs × threads", Column("step s", lambda r: r.fwdbwd_s, "{:.3f}"),
        "tokens/s", Column("tokens/s ÷ ALST", lambda r: ratio(alst(r), r), "{:.2f}"),
        Column("step MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
        Column("step MiB ÷ ALST", lambda r: ratio(r, alst(r), "peak_mib"), "{:.2f}"),
        Column("process peak MiB/rank", lambda r: r.largest("peak_rss_mib"), "{:.0f}"),
        Column("CPU s/step", lambda r: r.largest("cpu_s_per_step"), "{:.3f}"), "other load %", "notes",
    ])  # fmt: skip


BENCHMARK = driver.Benchmark(
    name="hf", module="benchmarks.hf", title="HF Llama training steps: ds_ring strategies vs DeepSpeed ALST, p = 2",
    plan=plan, build=build, report=report, targets=targets, label=lambda case: LABELS[case.impl],
    seqs=([4096, 8192, 16384], [2048, 4096]), impls=list(LABELS),
    plots=lambda s: driver.plot_rows(s, lambda r: "", "HF Llama training step, 2 ranks × 1 thread, batch 1, fp32", [
        ("throughput", "tokens/s (whole job)", [("", lambda r: r.tokens_per_s, "-o")]),
        ("memory", "step working memory, largest rank (MiB)", [("", lambda r: r.peak_mib, "-o")])], logy=False),
    flop=lambda case: MODEL.layers * driver.useful_gflop(case), packages=("deepspeed", "transformers"), calls=3,
    rank=train_rank,
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(driver.main(BENCHMARK))
