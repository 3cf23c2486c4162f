"""Training an HF Llama, ds_ring vs DeepSpeed's ALST: ``benchmarks.hf`` and ``.longctx`` (``benchmarks/SUITE.md``)."""

import itertools
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import deepspeed
import torch
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF
from torch.utils.data import default_collate
from transformers.models.llama import modeling_llama

import ds_ring
from benchmarks.common import Case, RankResult, measure, useful_gflop
from benchmarks.driver import MEMORY, Benchmark, Column, Row, Session, find, main, markdown_table, plot_rows, ratio
from ds_ring.integrations.hf import causal_lm_loss, register_with_transformers, shard_batch
from launch.train import VOCAB
from launch.train_hf import RecallDataset, build_model

LABELS = {"ulysses": "ds_ring Ulysses", "ring": "ds_ring ring (zigzag)", "hybrid": "ds_ring hybrid U2×R1",
          "ring dilated": "ds_ring ring dilated", "alst": "DeepSpeed ALST (UlyssesSPAttentionHF)"}  # fmt: skip
LONG_LABELS = {"plain": "ds_ring ring", "long_context": "ds_ring long_context",
               "long_context+disk": "ds_ring long_context + disk", "alst": "ALST tutorial (checkpointing)",
               "alst full": "ALST full recipe"}  # fmt: skip
MODEL = SimpleNamespace(model_type="llama", dim=64, layers=2, heads=4, kv_heads=2, init_std=0.2, seed=0, lr=3e-3)
LONG_MODEL = SimpleNamespace(model_type="llama", dim=256, layers=4, heads=8, kv_heads=4, init_std=0.02, seed=0, lr=1e-4)
TILE_TOKENS, VOCABS, BUDGET_MIB = 512, (32000, 128256), 8 * 1024
REFERENCES = {  # per benchmark: the reference's name in the tables, the fields of a row's reference case
    "hf": ("ALST", lambda r: {"impl": "alst"}),
    "compiled": ("eager", lambda r: {"impl": r.case.impl.removesuffix(" compiled")}),
    "longctx": ("ALST full", lambda r: {"impl": "alst full", "tag": r.case.tag}),
}
STEP_FIGURES = [("throughput", "tokens/s (whole job)", [("", lambda r: r.tokens_per_s, "-o")]), MEMORY]


def zero0(case: Case, **more: Any) -> dict[str, Any]:
    """The DeepSpeed config of every training benchmark: ZeRO 0, no clipping, ``case.batch`` per rank."""
    return {"train_micro_batch_size_per_gpu": case.batch, "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, **more}  # fmt: skip


def _ds_ring_step(case: Case, model: Any, optimizer: Any, batch: dict, section: dict, compiled: bool) -> Any:
    """One step of ``ds_ring.initialize`` (``section`` as ``ring_attention``; ``compiled``: ``engine.compile()``)."""
    config = zero0(case, ring_attention={"timeout_s": 600, "layout": case.layout, **section})
    engine, *_ = ds_ring.initialize(model=model, optimizer=optimizer, config=config, seq_len=case.seq)
    session = register_with_transformers(model, config=config, topology=engine.mpu)
    session.apply_long_context(model)
    if compiled:
        engine.compile(backend="inductor")
    inputs = shard_batch(session, batch)

    def step() -> None:
        out = engine(**inputs)
        loss = out.loss if out.loss is not None else causal_lm_loss(session, out.logits, inputs["shift_labels"])
        engine.backward(loss)
        engine.step()

    return step


def _tiled_mlp_forward(self: Any, x: Any) -> Any:
    """ALST's ``TiledMLP`` as its docstring patches it into ``LlamaMLP``."""
    mlp = lambda self, x: self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp, self, x, math.ceil(x.shape[-2] / x.shape[-1]), params)  # ceil(seq / hidden) shards


def _alst_step(case: Case, rank: int, model: Any, optimizer: Any, batch: dict[str, Any], full: bool) -> Any:
    """DeepSpeed 0.19's ALST as its tutorial runs it; ``full``: its tiled loss (and ``TiledMLP``) too (SUITE.md)."""
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=case.world,
        micro_batch_size=case.batch, seq_length=case.seq, seq_length_is_variable=True,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero0(case), mpu=mpu)
    group, sp = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_world_size()
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # the adapter's shift_labels
    positions = torch.arange(case.seq).expand(case.batch, -1)
    input_ids, position_ids, shift_labels = (x.chunk(sp, 1)[rank] for x in (batch["input_ids"], positions, labels))
    lm, vocab = engine.module, engine.module.config.vocab_size
    summed_loss = lambda head, hidden, targets: F.cross_entropy(head.lm_head(hidden).view(-1, vocab), targets.view(-1),
                                                                reduction="sum")  # fmt: skip

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
        engine.backward(sum(sums) / max(sum(counts), 1) / sp)
        engine.step()

    return step


def build(case: Case, rank: int, timeout_s: float) -> Callable[[], None]:
    """One training step of a case on this rank (``launch/train_hf.py``'s model, a recall batch; SUITE.md)."""
    long = case.tag.isdigit()  # a LONGCTX case: its tag is the vocabulary
    spec, impl, compiled = LONG_MODEL if long else MODEL, case.impl.removesuffix(" compiled"), "compiled" in case.impl
    if impl == "alst full":
        modeling_llama.LlamaMLP.forward = _tiled_mlp_forward
    torch.manual_seed(spec.seed)
    model = build_model(SimpleNamespace(**vars(spec), vocab=int(case.tag) if long else VOCAB, seq=case.seq))
    batch = default_collate([RecallDataset(case.batch, case.seq, spec.seed)[i] for i in range(case.batch)])
    if long:  # the loss counts every token, as in pre-training
        batch["labels"] = batch["input_ids"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    if long and impl != "plain":
        model.gradient_checkpointing_enable()
    if impl.startswith("alst"):
        return _alst_step(case, rank, model, optimizer, batch, full=impl == "alst full")
    if impl == "one process":
        forward = torch.compile(model, backend="inductor", fullgraph=True) if compiled else model

        def step() -> None:
            forward(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return step
    section: dict[str, Any] = {"sequence_parallel_size": case.world, "strategy": "ring" if long else impl.split()[0]}
    if impl == "hybrid":
        section.update(ulysses_degree=case.ulysses, ring_degree=case.world // case.ulysses)
    if case.segment_lengths is not None:
        section.update(segment_lengths=list(case.segment_lengths), dilation_rates=list(case.dilation_rates))
    if impl.startswith("long_context"):
        disk = {"offload_checkpoints": "disk", "offload_dir": tempfile.gettempdir()} if impl.endswith("disk") else {}
        section["long_context"] = {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": TILE_TOKENS, **disk}
    return _ds_ring_step(case, model, optimizer, batch, section, compiled)


@dataclass
class StepResult(RankResult):
    cpu_s_per_step: float | None = None


def train_rank(rank: int, world: int, case: Case, build: Callable[..., Any], calls: int, timeout_s: float) -> Any:
    """Rank function (DeepSpeed's environment): the step built, one warm-up, timed steps and their CPU s per step."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    result = StepResult(threads=torch.get_num_threads())
    step = build(case, rank, timeout_s)
    step()
    cpu0 = time.process_time()
    result.fwdbwd = measure(step, calls=calls)  # its baseline: the RSS before them, after gc and malloc_trim
    result.rss_before_inputs_mib = result.fwdbwd.baseline_rss_mib
    result.cpu_s_per_step = (time.process_time() - cpu0) / len(result.fwdbwd.times_s)
    return result


def plan(session: Session) -> None:
    """Every (length, impl) of :data:`BENCHMARK` or :data:`COMPILE` on 2 ranks (``one process``: 1; SUITE.md)."""
    for seq, impl in itertools.product(session.args.seqs, session.args.impls):
        strategy, dilated = impl.split()[0], impl == "ring dilated"
        branches = {"segment_lengths": (seq // 8, seq // 2, seq), "dilation_rates": (1, 2, 4)} if dilated else {}
        tag = ("dilated" if dilated else "dense") if session.bench.name == "hf" else ""
        zigzag, ulysses = impl.removesuffix(" compiled") == "ring", strategy in ("ulysses", "hybrid")
        session.run(Case(impl, seq, world=1 if strategy == "one" else 2, heads=MODEL.heads, **branches,
                         head_dim=MODEL.dim // MODEL.heads, tag=tag, ulysses=2 if ulysses else 1,
                         layout="zigzag" if zigzag else "contiguous"))  # fmt: skip


def report(session: Session) -> str:
    """Every step against its benchmark's reference step of the same length (:data:`REFERENCES`)."""
    name, fields = REFERENCES[session.bench.name]
    ref = lambda r: find(session.rows, seq=r.case.seq, **fields(r))
    return markdown_table(session.rows, [
        "impl", "seq", "procs × threads", Column("step s", lambda r: r.fwdbwd_s, "{:.3f}"), "tokens/s",
        Column(f"tokens/s ÷ {name}", lambda r: ratio(ref(r), r), "{:.2f}"),
        Column("step MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
        Column(f"step MiB ÷ {name}", lambda r: ratio(r, ref(r), "peak_mib"), "{:.2f}"),
        Column("RSS before step MiB", lambda r: r.largest("rss_before_inputs_mib"), "{:.0f}"),
        Column("process peak MiB/rank", lambda r: r.largest("peak_rss_mib"), "{:.0f}"),
        Column("CPU s/step", lambda r: r.largest("cpu_s_per_step"), "{:.3f}"), "other load %", "notes",
    ])  # fmt: skip


def plan_long(session: Session) -> None:
    for vocab in session.args.vocabs:
        for seq in session.args.seqs if vocab <= VOCABS[0] else [seq // 2 for seq in session.args.seqs]:
            for impl in session.args.impls:
                ours, dim = not impl.startswith("alst"), LONG_MODEL.dim // LONG_MODEL.heads
                session.run(Case(impl, seq, world=2, heads=LONG_MODEL.heads, head_dim=dim, tag=str(vocab),
                                 layout="zigzag" if ours else "contiguous", ulysses=1 if ours else 2))  # fmt: skip


def slope_and_fit(rows: list[Row], impl: str, vocab: int) -> tuple[float | None, int | None]:
    """Step MiB per 1K tokens per rank (shortest to longest length); the longest sequence within ``BUDGET_MIB``."""
    series = sorted((r for r in rows if r.case.impl == impl and r.case.tag == str(vocab) and r.peak_mib),
                    key=lambda r: r.case.seq)  # fmt: skip
    if len(series) < 2:
        return None, None
    first, last = series[0], series[-1]
    k0, k1 = (r.case.seq / r.case.world / 1000 for r in (first, last))  # thousands of tokens per rank
    slope = (last.peak_mib - first.peak_mib) / (k1 - k0)
    if slope <= 0:
        return slope, None
    fit_k = k1 + (BUDGET_MIB - (last.largest("rss_before_inputs_mib") or 0.0) - last.peak_mib) / slope
    return slope, max(0, int(fit_k * 1000 * last.case.world))


def report_long(session: Session) -> str:
    """:func:`report`, then each (vocabulary, impl)'s :func:`slope_and_fit` (also in the JSON, ``slopes``)."""
    args = session.args
    fits = [(vocab, impl, *slope_and_fit(session.rows, impl, vocab)) for vocab in args.vocabs for impl in args.impls]
    session.extra["slopes"] = {f"{vocab} {impl}": [slope, fit] for vocab, impl, slope, fit in fits}
    return report(session) + "\n\n" + markdown_table([f for f in fits if f[2] is not None], [
        Column("vocab", lambda f: f[0]), Column("impl", lambda f: LONG_LABELS[f[1]]),
        Column("slope MiB per 1K tokens/rank", lambda f: f[2], "{:.1f}"),
        Column("fits 8 GiB/rank (tokens, 2 ranks)", lambda f: f[3], "{:,}"),
    ])  # fmt: skip


BENCHMARK = Benchmark(
    name="hf", module="benchmarks.hf", title="HF Llama training steps: ds_ring strategies vs DeepSpeed ALST, p = 2",
    plan=plan, build=build, report=report, label=lambda case: LABELS[case.impl],
    seqs=([4096, 8192, 16384], [2048, 4096]), impls=list(LABELS), calls=3, rank=train_rank,
    plots=lambda s: plot_rows(s, lambda r: "", "HF Llama training step, 2 ranks × 1 thread, batch 1, fp32",
                              STEP_FIGURES, logy=False),
    flop=lambda case: MODEL.layers * useful_gflop(case), packages=("deepspeed", "transformers"),
)  # fmt: skip
COMPILE_LABELS = {"one process": "no sequence parallelism (1 process)", "ring": "ds_ring ring (zigzag)",
                  "ulysses": "ds_ring Ulysses"}  # fmt: skip
COMPILE = replace(
    BENCHMARK, name="compiled",
    title="HF Llama training step, eager vs torch.compile (inductor): ds_ring p = 2 vs one process",
    label=lambda case: COMPILE_LABELS[case.impl.removesuffix(" compiled")] + (" compiled" * case.impl.endswith("d")),
    seqs=([2048, 4096], [2048]), impls=[f"{i}{c}" for i in COMPILE_LABELS for c in ("", " compiled")],
    plots=lambda s: None,
)  # fmt: skip
LONGCTX = replace(
    BENCHMARK, name="longctx", module="benchmarks.longctx",
    title="Whole-model long context: Llama 4 layers, hidden 256, 2 ranks — ds_ring vs DeepSpeed ALST",
    plan=plan_long, report=report_long,
    label=lambda case: f"{LONG_LABELS[case.impl]}, vocab {case.tag}",
    add_args=lambda p: p.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS), help="vocabulary sizes"),
    seqs=([2048, 4096, 8192], [1024, 2048]), impls=list(LONG_LABELS), calls=1,
    plots=lambda s: plot_rows(s, lambda r: f"vocab {r.case.tag}", "Llama 4×256 step, 2 ranks × 1 thread",
                              STEP_FIGURES, logy=False),
    flop=lambda case: LONG_MODEL.layers * useful_gflop(case),
)  # fmt: skip
if __name__ == "__main__":  # --compiled: issue 44's eager vs compiled steps (docs/performance.md)
    argv = sys.argv[1:]
    raise SystemExit(main(COMPILE if "--compiled" in argv else BENCHMARK, [a for a in argv if a != "--compiled"]))
