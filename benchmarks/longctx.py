"""Whole-model long context (issue 22): step memory and tokens/s of a Llama-shaped model, ds_ring vs DeepSpeed ALST.

``python -m benchmarks.longctx [--quick] [--seqs 2048 4096 8192] [--vocabs 32000 128256] [--impls ...]``; the model,
the implementations and the derived figures (slope, fits 8 GiB): ``benchmarks/SUITE.md``.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from benchmarks.cases import Case, useful_gflop
from benchmarks.common import fmt_seq
from benchmarks.driver import Benchmark, Session, main
from benchmarks.hf import STEP_FIGURES, alst_engine, ds_ring_engine, rank_env, step_columns, train_rank
from benchmarks.rows import Column, Row, Target, compare, find, markdown_table, plot_rows

LABELS = {"plain": "ds_ring ring", "long_context": "ds_ring long_context",
          "long_context+disk": "ds_ring long_context + disk", "alst": "ALST tutorial (checkpointing)",
          "alst full": "ALST full recipe"}  # fmt: skip
MODEL = SimpleNamespace(hidden=256, intermediate=1024, layers=4, heads=8, kv_heads=4, seed=0)
TILE_TOKENS = 512
VOCABS = (32000, 128256)
BUDGET_MIB = 8 * 1024
LR = 1e-4


def _vocab(case: Case) -> int:
    return int(case.tag)


def _case(impl: str, seq: int, vocab: int) -> Case:
    ours = not impl.startswith("alst")
    return Case(impl, seq, world=2, heads=MODEL.heads, head_dim=MODEL.hidden // MODEL.heads,
                layout="zigzag" if ours else "contiguous", ulysses=1 if ours else 2, tag=str(vocab))  # fmt: skip


def _model_and_batch(case: Case) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from launch.train_hf import RecallDataset

    torch.manual_seed(MODEL.seed)
    config = LlamaConfig(
        vocab_size=_vocab(case), hidden_size=MODEL.hidden, intermediate_size=MODEL.intermediate,
        num_hidden_layers=MODEL.layers, num_attention_heads=MODEL.heads, num_key_value_heads=MODEL.kv_heads,
        max_position_embeddings=case.seq, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    input_ids = RecallDataset(1, case.seq, MODEL.seed)[0]["input_ids"].unsqueeze(0)
    return LlamaForCausalLM(config), {"input_ids": input_ids, "labels": input_ids}  # every token counted


def _ds_ring_step(case: Case) -> Callable[[], None]:
    from ds_ring.integrations.hf import causal_lm_loss

    model, batch = _model_and_batch(case)
    section: dict[str, Any] = {"strategy": "ring"}
    if case.impl != "plain":
        section["long_context"] = {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": TILE_TOKENS}
        model.gradient_checkpointing_enable()
    if case.impl == "long_context+disk":
        section["long_context"].update(offload_checkpoints="disk", offload_dir=tempfile.gettempdir())
    engine, session, inputs = ds_ring_engine(case, model, batch, section, LR)

    def step() -> None:
        out = engine(**inputs)
        loss = out.loss if out.loss is not None else causal_lm_loss(session, out.logits, inputs["shift_labels"])
        engine.backward(loss)
        engine.step()

    return step


def _tiled_mlp_forward(self: Any, x: Any) -> Any:
    """ALST's ``TiledMLP`` as its docstring patches it into ``LlamaMLP``: ``ceil(seq / hidden)`` shards."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = math.ceil(x.shape[-2] / x.shape[-1])
    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(lambda mlp, t: mlp.down_proj(mlp.act_fn(mlp.gate_proj(t)) * mlp.up_proj(t)), self, x, shards,
                          params)  # fmt: skip


def _alst_step(case: Case, rank: int) -> Callable[[], None]:
    import torch.distributed.nn.functional as dist_nn
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    from transformers.models.llama import modeling_llama

    full = case.impl == "alst full"
    if full:
        modeling_llama.LlamaMLP.forward = _tiled_mlp_forward
    model, batch = _model_and_batch(case)
    model.gradient_checkpointing_enable()
    engine, group, sp, input_ids, position_ids, shift_labels = alst_engine(case, rank, model, batch, LR)
    vocab, lm = _vocab(case), engine.module

    def summed_loss(head: Any, hidden: Any, targets: Any) -> Any:
        return F.cross_entropy(head.lm_head(hidden).view(-1, vocab), targets.view(-1), reduction="sum")

    def step() -> None:
        tokens = (shift_labels != -100).sum()
        if full:
            hidden = lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
            shards = math.ceil(hidden.shape[1] / TILE_TOKENS)
            local = TiledFusedLogitsLoss.apply(summed_loss, lm, hidden, shift_labels, None, shards,
                                               [lm.lm_head.weight], "sum")  # fmt: skip
        else:
            logits = engine(input_ids=input_ids, position_ids=position_ids).logits
            local = lm.loss_function(logits=logits, labels=None, shift_labels=shift_labels, vocab_size=vocab,
                                     num_items_in_batch=1)  # the sum: a rank may hold no counted token  # fmt: skip
        sums, counts = dist_nn.all_gather(local, group=group), dist_nn.all_gather(tokens, group=group)
        engine.backward(sum(sums) / max(sum(counts), 1) / sp)  # / sp: ALST's all-gather sums the group's gradients
        engine.step()

    return step


def build(case: Case, rank: int, timeout_s: float) -> Callable[[], None]:
    """One training step of ``case`` on this rank (the model, optimizer and shard built once here)."""
    rank_env(case, rank)
    return _alst_step(case, rank) if case.impl.startswith("alst") else _ds_ring_step(case)


def plan(session: Session) -> None:
    for vocab in session.args.vocabs:
        seqs = session.args.seqs if vocab <= VOCABS[0] else [seq // 2 for seq in session.args.seqs]
        for seq in seqs:
            for impl in session.args.impls:
                session.run(_case(impl, seq, vocab))


def slope_and_fit(rows: list[Row], impl: str, vocab: int) -> tuple[float | None, int | None]:
    """Step MiB per 1K tokens per rank between the shortest and the longest length measured, and the longest
    sequence (total tokens, 2 ranks) whose RSS before the step + the fitted step MiB fit ``BUDGET_MIB``."""
    series = sorted((r for r in rows if r.case.impl == impl and _vocab(r.case) == vocab and r.peak_mib),
                    key=lambda r: r.case.seq)  # fmt: skip
    if len(series) < 2:
        return None, None
    first, last = series[0], series[-1]
    per_rank_k = lambda r: r.case.seq / r.case.world / 1000
    slope = (last.peak_mib - first.peak_mib) / (per_rank_k(last) - per_rank_k(first))
    if slope <= 0:
        return slope, None
    before = last.largest("rss_before_inputs_mib") or 0.0
    fit_k = per_rank_k(last) + (BUDGET_MIB - before - last.peak_mib) / slope
    return slope, int(fit_k * 1000 * last.case.world) if fit_k > 0 else 0


def targets(session: Session) -> list[Target]:
    out = []
    for r in session.rows:
        if r.case.impl != "long_context":
            continue
        alst = find(session.rows, impl="alst full", seq=r.case.seq, tag=r.case.tag)
        where = f"{fmt_seq(r.case.seq)}, vocab {r.case.tag}"
        out += compare(f"long_context step memory ≤ 0.8 × ALST full recipe, {where}", r, alst, "peak_mib",
                       lambda x: x <= 0.8, " step MiB/rank (long_context vs ALST full)")  # fmt: skip
        out += compare(f"long_context tokens/s ≥ ALST full recipe, {where}", alst, r, met=lambda x: x >= 1.0,
                       note=" step time (ALST full vs long_context)")  # fmt: skip
    return out


def report(session: Session) -> str:
    args, rows = session.args, session.rows
    alst = lambda r: find(rows, impl="alst full", seq=r.case.seq, tag=r.case.tag)
    table = markdown_table(rows, [
        Column("vocab", lambda r: r.case.tag), "impl", "seq", *step_columns(alst, "ALST full", "{:.2f}", "{:.0f}"),
        Column("RSS before step MiB", lambda r: r.largest("rss_before_inputs_mib"), "{:.0f}"), "other load %", "notes",
    ])  # fmt: skip
    session.extra["slopes"] = {f"{v} {i}": list(slope_and_fit(rows, i, v)) for v in args.vocabs for i in args.impls}
    slopes = [(key.split(" ", 1), *fit) for key, fit in session.extra["slopes"].items() if fit[0] is not None]
    return table + "\n\n" + markdown_table(slopes, [
        Column("vocab", lambda s: s[0][0]), Column("impl", lambda s: LABELS[s[0][1]]),
        Column("slope MiB per 1K tokens/rank", lambda s: s[1], "{:.1f}"),
        Column("fits 8 GiB/rank (tokens, 2 ranks)", lambda s: s[2], "{:,}"),
    ])  # fmt: skip


BENCHMARK = Benchmark(
    name="longctx", module="benchmarks.longctx",
    title="Whole-model long context: Llama 4 layers, hidden 256, 2 ranks — ds_ring vs DeepSpeed ALST",
    plan=plan, build=build, report=report, targets=targets, label=lambda case: f"{LABELS[case.impl]}, vocab {case.tag}",
    add_args=lambda p: p.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS), help="vocabulary sizes"),
    seqs=([2048, 4096, 8192], [1024, 2048]), impls=list(LABELS), calls=1, rank=train_rank,
    plots=lambda s: plot_rows(s, lambda r: f"vocab {r.case.tag}", "Llama 4×256 step, 2 ranks × 1 thread",
                              STEP_FIGURES, logy=False),
    flop=lambda case: MODEL.layers * useful_gflop(case), packages=("deepspeed", "transformers"),
)  # fmt: skip

if __name__ == "__main__":
    sys.exit(main(BENCHMARK))
