"""The benchmark suite (issue 8, ``python -m benchmarks``): what each part measures and how to read it, SUITE.md."""

import math
from typing import Any

from benchmarks import peers, ring, strategies
from benchmarks.common import Case, Series, figure, fmt_seq, plot_panels
from benchmarks.driver import Benchmark, Column, Row, Session, find, markdown_table, ratio

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
        for impl in strategies.STRATEGIES:
            if (p == 1 and impl != "ring") or (impl == "hybrid" and p < 4):
                continue  # p = 1: one rank, no communication; hybrid needs ulysses 2 × ring >= 2
            session.run(strategy(impl, seq, p))
    for impl, threads in (("dense", 1), ("dense", 2), ("ds_ring", 1), ("ds_ring", 2), ("dap", 2)):
        dilated = {"segment_lengths": segs, "dilation_rates": RATES} if impl != "dense" else {}
        warmup_seq = max(segs) if impl == "dap" else None  # dap has no dense attention to warm up with
        session.run(Case(impl, seq, threads=threads, group=False, warmup_seq=warmup_seq, tag="single", **dilated))
    for impl in ("ring", "rap", "ulysses", "deepspeed"):
        session.run(strategy(impl, seq, 2, layout="contiguous", tag="libraries"))
    session.extra["fit"] = [fit_search(session, impl, m) for impl in strategies.STRATEGIES]


def fit_search(session: Session, impl: str, m: dict[str, Any]) -> dict[str, Any]:
    """The largest total length within ``budget_mib`` of working memory per rank at p = 4 (SUITE.md, part 3)."""
    budget, step = m["budget_mib"], m["fit_step"]
    seed = find(session.rows, impl=impl, world=FIT_WORLD, tag="scaling")
    points = [(seed.case.seq, seed.peak_mib)] if seed and seed.peak_mib else []
    lo = max((pt for pt in points if pt[1] <= budget), default=None)
    hi = min((pt for pt in points if pt[1] > budget), default=None)
    probes, notes = [], []
    while len(probes) < m["fit_probes"] and (candidate := next_candidate(points, lo, hi, budget, step)):
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
    name = strategies.label(strategy(impl, 0, FIT_WORLD))
    return {"label": name, "fit": lo, "over": hi, "probes": probes, "notes": "; ".join(notes)}


def next_candidate(points: list[tuple[int, float]], lo: Any, hi: Any, budget: float, step: int) -> int | None:
    """Next length to probe (a multiple of ``step`` strictly inside (lo, hi)), or None when done."""
    floor, ceiling = (lo[0] if lo else 0), (hi[0] if hi else math.inf)
    if ceiling - floor <= step:
        return None
    near = [lo, hi] if lo and hi else sorted(points, key=lambda p: abs(p[1] - budget))[:2]
    if len(near) == 2 and near[0][0] != near[1][0]:
        (s0, m0), (s1, m1) = near
        slope = (m1 - m0) / (s1 - s0)
        guess = s0 + (budget - m0) / slope if slope > 0 else (s0 + s1) / 2
    else:
        guess = near[0][0] * budget / near[0][1] if near else step
    return min(max(int(guess // step) * step, floor + step), ceiling - step)


def versus(rows: list[Row], r: Row) -> float | None:
    """The ``ds_ring × faster`` column (SUITE.md, part 2)."""
    if r.case.impl == "ds_ring":
        return ratio(find(rows, impl="dense", threads=r.case.threads), r)
    if r.case.impl == "dap":
        mine = find(rows, impl="ds_ring", threads=2)
        return (ratio(r, mine) or 0.0) * (ratio(mine, r, "useful_gflop") or 0.0) or None
    ours = [x for x in rows if x.case.impl == {"rap": "ring", "deepspeed": "ulysses"}.get(r.case.impl)]
    return ratio(r, min((x for x in ours if x.case.world == 2 and x.fwdbwd_s), key=lambda x: x.fwdbwd_s, default=None))


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
                       [*first, "useful GFLOP/s", "peak MiB/rank", speed,
                        Column("ds_ring × faster", lambda r: versus(rows, r), "{:.2f}"), *ring.TAIL[1:]]),
        f"**Largest total length within {m['budget_mib']:.0f} MiB of working memory per rank**, p = {FIT_WORLD}, "
        f"dense causal (multiples of {m['fit_step']} tokens):",
        markdown_table(session.extra["fit"], fits),
    ])  # fmt: skip


def plots(session: Session) -> None:
    """Memory and time against p (dashed: the p = 1 value ÷ p); ``suite_libraries.png``: tokens/s, the largest S."""
    m, scaling = mode(session.args), [r for r in session.rows if r.case.tag == "scaling"]
    ref, title = find(scaling, world=1), f"dense causal, S={fmt_seq(m['seq'])}, B1 H8 D64 fp32, 1 thread per rank"
    for name, ylabel, attr in (("memory", "peak working memory per rank (MiB)", "peak_mib"),
                               ("time", "fwd+bwd time per call (s)", "fwdbwd_s")):  # fmt: skip
        series = []
        for impl in strategies.STRATEGIES:
            points = {r.case.world: getattr(r, attr) for r in scaling if (r.case.impl == impl or r is ref)}
            if points := {p: v for p, v in points.items() if v}:
                series.append(Series(f"ds_ring {strategies.NAMES[impl]}", list(points), list(points.values())))
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
    report=report, plots=plots, add_args=add_args, label=strategies.label, flop=peers.flop,
    packages=("ring-attention-pytorch", "dilated-attention-pytorch", "deepspeed"),
    config=lambda args: {**mode(args), "fit_world": FIT_WORLD, "dilated_rates": RATES},
)  # fmt: skip
