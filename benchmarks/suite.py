"""The benchmark suite (issue 8), ``python -m benchmarks [--quick] [--out DIR]``: what each part measures and how to
read it: ``benchmarks/SUITE.md``."""

from __future__ import annotations

from typing import Any

from benchmarks import peers, ring, strategies
from benchmarks.cases import Case, pairs_dilated
from benchmarks.common import Series, figure, fmt_seq, plot_panels
from benchmarks.driver import Benchmark, Session
from benchmarks.rows import Column, Row, Target, compare, find, markdown_table, ratio
from benchmarks.strategies import NAMES, STRATEGIES, label

RATES = (1, 2, 4)
MODES = {
    False: {"seq": 32768, "worlds": [1, 2, 4, 8], "budget_mib": 512.0, "fit_step": 4096, "fit_probes": 5},
    True: {"seq": 4096, "worlds": [1, 2, 4, 8], "budget_mib": 96.0, "fit_step": 1024, "fit_probes": 3},
}  # full (False) and quick (True): total tokens, rank counts, per-rank budget (MiB), search step, probes
FIT_WORLD = 4


def mode(args: Any) -> dict[str, Any]:
    return {**MODES[args.quick], **{k: v for k, v in (("seq", args.seq), ("budget_mib", args.budget_mib)) if v}}


def strategy(impl: str, seq: int, p: int, layout: str = "zigzag", tag: str = "scaling") -> Case:
    return Case(impl, seq, p, ulysses=2 if impl == "hybrid" else 1, layout=layout, tag=tag)


def plan(session: Session) -> None:
    m = mode(session.args)
    seq, segs = m["seq"], (m["seq"] // 16, m["seq"] // 8, m["seq"] // 4)
    for p in m["worlds"]:
        for impl in STRATEGIES:
            if (p == 1 and impl != "ring") or (impl == "hybrid" and p < 4):
                continue  # p = 1: one rank, no communication; hybrid needs ulysses 2 × ring >= 2
            session.run(strategy(impl, seq, p))
    for impl, threads in (("dense", 1), ("dense", 2), ("ds_ring", 1), ("ds_ring", 2), ("dap", 2)):
        dilated = {"segment_lengths": segs, "dilation_rates": RATES} if impl != "dense" else {}
        warmup_seq = max(segs) if impl == "dap" else None  # dap has no dense attention to warm up with
        session.run(Case(impl, seq, threads=threads, group=False, warmup_seq=warmup_seq, tag="single", **dilated))
    for impl in ("ring", "rap", "ulysses", "deepspeed", "torch_cp"):
        session.run(strategy(impl, seq, 2, layout="contiguous", tag="libraries"))
    session.extra["fit"] = [fit_search(session, impl, m) for impl in STRATEGIES]


def fit_search(session: Session, impl: str, m: dict[str, Any]) -> dict[str, Any]:
    """The largest total length whose working memory per rank at p = 4 stays within ``budget_mib`` (SUITE.md): (length,
    MiB) measured to ``fit`` and ``over`` the budget, every probe, and why the search stopped early."""
    budget, step = m["budget_mib"], m["fit_step"]
    seed = find(session.rows, impl=impl, world=FIT_WORLD, tag="scaling")
    points = [(seed.case.seq, seed.peak_mib)] if seed and seed.peak_mib else []
    lo = max((pt for pt in points if pt[1] <= budget), default=None)
    hi = min((pt for pt in points if pt[1] > budget), default=None)
    probes, notes = [], []
    for _ in range(m["fit_probes"]):
        candidate = next_candidate(points, lo, hi, budget, step)
        if candidate is None:
            break
        row = session.run(strategy(impl, candidate, FIT_WORLD, tag="fit"), calls=1)
        probes.append({"seq": candidate, "peak_mib": row.peak_mib, "peak_mib_per_rank": row.peak_mib_per_rank})
        if not row.peak_mib:
            notes.append(f"probe {fmt_seq(candidate)}: {'; '.join(row.notes)}")
            break
        points.append((candidate, row.peak_mib))
        lo, hi = (points[-1], hi) if row.peak_mib <= budget else (lo, points[-1])
    if lo and hi and hi[0] - lo[0] > step:
        notes.append(f"stopped after {m['fit_probes']} probes: the limit lies between the two lengths")
    if hi is None:
        notes.append("no probe exceeded the budget: the largest length is at least the one shown")
    name = label(strategy(impl, 0, FIT_WORLD))
    return {"label": name, "fit": lo, "over": hi, "probes": probes, "notes": "; ".join(notes)}


def next_candidate(points: list[tuple[int, float]], lo: Any, hi: Any, budget: float, step: int) -> int | None:
    """Next length to probe (a multiple of ``step`` strictly inside (lo, hi)), or None when done."""
    floor, ceiling = (lo[0] if lo else 0), (hi[0] if hi else None)
    if ceiling is not None and ceiling - floor <= step:
        return None
    near = [lo, hi] if lo and hi else sorted(points, key=lambda p: abs(p[1] - budget))[:2]
    if len(near) == 2 and near[0][0] != near[1][0]:
        (s0, m0), (s1, m1) = near
        slope = (m1 - m0) / (s1 - s0)
        guess = s0 + (budget - m0) / slope if slope > 0 else (s0 + s1) / 2
    else:
        guess = near[0][0] * budget / near[0][1] if near else step
    candidate = max(int(guess // step) * step, floor + step)
    if ceiling is not None:
        candidate = min(candidate, ceiling - step)
    return candidate if candidate > floor else None


def targets(session: Session) -> list[Target]:
    rows, seq, cores = [r for r in session.rows if r.case.tag != "fit"], mode(session.args)["seq"], session.cores
    at = fmt_seq(seq) + ("" if seq == 32768 else f" (the target is stated at 32K; this run uses {fmt_seq(seq)})")
    ring1, ring2, ring4 = (find(rows, impl="ring", world=p, tag="scaling") for p in (1, 2, 4))
    ag4 = ratio(find(rows, impl="allgather", world=4, tag="scaling"), ring1, "peak_mib")
    out = compare(f"ring per-rank peak memory at p=4 ≤ 0.30 × p=1, {fmt_seq(seq)}", ring4, ring1, "peak_mib",
                  lambda x: x <= 0.30, f"; all-gather beside it: {ag4:.2f}" if ag4 else "")  # fmt: skip
    for r in rows:
        if r.case.impl == "ring" and r.case.tag == "scaling" and r.overlap_ratio is not None:
            over = r.case.world > cores
            blocked = ", ".join(f"{b:.2f}" for b in r.blocked_s_per_rank or [])
            detail = f"blocked in waits per rank [{blocked}] s of {r.fwdbwd_s * r.calls:.2f} s"
            detail += f" ({r.case.world} ranks on {cores} cores: waits include time-slicing; info only)" if over else ""
            text = f"ring fwd+bwd ≤ 1.15 × its compute-only time, p={r.case.world}"
            out.append(Target(text, r.overlap_ratio, None if over else r.overlap_ratio <= 1.15, detail))
    load = max((r.other_cpu_pct or 0 for r in (ring1, ring2) if r), default=0)
    out += compare(f"2 ranks on 2 cores ≥ 1.7× faster than 1 rank on 1 core, {at}", ring1, ring2,
                   met=lambda x: x >= 1.7 if cores >= 2 else None, note=f"; other load {load:.0f}%")  # fmt: skip
    segs = [seq // 16, seq // 8, seq // 4]
    pairs = pairs_dilated(seq, 8, segs, RATES, True)
    note = (
        f"; the useful-work ratio caps it at {seq * (seq + 1) // 2 * 8 / pairs:.1f}× (every head computes every "
        f"branch: {pairs / (8 * seq):.0f} key pairs per query vs {(seq + 1) / 2:.0f} dense)"
    )
    for t in (1, 2):
        dense, dilated = find(rows, impl="dense", threads=t), find(rows, impl="ds_ring", threads=t)
        text = f"dilated w={segs} r={list(RATES)} ≥ 20× faster than dense causal, {at}, {t} thread(s)"
        out += compare(text, dense, dilated, met=lambda x: x >= 20.0, note=note)
    return out + library_targets(rows)


def library_targets(rows: list[Row]) -> list[Target]:
    """At least as fast as each library on the same shapes (> 1: ds_ring's faster layout is faster)."""

    def fastest(impl: str) -> Row | None:
        timed = [r for r in rows if r.case.impl == impl and r.case.world == 2 and r.fwdbwd_s]
        return min(timed, key=lambda r: r.fwdbwd_s, default=None)

    ours = {"rap": fastest("ring"), "deepspeed": fastest("ulysses"), "torch_cp": fastest("ring")}
    pairs = [(f"{NAMES[i]} (p=2)", ours[i], find(rows, impl=i, world=2), "") for i in ours]
    dap, dil = find(rows, impl="dap"), find(rows, impl="ds_ring", threads=2)
    if (work := ratio(dil, dap, "useful_gflop")) is not None:
        norm = f"; ds_ring does {work:.1f}× its useful work (dap splits the heads among the branches)"
        if ratio(dap, dil):
            norm += f": per unit of work ds_ring is {ratio(dap, dil) * work:.2f}× as fast"
        pairs.append(("dilated-attention-pytorch (single process, 2 threads)", dil, dap, norm))
    out = []
    for name, mine, theirs, extra in pairs:
        why = "; ".join((theirs.notes if theirs else []) or (mine.notes if mine else [])) or "not measured"
        note = f" ({mine.label}){extra}" if mine else extra
        target = f"at least as fast as {name}"
        missing = [Target(target, "n/a", None, why[:400])]
        out += compare(target, theirs, mine, met=lambda x: x >= 1.0, note=note) or missing
    return out


def report(session: Session) -> str:
    m, rows = mode(session.args), [r for r in session.rows if r.case.tag != "fit"]
    scaling = [r for r in rows if r.case.tag == "scaling"]
    ref, seq = find(scaling, world=1), fmt_seq(m["seq"])
    first = [Column("implementation", lambda r: r.label), Column("p", lambda r: r.case.world), "procs × threads",
             "fwd+bwd s", "tokens/s"]  # fmt: skip
    speed = Column("speed-up vs 1 rank", lambda r: ratio(ref, r), "{:.2f}")
    length = lambda i: lambda f: f"{fmt_seq(f[i][0])} ({f[i][1]:.1f} MiB)" if f[i] else None
    fits = [Column("strategy", lambda f: f["label"]), Column("largest S that fits", length("fit")),
            Column("smallest S over budget", length("over")), Column("probes", lambda f: len(f["probes"])),
            Column("notes", lambda f: f["notes"])]  # fmt: skip
    mem_vs = Column("mem ÷ p=1", lambda r: ratio(r, ref, "peak_mib"), "{:.2f}")
    return "\n\n".join([
        f"**Scaling, overlap, strong scaling**: dense causal, S = {seq} total tokens, zigzag shards:",
        markdown_table(scaling, [*first, "peak MiB/rank", mem_vs, speed, *ring.TAIL]),
        f"**Single process and existing libraries**: S = {seq}, same shapes:",
        markdown_table([r for r in rows if r.case.tag != "scaling"],
                              [*first, "useful GFLOP/s", "peak MiB/rank", speed, *ring.TAIL[1:]]),
        f"**Largest total length within {m['budget_mib']:.0f} MiB of working memory per rank**, p = {FIT_WORLD}, "
        f"dense causal (multiples of {m['fit_step']} tokens):",
        markdown_table(session.extra["fit"], fits),
    ])  # fmt: skip


def plots(session: Session) -> None:
    """Memory and time against p (dashed: the p = 1 value ÷ p); ``suite_libraries.png``: tokens/s, the largest S."""
    m, scaling = mode(session.args), [r for r in session.rows if r.case.tag == "scaling"]
    ref, title = find(scaling, world=1), f"dense causal, S={fmt_seq(m['seq'])}, B1 H8 D64 fp32, 1 thread per rank"
    for name, ylabel, attr in (
        ("memory", "peak working memory per rank (MiB)", "peak_mib"),
        ("time", "fwd+bwd time per call (s)", "fwdbwd_s"),
    ):
        series = []
        for impl in STRATEGIES:
            points = {r.case.world: getattr(r, attr) for r in scaling if (r.case.impl == impl or r is ref)}
            if points := {p: v for p, v in points.items() if v}:
                series.append(Series(f"ds_ring {NAMES[impl]}", list(points), list(points.values())))
        if ref and getattr(ref, attr):
            ideal = [getattr(ref, attr) / p for p in m["worlds"]]
            series.append(Series("ideal: p=1 value ÷ p", m["worlds"], ideal, "--", {"color": "gray"}))
        if series:
            path = session.out / f"suite_{name}.png"
            plot_panels(path, [("", series)], xlabel="ranks p", ylabel=ylabel, title=title, xticks=m["worlds"])
    timed = [r for r in session.rows if r.tokens_per_s and r.case.tag != "fit"]
    fits = [f for f in session.extra["fit"] if f["fit"]]
    with figure(session.out / "suite_libraries.png", 14, 0.35 * max(len(timed), 6) + 1.5, 2, dpi=110) as (ax1, ax2):
        ax1.barh([f"{r.label} [{r.procs}]" for r in timed], [r.tokens_per_s for r in timed], color="tab:blue")
        ax1.set_xlabel(f"tokens/s (fwd+bwd, S={fmt_seq(m['seq'])})")
        ax1.tick_params(axis="y", labelsize=7)
        ax2.barh([f["label"] for f in fits], [f["fit"][0] for f in fits], color="tab:green")
        ax2.set_xlabel(f"largest total S within {m['budget_mib']:.0f} MiB per rank, p={FIT_WORLD}")
        for ax in (ax1, ax2):
            ax.invert_yaxis()


def add_args(p: Any) -> None:
    p.add_argument("--seq", type=int, help="total sequence length (default 32768, quick 4096)")
    p.add_argument("--budget-mib", type=float, help="per-rank memory budget of the fit search (MiB)")


BENCHMARK = Benchmark(
    name="suite", module="benchmarks", title="ds_ring benchmark suite", plan=plan, build=strategies.build,
    report=report, targets=targets, plots=plots, add_args=add_args, label=label, flop=peers.flop,
    efficiency=peers.EFFICIENCY, packages=("ring-attention-pytorch", "dilated-attention-pytorch", "deepspeed"),
    config=lambda args: {**mode(args), "fit_world": FIT_WORLD, "dilated_rates": RATES},
)  # fmt: skip
