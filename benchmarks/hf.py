"""Training a Hugging Face model sequence-parallel: ds_ring's strategies vs DeepSpeed's ALST (``benchmarks/SUITE.md``).

``python -m benchmarks.hf [--quick] [--seqs 4096 8192 16384] [--impls ...] [--out DIR]``. The training set-up both
ds_ring and ALST use here (:func:`ds_ring_engine`, :func:`alst_engine`, :func:`train_rank`) serves
:mod:`benchmarks.longctx` too.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from benchmarks.cases import Case, Protocol, RankResult, useful_gflop
from benchmarks.common import MIB, current_rss_bytes, fmt_seq, measure, release_free_memory
from benchmarks.driver import Benchmark, Session, main
from benchmarks.rows import Column, Figure, Row, Target, compare, find, markdown_table, plot_rows, ratio

LABELS = {"ulysses": "ds_ring Ulysses", "ring": "ds_ring ring (zigzag)", "hybrid": "ds_ring hybrid U2×R1",
          "ring dilated": "ds_ring ring dilated", "alst": "DeepSpeed ALST (UlyssesSPAttentionHF)"}  # fmt: skip
MODEL = SimpleNamespace(dim=64, layers=2, heads=4, kv_heads=2, init_std=0.2, seed=0)
"""``launch/train_hf.py``'s default model (with its default vocabulary, the task's)."""
LR = 3e-3
STEP_FIGURES: list[Figure] = [
    ("throughput", "tokens/s (whole job)", [("", lambda r: r.tokens_per_s, "-o")]),
    ("memory", "step working memory, largest rank (MiB)", [("", lambda r: r.peak_mib, "-o")]),
]
"""The plots of a training benchmark: ``<name>_throughput.png`` and ``<name>_memory.png``."""


def _case(impl: str, seq: int) -> Case:
    dilated = impl == "ring dilated"
    return Case(
        impl, seq, world=2, heads=MODEL.heads, head_dim=MODEL.dim // MODEL.heads,
        layout="zigzag" if impl == "ring" else "contiguous", ulysses=2 if impl in ("ulysses", "hybrid") else 1,
        segment_lengths=(seq // 8, seq // 2, seq) if dilated else None, dilation_rates=(1, 2, 4) if dilated else None,
        tag="dilated" if dilated else "dense",
    )  # fmt: skip


def zero0(case: Case, **more: Any) -> dict[str, Any]:
    """The DeepSpeed config of every training benchmark: ZeRO 0, no clipping, ``case.batch`` per rank; ``more``."""
    return {"train_micro_batch_size_per_gpu": case.batch, "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, **more}  # fmt: skip


def ds_ring_engine(case: Case, model: Any, batch: dict[str, Any], section: dict[str, Any], lr: float) -> Any:
    """``ds_ring.initialize`` (AdamW, ``section`` as ``ring_attention``) with the model registered with transformers:
    (engine, the session, this rank's ``shard_batch`` of ``batch``); the section's ``long_context`` applied."""
    import torch

    import ds_ring
    from ds_ring.integrations.hf import register_with_transformers, shard_batch

    config = zero0(case, ring_attention={"timeout_s": 600, "layout": case.layout, **section})
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config=config, seq_len=case.seq)
    session = register_with_transformers(model, config=config, topology=engine.mpu)
    session.apply_long_context(model)
    return engine, session, shard_batch(session, batch)


def alst_engine(case: Case, rank: int, model: Any, batch: dict[str, Any], lr: float) -> Any:
    """DeepSpeed 0.19's ALST as its tutorial sets it up: ``UlyssesSPAttentionHF`` (core ``sdpa``), AdamW,
    ``deepspeed.initialize(mpu=...)``; contiguous shards with global ``position_ids`` and the adapter's
    ``shift_labels``: (engine, the sequence-parallel group, its size, input_ids, position_ids, shift_labels)."""
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=case.world,
        micro_batch_size=case.batch, seq_length=case.seq, seq_length_is_variable=True,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero0(case), mpu=mpu)
    group, sp = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_world_size()
    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # the adapter's shift_labels
    positions = torch.arange(case.seq).expand(case.batch, -1)
    shard = slice(rank * case.seq // sp, (rank + 1) * case.seq // sp)
    return engine, group, sp, *(x[:, shard] for x in (batch["input_ids"], positions, labels))


def rank_env(case: Case, rank: int) -> None:
    """The environment DeepSpeed reads in a rank process (CPU accelerator, this rank of ``case.world``)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case.world), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _model_and_batch(case: Case) -> tuple[Any, dict[str, Any]]:
    import torch

    from launch.train import VOCAB
    from launch.train_hf import RecallDataset, build_model

    torch.manual_seed(MODEL.seed)
    model = build_model(SimpleNamespace(**vars(MODEL), vocab=VOCAB, seq=case.seq))
    items = [RecallDataset(case.batch, case.seq, MODEL.seed)[i] for i in range(case.batch)]
    return model, {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _ds_ring_step(case: Case) -> Callable[[], None]:
    from ds_ring.integrations.hf import causal_lm_loss

    section: dict[str, Any] = {"sequence_parallel_size": case.world, "strategy": case.impl.split()[0]}
    if case.impl == "hybrid":
        section.update(ulysses_degree=case.ulysses, ring_degree=case.world // case.ulysses)
    if case.segment_lengths is not None:
        section.update(segment_lengths=list(case.segment_lengths), dilation_rates=list(case.dilation_rates))
    engine, session, inputs = ds_ring_engine(case, *_model_and_batch(case), section, LR)
    shift_labels = inputs.pop("shift_labels")

    def step() -> None:
        engine.backward(causal_lm_loss(session, engine(**inputs).logits, shift_labels))
        engine.step()

    return step


def _alst_step(case: Case, rank: int) -> Callable[[], None]:
    """Per-rank mean losses all-gathered with autograd and weighted by token counts, divided by the
    sequence-parallel size before ``backward`` so that the gradients are the whole model's (without: 2×)."""
    import torch.distributed.nn.functional as dist_nn

    engine, group, sp, input_ids, position_ids, shift_labels = alst_engine(case, rank, *_model_and_batch(case), LR)

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
    rank_env(case, rank)
    return _alst_step(case, rank) if case.impl == "alst" else _ds_ring_step(case)


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
    release_free_memory()
    result.rss_before_inputs_mib = current_rss_bytes() / MIB
    cpu0 = time.process_time()
    result.fwdbwd = measure(step, calls=protocol.calls)
    result.cpu_s_per_step = (time.process_time() - cpu0) / len(result.fwdbwd.times_s)
    return result


def step_columns(ref: Callable[[Row], Row | None], name: str, seconds: str, mib: str) -> list[Column | str]:
    """Step time, tokens/s and step memory per rank, and the two against ``ref(row)`` (called ``name``)."""
    return [
        Column("step s", lambda r: r.fwdbwd_s, seconds), "tokens/s",
        Column(f"tokens/s ÷ {name}", lambda r: ratio(ref(r), r), "{:.2f}"),
        Column("step MiB/rank", lambda r: r.peak_mib, mib),
        Column(f"step MiB ÷ {name}", lambda r: ratio(r, ref(r), "peak_mib"), "{:.2f}"),
    ]  # fmt: skip


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
    alst = lambda r: find(session.rows, impl="alst", seq=r.case.seq)
    return markdown_table(session.rows, [
        "impl", "seq", "procs × threads", *step_columns(alst, "ALST", "{:.3f}", "{:.1f}"),
        Column("process peak MiB/rank", lambda r: r.largest("peak_rss_mib"), "{:.0f}"),
        Column("CPU s/step", lambda r: r.largest("cpu_s_per_step"), "{:.3f}"), "other load %", "notes",
    ])  # fmt: skip


BENCHMARK = Benchmark(
    name="hf", module="benchmarks.hf", title="HF Llama training steps: ds_ring strategies vs DeepSpeed ALST, p = 2",
    plan=plan, build=build, report=report, targets=targets, label=lambda case: LABELS[case.impl],
    seqs=([4096, 8192, 16384], [2048, 4096]), impls=list(LABELS), calls=3, rank=train_rank,
    plots=lambda s: plot_rows(s, lambda r: "", "HF Llama training step, 2 ranks × 1 thread, batch 1, fp32",
                              STEP_FIGURES, logy=False),
    flop=lambda case: MODEL.layers * useful_gflop(case), packages=("deepspeed", "transformers"),
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(main(BENCHMARK))
