"""The benchmark suite (issue 8): every figure of ds_ring's sequence parallelism in one run.

    python -m benchmarks [--quick] [--out DIR]

One run measures, on the same machine and in the same minutes (so the ratios are meaningful),
dense causal attention over ``S`` total tokens (full: 32K; ``--quick``: 4K), batch 1, 8 heads,
head_dim 64, fp32, ranks = processes × 1 torch thread, gloo over loopback
(:mod:`benchmarks.ranks`):

1. **Scaling** — ring, all-gather, Ulysses and hybrid (Ulysses 2 × ring p/2) on p = 1, 2, 4, 8
   ranks, zigzag shards: per-rank peak working memory of forward+backward, time, tokens/s. p = 1
   is one rank with no communication (the same computation for every strategy).
2. **Communication overlap** of the ring: a hook on ds_ring's ``ring_step`` events
   (``ds_ring.hooks.register_hook``) sums the seconds each rank spends *blocked* in ring waits;
   ``compute = wall − blocked`` per rank, and ``wall ÷ compute = slowest rank's wall ÷ largest
   compute``: 1.00 means every transfer was hidden behind computation.
3. **Strong scaling**: p ranks on p cores against 1 rank on 1 core, same ``S`` (only p ≤ cores is
   meaningful; p > cores is reported with the oversubscription flagged).
4. **Single process**: dense SDPA and ``ds_ring.dilated_attention`` (``w = S/16 · [1, 2, 4]``, i.e.
   ``[2048, 4096, 8192]`` at 32K, ``r = [1, 2, 4]``), 1 and 2 threads, and dilated-attention-pytorch
   on the same branches (2 threads; its xformers call mapped to SDPA by ``benchmarks.dilated``).
5. **Existing libraries** on the same shapes at p = 2: ring-attention-pytorch (ring), DeepSpeed's
   ``DistributedAttention`` (Ulysses), PyTorch ``context_parallel`` (not runnable on CPU: the row
   records the error), next to ds_ring ring and Ulysses on contiguous shards as the libraries use
   (and the zigzag rows of section 1; the faster of the two layouts is compared).
6. **Largest total length in a per-rank memory budget** (full: 512 MiB, quick: 96 MiB of working
   memory per rank) at p = 4 for each strategy: a search over multiples of a step (full 4096,
   quick 1024 tokens), each probe one forward+backward in fresh processes, seeded by the scaling
   row and interpolating linearly between probes; reports the largest length measured to fit
   and the smallest measured not to.

Writes ``DIR/suite.json`` (machine, versions, date, config, every row with every rank's raw
numbers, targets), ``suite_memory.png``, ``suite_time.png``, ``suite_libraries.png`` and prints the
tables and the targets (reported, never asserted).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.dilated import pairs_dap, pairs_ds_ring
from benchmarks.harness import Column, Series, fmt_seq, markdown_table, plot_panels, write_json
from benchmarks.ranks import Throughput, base_report, finish_report, format_header, format_targets
from benchmarks.ring import (
    BATCH,
    HEAD_DIM,
    HEADS,
    RAP_PACKAGE,
    add_common_args,
    gflop_from_pairs,
    label_rows,
    resolve_common_args,
    run_row,
)
from benchmarks.strategies import run_strategy

STRATEGIES = ["ring", "allgather", "ulysses", "hybrid"]
DILATION_RATES = [1, 2, 4]
MODES: dict[str, dict[str, Any]] = {
    "full": {"seq": 32768, "worlds": [1, 2, 4, 8], "budget_mib": 512.0, "fit_step": 4096, "fit_probes": 5},
    "quick": {"seq": 4096, "worlds": [1, 2, 4, 8], "budget_mib": 96.0, "fit_step": 1024, "fit_probes": 3},
}
"""Sizes per mode: total tokens, rank counts, per-rank memory budget (MiB), search step and probes."""
FIT_WORLD = 4
LABELS = {
    "ring": "ds_ring ring (zigzag)",
    "allgather": "ds_ring all-gather (zigzag)",
    "ulysses": "ds_ring Ulysses (zigzag)",
    "hybrid": "ds_ring hybrid U2×R(p/2) (zigzag)",
    "ring_contiguous": "ds_ring ring (contiguous)",
    "ulysses_contiguous": "ds_ring Ulysses (contiguous)",
    "rap": "ring-attention-pytorch 0.5.20 (ring)",
    "deepspeed": "DeepSpeed DistributedAttention + SDPA",
    "torch_cp": "PyTorch context_parallel + SDPA",
    "sdpa_1t": "dense SDPA, 1 process × 1 thread",
    "sdpa_2t": "dense SDPA, 1 process × 2 threads",
    "dilated_1t": "ds_ring.dilated_attention, 1 × 1 thread",
    "dilated_2t": "ds_ring.dilated_attention, 1 × 2 threads",
    "dap_2t": "dilated-attention-pytorch 0.2.0, 1 × 2 threads",
}
COLORS = {"ring": "tab:blue", "allgather": "tab:orange", "ulysses": "tab:green", "hybrid": "tab:purple"}


def dilated_branches(seq: int) -> list[int]:
    """Segment lengths of the single-process dilated rows: ``seq/16 · [1, 2, 4]`` (32K: 2048, 4096, 8192)."""
    return [seq // 16, seq // 8, seq // 4]


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------


def scaling(mode: dict[str, Any], args: argparse.Namespace, tp: Throughput, seen: dict) -> list[dict[str, Any]]:
    """Section 1-3: every strategy on every rank count, zigzag shards, dense causal, ``mode["seq"]`` tokens."""
    rows = []
    for p in mode["worlds"]:
        for impl in STRATEGIES:
            if (p == 1 and impl != "ring") or (impl == "hybrid" and p < 4):
                continue  # p = 1: one rank, no communication; hybrid needs ulysses 2 × ring >= 2
            ulysses = 2 if impl == "hybrid" else 1
            row = run_strategy(impl, mode["seq"], p, args, tp, seen, ulysses=ulysses, layout="zigzag")
            rows.append(_section(row, "scaling"))
    return rows


def single_process(mode: dict[str, Any], args: argparse.Namespace, tp: Throughput, seen: dict) -> list[dict[str, Any]]:
    """Section 4: dense SDPA, ds_ring dilated attention and dilated-attention-pytorch in one process."""
    seq, segs = mode["seq"], dilated_branches(mode["seq"])
    rows = []
    for key, single_impl, threads, dilated in (
        ("sdpa_1t", "dense", 1, False),
        ("sdpa_2t", "dense", 2, False),
        ("dilated_1t", "ds_ring", 1, True),
        ("dilated_2t", "ds_ring", 2, True),
        ("dap_2t", "dap", 2, True),
    ):
        branch = {"segment_lengths": segs, "dilation_rates": DILATION_RATES} if dilated else {}
        warm = {"seq": max(segs) if dilated else 1024, "segment_lengths": None, "dilation_rates": None, **branch}
        row = run_row(
            "single",
            seq,
            1,
            args,
            tp,
            seen,
            factory="benchmarks.ring_dilated:make_single",
            threads=threads,
            distributed=False,
            extra_cfg={"single_impl": single_impl},
            key=key,
            warmup=warm,
            **branch,
        )
        if single_impl == "dap":  # it splits the heads among the branches: ~1/3 of ds_ring's pairs here
            row["useful_gflop"] = gflop_from_pairs(pairs_dap(seq, HEADS, segs, DILATION_RATES, True))
            if row.get("fwdbwd_s"):
                row["gflops"] = row["useful_gflop"] / row["fwdbwd_s"]
        rows.append(_section(row, "single process"))
    return rows


def libraries(mode: dict[str, Any], args: argparse.Namespace, tp: Throughput, seen: dict) -> list[dict[str, Any]]:
    """Section 5: existing libraries at p = 2 on the same shapes, next to ds_ring ring and Ulysses on
    contiguous shards (the layout the libraries use)."""
    seq, p = mode["seq"], 2
    rows = [
        run_strategy("ring", seq, p, args, tp, seen, layout="contiguous", key="ring_contiguous"),
        run_row("rap", seq, p, args, tp, seen, layout="contiguous"),
        run_strategy("ulysses", seq, p, args, tp, seen, layout="contiguous", key="ulysses_contiguous"),
        run_strategy("deepspeed", seq, p, args, tp, seen, layout="contiguous"),
        run_row("torch_cp", seq, p, args, tp, seen),
    ]
    return [_section(r, "libraries") for r in rows]


def fit_search(
    impl: str,
    seed: dict[str, Any] | None,
    mode: dict[str, Any],
    args: argparse.Namespace,
    tp: Throughput,
    seen: dict,
) -> dict[str, Any]:
    """Section 6: the largest total length (a multiple of ``fit_step``) whose per-rank working memory at
    p = 4 stays within ``budget_mib``; every probe is one forward+backward in fresh rank processes.

    Candidates come from a straight line through the two nearest measurements (through the origin
    and the scaling row at first), kept strictly between the largest length known to fit and the
    smallest known not to; the search stops when they are one step apart or after ``fit_probes``.
    """
    budget, step = mode["budget_mib"], mode["fit_step"]
    points: list[tuple[int, float]] = []
    if seed and seed.get("peak_mib"):
        points.append((seed["seq"], seed["peak_mib"]))
    lo: tuple[int, float] | None = None  # the largest length measured to fit, and its MiB per rank
    hi: tuple[int, float] | None = None  # the smallest length measured not to fit
    for point in points:
        if point[1] <= budget:
            lo = point
        else:
            hi = point
    probes: list[dict[str, Any]] = []
    notes: list[str] = []
    for _ in range(mode["fit_probes"]):
        candidate = _next_candidate(points, lo, hi, budget, step)
        if candidate is None:
            break
        row = run_strategy(
            impl, candidate, FIT_WORLD, args, tp, seen, ulysses=2 if impl == "hybrid" else 1, layout="zigzag",
            key=f"fit_{impl}", calls=1,
        )  # fmt: skip
        probes.append({k: row.get(k) for k in ("seq", "peak_mib", "peak_mib_per_rank", "fwdbwd_s", "notes")})
        if not row.get("peak_mib"):
            notes.append(f"probe {fmt_seq(candidate)}: {row.get('notes')}")
            break
        points.append((candidate, row["peak_mib"]))
        if row["peak_mib"] <= budget:
            lo = (candidate, row["peak_mib"])
        else:
            hi = (candidate, row["peak_mib"])
    if lo and hi and hi[0] - lo[0] > step:
        notes.append(f"stopped after {mode['fit_probes']} probes: the limit lies between the two lengths")
    if hi is None:
        notes.append("no probe exceeded the budget: the largest length is at least the one shown")
    return {
        "impl": impl,
        "world": FIT_WORLD,
        "budget_mib": budget,
        "max_fit_seq": lo[0] if lo else None,
        "max_fit_mib": lo[1] if lo else None,
        "over_seq": hi[0] if hi else None,
        "over_mib": hi[1] if hi else None,
        "seed": {"seq": seed["seq"], "peak_mib": seed.get("peak_mib")} if seed else None,
        "probes": probes,
        "notes": "; ".join(notes),
    }


def _next_candidate(
    points: list[tuple[int, float]],
    lo: tuple[int, float] | None,
    hi: tuple[int, float] | None,
    budget: float,
    step: int,
) -> int | None:
    """Next length to probe (a multiple of ``step`` strictly inside (lo, hi)), or None when done."""
    floor, ceiling = (lo[0] if lo else 0), (hi[0] if hi else None)
    if ceiling is not None and ceiling - floor <= step:
        return None
    near = [lo, hi] if lo and hi else sorted(points, key=lambda p: abs(p[1] - budget))[:2]
    if len(near) == 2 and near[0][0] != near[1][0]:
        (s0, m0), (s1, m1) = near
        slope = (m1 - m0) / (s1 - s0)
        guess = s0 + (budget - m0) / slope if slope > 0 else (s0 + s1) / 2
    elif near:
        s0, m0 = near[0]
        guess = s0 * budget / m0
    else:
        guess = step
    candidate = int(guess // step) * step
    candidate = max(candidate, floor + step)
    if ceiling is not None:
        candidate = min(candidate, ceiling - step)
    return candidate if candidate > floor else None


def _section(row: dict[str, Any], section: str) -> dict[str, Any]:
    """Tag ``row`` with its table section and fill ``tokens_per_s`` (S ÷ fwd+bwd s); return it."""
    row["section"] = section
    if row.get("fwdbwd_s"):
        row.setdefault("tokens_per_s", row["seq"] / row["fwdbwd_s"])
    return row


# --------------------------------------------------------------------------------------
# Derived figures and targets
# --------------------------------------------------------------------------------------


def derive(rows: list[dict[str, Any]]) -> None:
    """Memory and speed relative to the 1-rank reference (ring at p = 1), in place."""
    ref = next((r for r in rows if r["section"] == "scaling" and r["world"] == 1), {})
    for r in rows:
        if r["section"] in ("scaling", "libraries") and r.get("peak_mib") and ref.get("peak_mib"):
            r["mem_vs_p1"] = r["peak_mib"] / ref["peak_mib"]
        if r.get("fwdbwd_s") and ref.get("fwdbwd_s"):
            r["speedup_vs_1rank"] = ref["fwdbwd_s"] / r["fwdbwd_s"]


def _get(rows: list[dict[str, Any]], impl: str, world: int | None = None) -> dict[str, Any]:
    """The first row of ``impl`` (on ``world`` ranks when given), or an empty dict."""
    return next((r for r in rows if r["impl"] == impl and (world is None or r["world"] == world)), {})


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str = "fwdbwd_s") -> float | None:
    """``b[key] / a[key]``: how many times faster ``a`` is than ``b`` (None when either is missing)."""
    return b[key] / a[key] if a.get(key) and b.get(key) else None


def targets(rows: list[dict[str, Any]], mode: dict[str, Any], cores: int) -> list[dict[str, Any]]:
    """Issue 8's targets, evaluated on this run (reported, not asserted)."""
    seq = mode["seq"]
    at = fmt_seq(seq) + ("" if seq == 32768 else " (the target is stated at 32K; this run uses " + fmt_seq(seq) + ")")
    out: list[dict[str, Any]] = []
    ring1, ring2, ring4 = _get(rows, "ring", 1), _get(rows, "ring", 2), _get(rows, "ring", 4)
    ag4 = _get(rows, "allgather", 4)
    if ring4.get("mem_vs_p1") is not None:
        side = f"; all-gather beside it: {ag4['mem_vs_p1']:.2f}" if ag4.get("mem_vs_p1") else ""
        out.append(
            {
                "target": f"ring per-rank peak memory at p=4 ≤ 0.30 × p=1, {fmt_seq(seq)}",
                "value": ring4["mem_vs_p1"],
                "met": ring4["mem_vs_p1"] <= 0.30,
                "detail": f"{ring4['peak_mib']:.0f} MiB vs {ring1['peak_mib']:.0f} MiB{side}",
            }
        )
    for r in rows:
        if r["impl"] == "ring" and r["section"] == "scaling" and r.get("overlap_ratio") is not None:
            over = r["world"] > cores
            out.append(
                {
                    "target": f"ring fwd+bwd ≤ 1.15 × its compute-only time, p={r['world']}",
                    "value": r["overlap_ratio"],
                    "met": None if over else r["overlap_ratio"] <= 1.15,
                    "detail": f"blocked in waits per rank {_fmt_list(r['blocked_s_per_rank'])} s of "
                    f"{r['fwdbwd_s'] * r['calls']:.2f} s"
                    + (
                        f" ({r['world']} ranks on {cores} cores: waits include time-slicing; info only)" if over else ""
                    ),
                }
            )
    speed = _ratio(ring2, ring1)
    if speed is not None:
        out.append(
            {
                "target": f"2 ranks on 2 cores ≥ 1.7× faster than 1 rank on 1 core, {at}",
                "value": speed,
                "met": speed >= 1.7 if cores >= 2 else None,
                "detail": f"ring zigzag {ring2['fwdbwd_s']:.2f} s vs {ring1['fwdbwd_s']:.2f} s; other load "
                f"{max(ring1.get('other_cpu_pct') or 0, ring2.get('other_cpu_pct') or 0):.0f}%",
            }
        )
    segs = dilated_branches(seq)
    bound = (seq * (seq + 1) // 2 * HEADS) / pairs_ds_ring(seq, HEADS, segs, DILATION_RATES, True)
    for t in (1, 2):
        x = _ratio(_get(rows, f"dilated_{t}t"), _get(rows, f"sdpa_{t}t"))
        if x is not None:
            out.append(
                {
                    "target": f"dilated w={segs} r={DILATION_RATES} ≥ 20× faster than dense causal, {at}, "
                    f"{t} thread(s)",
                    "value": x,
                    "met": x >= 20.0,
                    "detail": f"the useful-work ratio caps it at {bound:.1f}× (every head computes every branch: "
                    f"{pairs_ds_ring(seq, HEADS, segs, DILATION_RATES, True) / (HEADS * seq):.0f} key pairs per query "
                    f"vs {(seq + 1) / 2:.0f} dense)",
                }
            )
    out += _library_targets(rows)
    return out


def _library_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ "At least as fast as each existing library on the same shapes" (> 1 = ds_ring faster)."""
    out = []
    ring, ulysses = (
        min((r for r in (_get(rows, impl, 2), _get(rows, f"{impl}_contiguous", 2)) if r.get("fwdbwd_s")),
            key=lambda r: r["fwdbwd_s"], default={})
        for impl in ("ring", "ulysses")
    )  # fmt: skip
    pairs = [
        ("ring-attention-pytorch (ring, p=2)", ring, _get(rows, "rap", 2), ""),
        ("DeepSpeed DistributedAttention (Ulysses, p=2)", ulysses, _get(rows, "deepspeed", 2), ""),
        ("PyTorch context_parallel (p=2)", ring, _get(rows, "torch_cp", 2), ""),
    ]
    dap, dil = _get(rows, "dap_2t"), _get(rows, "dilated_2t")
    if dap.get("useful_gflop") and dil.get("useful_gflop"):
        work = dil["useful_gflop"] / dap["useful_gflop"]
        norm = f"; ds_ring does {work:.1f}× its useful work (dap splits the heads among the branches)"
        if _ratio(dil, dap):
            norm += f": per unit of work ds_ring is {_ratio(dil, dap) * work:.2f}× as fast"
        pairs.append(("dilated-attention-pytorch (single process, 2 threads)", dil, dap, norm))
    for name, ours, theirs, extra in pairs:
        x = _ratio(ours, theirs)
        if x is None:
            why = theirs.get("notes") or ours.get("notes") or "not measured"
            out.append({"target": f"at least as fast as {name}", "value": "n/a", "met": None, "detail": why[:400]})
            continue
        label = ours.get("label") or ours["impl"]
        out.append(
            {
                "target": f"at least as fast as {name}",
                "value": x,
                "met": x >= 1.0,
                "detail": f"{label} {ours['fwdbwd_s']:.2f} s vs {theirs['fwdbwd_s']:.2f} s{extra}",
            }
        )
    return out


def _fmt_list(values: list[float]) -> str:
    """``[0.01, 0.31]``: seconds with two decimals."""
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------

SCALING_COLUMNS = [
    Column("label", "strategy"),
    Column("world", "p"),
    Column("procs", "procs × threads"),
    Column("fwdbwd_s", "fwd+bwd s", "{:.2f}"),
    Column("tokens_per_s", "tokens/s", "{:.0f}"),
    Column("peak_mib", "peak MiB/rank", "{:.1f}"),
    Column("mem_vs_p1", "mem ÷ p=1", "{:.2f}"),
    Column("speedup_vs_1rank", "speed-up vs 1 rank", "{:.2f}"),
    Column("overlap_ratio", "wall ÷ compute", "{:.2f}"),
    Column("warmup_max_abs_err", "warm-up err", "{:.1e}"),
    Column("other_cpu_pct", "other load %", "{:.0f}"),
    Column("notes", "notes"),
]
OTHER_COLUMNS = [
    Column("label", "implementation"),
    Column("procs", "procs × threads"),
    Column("fwdbwd_s", "fwd+bwd s", "{:.2f}"),
    Column("tokens_per_s", "tokens/s", "{:.0f}"),
    Column("gflops", "useful GFLOP/s", "{:.1f}"),
    Column("peak_mib", "peak MiB/rank", "{:.1f}"),
    Column("speedup_vs_1rank", "speed-up vs 1 rank", "{:.2f}"),
    Column("warmup_max_abs_err", "warm-up err", "{:.1e}"),
    Column("other_cpu_pct", "other load %", "{:.0f}"),
    Column("notes", "notes"),
]
FIT_COLUMNS = [
    Column("label", "strategy"),
    Column("max_fit_seq", "largest S that fits", fmt_seq),
    Column("max_fit_mib", "its MiB/rank", "{:.1f}"),
    Column("over_seq", "smallest S over budget", fmt_seq),
    Column("over_mib", "its MiB/rank", "{:.1f}"),
    Column("n_probes", "probes"),
    Column("notes", "notes"),
]


def _plots(out: Path, rows: list[dict[str, Any]], fits: list[dict[str, Any]], mode: dict[str, Any]) -> list[Path]:
    """Memory and time vs rank count (one line per strategy), and bars for libraries and the fit search."""
    worlds = mode["worlds"]
    paths = []
    scal = [r for r in rows if r["section"] == "scaling"]
    ref = next((r for r in scal if r["world"] == 1), {})
    for name, key, ylabel in (
        ("suite_memory.png", "peak_mib", "peak working memory per rank (MiB)"),
        ("suite_time.png", "fwdbwd_s", "fwd+bwd time per call (s)"),
    ):
        series = []
        for impl in STRATEGIES:
            got = {r["world"]: r.get(key) for r in scal if r["impl"] == impl}
            got.setdefault(1, ref.get(key))
            series.append(
                Series(LABELS[impl], list(worlds), [got.get(p) for p in worlds], "-o", {"color": COLORS[impl]})
            )
        if ref.get(key):  # memory O(S/p); time with p cores (no further than the machine's cores)
            ideal = [ref[key] / p for p in worlds]
            series.append(Series("ideal: p=1 value ÷ p", list(worlds), ideal, "--", {"color": "gray"}))
        title = f"dense causal, S={fmt_seq(mode['seq'])}, B{BATCH} H{HEADS} D{HEAD_DIM} fp32, 1 thread per rank"
        paths.append(
            plot_panels(out / name, [("", series)], xlabel="ranks p", ylabel=ylabel, title=title, xticks=worlds)
        )
    paths.append(_bars(out / "suite_libraries.png", rows, fits, mode))
    return paths


def _bars(path: Path, rows: list[dict[str, Any]], fits: list[dict[str, Any]], mode: dict[str, Any]) -> Path:
    """Two horizontal bar charts: tokens/s of every measured row, and the largest S in the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("tokens_per_s")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.35 * max(len(timed), 6) + 1.5))
    ax1.barh([f"{r['label']} [{r['procs']}]" for r in timed], [r["tokens_per_s"] for r in timed], color="tab:blue")
    ax1.set_xlabel(f"tokens/s (fwd+bwd, S={fmt_seq(mode['seq'])})")
    ax1.invert_yaxis()
    ax1.tick_params(axis="y", labelsize=7)
    got = [f for f in fits if f.get("max_fit_seq")]
    ax2.barh([f["label"] for f in got], [f["max_fit_seq"] for f in got], color="tab:green")
    ax2.set_xlabel(f"largest total S within {mode['budget_mib']:.0f} MiB per rank, p={FIT_WORLD}")
    ax2.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Run every section; write ``suite.json`` and the PNGs; return the report."""
    mode = dict(MODES["quick" if args.quick else "full"])
    if args.seq:
        mode["seq"] = args.seq
    if args.budget_mib:
        mode["budget_mib"] = args.budget_mib
    out = Path(args.out)
    t0 = time.perf_counter()
    report = base_report(
        "suite",
        args,
        {
            **mode,
            "batch": BATCH,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "attention": "dense causal (single-process dilated rows: w=S/16·[1,2,4], r=[1,2,4])",
            "layout": "zigzag for the scaling rows, contiguous for the library comparison",
            "calls": args.calls,
            "max_call_s": args.max_call_s,
            "malloc_mmap_threshold": args.malloc_mmap_threshold,
            "fit_world": FIT_WORLD,
            "overlap_method": "hook on ds_ring ring_step events: blocked = sum of wait_s over the timed calls; "
            "compute = timed wall - blocked per rank; wall ÷ compute = max wall / max compute",
            "time_statistic": "slowest rank's median of the timed calls (after one small warm-up call)",
            "memory_statistic": "largest rank's peak RSS above its RSS before its input shards existed",
        },
        [RAP_PACKAGE, "dilated-attention-pytorch", "deepspeed"],
    )
    cores = report["machine"]["usable_cpus"]
    tp = Throughput(cores, report["matmul"]["1_thread"].get("gflops_best") or 50.0)
    seen: dict[tuple[str, int], tuple[int, float]] = {}
    rows: list[dict[str, Any]] = report["rows"]
    for section in (scaling, single_process, libraries):
        for row in section(mode, args, tp, seen):
            rows.append(row)
            print(
                f"  [{row['section']}] {row['impl']:>16} p={row['world']} t={row['threads_per_rank']} "
                f"fwd+bwd={row.get('fwdbwd_s', float('nan')):.2f}s peak={row.get('peak_mib', float('nan')):.0f}MiB "
                f"{row.get('notes', '')[:200]}",
                flush=True,
            )
            write_json(out / "suite.json", report)
    fits: list[dict[str, Any]] = []
    report["fit"] = fits
    for impl in STRATEGIES:
        fit = fit_search(impl, _get(rows, impl, FIT_WORLD), mode, args, tp, seen)
        fit["label"], fit["n_probes"] = LABELS[impl], len(fit["probes"])
        fits.append(fit)
        print(f"  [fit] {impl:>10}: ≤ {mode['budget_mib']:.0f} MiB/rank up to S={fit['max_fit_seq']} {fit['notes']}")
        write_json(out / "suite.json", report)
    derive(rows)
    label_rows(rows, LABELS, cores)
    report["targets"] = targets(rows, mode, cores)
    finish_report(report, t0)
    write_json(out / "suite.json", report)
    _plots(out, rows, fits, mode)
    return report


def format_report(report: dict[str, Any]) -> str:
    """Markdown: header, the three tables, the targets."""
    mode, rows = report["config"], report["rows"]
    seq = fmt_seq(mode["seq"])
    parts = [
        format_header(report, "ds_ring benchmark suite"),
        f"**Scaling, overlap, strong scaling** — dense causal, S = {seq} total tokens, zigzag shards:",
        markdown_table([r for r in rows if r["section"] == "scaling"], SCALING_COLUMNS),
        f"**Single process and existing libraries** — S = {seq}, same shapes:",
        markdown_table([r for r in rows if r["section"] != "scaling"], OTHER_COLUMNS),
        f"**Largest total length within {mode['budget_mib']:.0f} MiB of working memory per rank**, p = {FIT_WORLD}, "
        f"dense causal (multiples of {mode['fit_step']} tokens):",
        markdown_table(report["fit"], FIT_COLUMNS),
        format_targets(report["targets"]),
    ]
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks [--quick] [--out DIR]``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    add_common_args(p)
    p.add_argument("--seq", type=int, help="override the total sequence length (default 32768, quick 4096)")
    p.add_argument("--budget-mib", type=float, help="override the per-rank memory budget of the fit search (MiB)")
    args = p.parse_args(argv)
    resolve_common_args(args)
    report = drive(args)
    print()
    print(format_report(report))
    print(f"\nwrote {Path(args.out) / 'suite.json'}, suite_memory.png, suite_time.png, suite_libraries.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
