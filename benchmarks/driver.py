"""The benchmark driver: :func:`main`, :class:`Session` running a :class:`Benchmark`, :class:`Row` (README.md)."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks import common
from benchmarks.common import AttentionFn, Case, RankResult, Series, fmt_seq, useful_gflop
from ds_ring import testing

OTHER_CPU_WARN = 0.10  # above this share of the CPUs used by other processes, a case's timings are flagged
GRACE_AFTER_FAILURE_S = 10.0  # once a rank has failed, the others get this long to finish before they are killed
PRELOAD = (*testing.PRELOAD, "ds_ring", "benchmarks.common")


@dataclass(frozen=True)
class Benchmark:
    """What a benchmark module hands to :func:`main` (``benchmarks/README.md``, "Adding a benchmark")."""

    name: str
    module: str
    title: str
    plan: Callable[[Session], None]
    build: Callable[[Case, int, float], AttentionFn]
    report: Callable[[Session], str]
    plots: Callable[[Session], None]
    seqs: tuple[Sequence[int], Sequence[int]] | None = None
    worlds: Sequence[int] | None = None
    impls: Sequence[str] = ()
    threads: int | None = None
    add_args: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    config: Callable[[argparse.Namespace], dict[str, Any]] = lambda args: {}
    label: Callable[[Case], str] = lambda case: case.impl
    flop: Callable[[Case], float] = useful_gflop
    packages: tuple[str, ...] = ()
    calls: int = 2
    max_call_s: tuple[float, float] = (600.0, 120.0)
    rank: Callable[..., RankResult] = common.attention_rank


class Session:
    """One run of a benchmark: the rows measured so far, the estimates, and the report they make."""

    def __init__(self, bench: Benchmark, args: argparse.Namespace) -> None:
        self.bench, self.args, self.out, self.started, self.text = bench, args, Path(args.out), time.perf_counter(), ""
        argv = [common.rel(a) if os.path.isabs(a) else a for a in sys.argv[1:]]  # the JSON holds no machine path
        self.command = " ".join(["python", "-m", bench.module, *argv])
        self.rows: list[Row] = []
        self.extra: dict[str, Any] = {}  # more for the JSON (the suite's fit search)
        self.machine, self.matmul_gflops = common.machine_info(bench.packages), {}
        self.cores: int = self.machine["usable_cpus"]
        self.seen: dict[tuple, tuple[int, float, float]] = {}  # (label, p, causal, tag): (seq, s, MiB) last measured
        print(f"{bench.name}: fp32 matmul 2048², 1 thread: {self.matmul(1, 2048, 'start') or 0:.1f} GFLOP/s")

    def matmul(self, threads: int, n: int, when: str) -> float | None:
        """fp32 ``n×n`` matmul GFLOP/s with ``threads`` threads in a fresh process, kept under ``when``."""
        (got,) = testing.spawn_ranks(common.matmul_rank, 1, timeout_s=120, args=(n,), threads_per_rank=threads,
                                     process_group=False, preload=PRELOAD)  # fmt: skip
        self.matmul_gflops[f"n={n} threads={threads} {when}"] = got.value
        return got.value

    def run(self, case: Case, *, calls: int | None = None) -> Row:
        """Measure ``case`` (or skip it with the reason); append, print and save its row."""
        over = case.world * case.threads > self.cores
        procs = f"{case.world}×{case.threads}" + (f" (>{self.cores} cores)" if over else "")
        row = Row(case, self.bench.label(case), procs, self.bench.flop(case))
        row.estimated_call_s, why = self._estimate(row)
        if why is not None:
            row.notes.append("skipped: " + why)
        else:
            single = (row.estimated_call_s or 0.0) > self.args.single_call_above_s
            self._measure(row, calls or (1 if single else self.args.calls))
        if row.fwdbwd_s:
            self.seen[(row.label, case.world, case.causal, case.tag)] = (case.seq, row.fwdbwd_s, row.peak_mib or 0.0)
        self.rows.append(row)
        print(f"  {row.label:>44} {fmt_seq(case.seq):>5} {procs:>5} fwd+bwd={row.fwdbwd_s or math.nan:.3f}s "
              f"peak={row.peak_mib or math.nan:.0f}MiB/rank {'; '.join(row.notes)[:300]}", flush=True)  # fmt: skip
        self.write_json()
        return row

    def _estimate(self, row: Row) -> tuple[float | None, str | None]:
        """(one call's estimated seconds, the reason to skip the case or None): README.md, "Skipping"."""
        case = row.case
        if case.seq % case.world:
            return None, f"seq {case.seq} is not divisible by {case.world} ranks"
        if (seen := self.seen.get((row.label, case.world, case.causal, case.tag))) is None:
            return None, None
        (seq, seconds, mib), available = seen, psutil.virtual_memory().available / common.MIB
        grow, at, limit = case.seq / seq, f"from {fmt_seq(seq)}", self.args.max_call_s
        if (est_s := seconds * grow**2) > limit:
            return est_s, f"one fwd+bwd call estimated {est_s:.0f} s (∝ S² {at}) > --max-call-s {limit:.0f}"
        if mib * grow * case.world > 0.8 * available:
            return est_s, f"{mib * grow:.0f} MiB/rank (∝ S {at}) × {case.world} > 80% of {available:.0f} MiB available"
        return est_s, None

    def _measure(self, row: Row, calls: int) -> None:
        """Launch the case, again (``--retries``) while others used over :data:`OTHER_CPU_WARN` of the CPUs."""
        args, case = self.args, row.case
        timeout_s = max(300.0, 4.0 * (row.estimated_call_s or 0.0) * (calls + 1) + 120.0)
        attempts: list[tuple[list[testing.RankOutcome], float, float | None]] = []  # (outcomes, wall s, other share)
        own_cpu_s = lambda: sum(psutil.Process().cpu_times()[:2])  # this process's user + system s
        for _ in range(1 + args.retries):
            deadline = time.monotonic() + args.wait_idle_s  # wait for idle CPUs: at most --idle-threshold busy over 1 s
            while time.monotonic() < deadline and psutil.cpu_percent(interval=1.0) > 100 * args.idle_threshold:
                pass
            (busy0, total0), own0, t0 = common.cpu_seconds(), own_cpu_s(), time.perf_counter()
            outcomes = testing.spawn_ranks(
                self.bench.rank, case.world, timeout_s=timeout_s, args=(case, self.bench.build, calls, args.timeout_s),
                threads_per_rank=case.threads, process_group=case.group, grace_s=GRACE_AFTER_FAILURE_S, preload=PRELOAD,
            )  # fmt: skip
            wall, (busy1, total1) = time.perf_counter() - t0, common.cpu_seconds()
            ours, capacity = sum(o.cpu_s or 0.0 for o in outcomes) + own_cpu_s() - own0, total1 - total0
            other = max(0.0, busy1 - busy0 - ours) / capacity if capacity > 0 else None
            row.attempts_other_cpu_pct.append(100.0 * other if other is not None else None)
            attempts.append((outcomes, wall, other))
            if not all(o.ok and o.value.fwdbwd for o in outcomes) or (other or 0.0) <= OTHER_CPU_WARN:
                break
        summarize(row, *min(attempts, key=lambda a: a[2] or 0.0))  # the least disturbed, the first of equals

    def finish(self) -> str:
        """The matmul ceiling at the end; the report, JSON and PNGs. Returns the markdown."""
        self.matmul(1, 2048, "end")
        self.extra["wall_s"] = time.perf_counter() - self.started
        self.text = "\n\n".join([self.header(), self.bench.report(self)])
        self.write_json()
        self.bench.plots(self)
        return self.text

    def header(self) -> str:
        m, mm, rows = self.machine, self.matmul_gflops, self.rows
        start, end = (mm.get(f"n=2048 threads=1 {w}") or math.nan for w in ("start", "end"))
        loads = max([m["loadavg_1m"], *(r.loadavg_1m or 0.0 for r in rows)])
        return (
            f"**{self.bench.title}** ({'quick' if self.args.quick else 'full'}; `{self.command}`): "
            f"{m['cpu_model']}, {self.cores} usable CPUs, {m['mem_total_gib']:.0f} GiB; torch "
            f"{m['versions'].get('torch')}; {m['date_utc']}. fp32 matmul 2048², 1 thread: {start:.1f} GFLOP/s at "
            f"start, {end:.1f} at end. Ranks are processes ('procs × threads'): more than {self.cores} time-share "
            f"the cores (their times include that; their memory does not). Run took {self.extra['wall_s']:.0f} s; "
            f"other processes used at most {max((r.other_cpu_pct or 0.0 for r in rows), default=0.0):.0f}% of the "
            f"CPUs during a configuration ('other load %'); highest 1-min load average {loads:.1f}."
        )

    def write_json(self) -> None:
        common.write_json(self.out / f"{self.bench.name}.json", {
            "benchmark": self.bench.name, "mode": "quick" if self.args.quick else "full", "command": self.command,
            "args": vars(self.args) | {"out": common.rel(self.args.out)}, "config": self.bench.config(self.args),
            "machine": self.machine, "matmul_gflops": self.matmul_gflops, "rows": [asdict(r) for r in self.rows],
            "report": self.text, **self.extra,
        })  # fmt: skip


@dataclass
class Row:
    """One case's measurements over all ranks, or why it has none (``notes``); the fields: ``benchmarks/*.md``."""

    case: Case
    label: str
    procs: str
    useful_gflop: float
    estimated_call_s: float | None = None
    calls: int | None = None
    fwd_s: float | None = None
    fwdbwd_s: float | None = None
    fwd_peak_mib: float | None = None
    peak_mib: float | None = None
    peak_mib_per_rank: list[float] | None = None
    fwd_first_extra_mib: float | None = None
    first_extra_mib: float | None = None
    inputs_mib: float | None = None
    warmup_max_abs_err: float | None = None
    blocked_s_per_rank: list[float] | None = None
    compute_s_per_rank: list[float] | None = None
    overlap_ratio: float | None = None
    other_cpu_pct: float | None = None
    attempts_other_cpu_pct: list[float | None] = field(default_factory=list)
    loadavg_1m: float | None = None
    launch_wall_s: float | None = None
    notes: list[str] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.case.batch * self.case.seq / self.fwdbwd_s if self.fwdbwd_s else None

    @property
    def gflops(self) -> float | None:
        return self.useful_gflop / self.fwdbwd_s if self.fwdbwd_s else None

    def largest(self, key: str) -> float | None:
        """The largest rank's raw ``key`` (None unless every rank has it)."""
        values = [r.get(key) for r in self.raw]
        return max(values) if values and None not in values else None


def summarize(row: Row, outcomes: list[testing.RankOutcome], wall_s: float, other: float | None) -> None:
    """Fill ``row`` from one launch's outcomes."""
    row.raw = [{"rank": o.rank, "error": o.error, "cpu_s": o.cpu_s, "peak_rss_mib": o.peak_rss_mib,
                **(asdict(o.value) if o.ok else {})} for o in outcomes]  # fmt: skip
    row.other_cpu_pct = 100.0 * other if other is not None else None
    row.launch_wall_s, row.loadavg_1m, row.notes = wall_s, os.getloadavg()[0], []
    errors = [f"rank {o.rank}: {o.error.strip().splitlines()[-1]}" for o in outcomes if not o.ok]
    if errors:  # a failing rank usually makes its peers fail too: the first error is the cause
        row.notes.append("error: " + errors[0] + (f" (+{len(errors) - 1} more ranks)" if len(errors) > 1 else ""))
    results = [o.value for o in outcomes if o.ok]
    row.notes += sorted({f"skipped: {r.skipped}" for r in results if r.skipped})
    if errors or any(r.fwdbwd is None for r in results):
        return
    fb = [r.fwdbwd for r in results]
    row.calls, row.fwdbwd_s = len(fb[0].times_s), max(statistics.median(t.times_s) for t in fb)
    row.peak_mib_per_rank = [r.working_mib(r.fwdbwd) for r in results]
    row.peak_mib, row.first_extra_mib = max(row.peak_mib_per_rank), max(t.first_extra_mib for t in fb)
    row.inputs_mib = max(r.inputs_mib or 0.0 for r in results)
    if all(r.fwd for r in results):
        row.fwd_s = max(statistics.median(r.fwd.times_s) for r in results)
        row.fwd_peak_mib = max(r.working_mib(r.fwd) for r in results)
        row.fwd_first_extra_mib = max(r.fwd.first_extra_mib for r in results)
    row.warmup_max_abs_err = max((e for r in results if (e := r.warmup_max_abs_err) is not None), default=None)
    if all(r.ring_steps for r in results):
        walls = [sum(t.times_s) for t in fb]
        row.blocked_s_per_rank = [r.blocked_s for r in results]
        row.compute_s_per_rank = [w - r.blocked_s for w, r in zip(walls, results, strict=True)]
        row.overlap_ratio = max(walls) / max(row.compute_s_per_rank) if max(row.compute_s_per_rank) > 0 else None
    if other is not None and other > OTHER_CPU_WARN:
        row.notes.append(f"other processes used {100 * other:.0f}% of the CPUs: timing disturbed")


def find(rows: Iterable[Row], **fields: Any) -> Row | None:
    """The first row whose case has these field values, e.g. ``find(rows, impl="rap", seq=8192, world=2)``."""
    return next((r for r in rows if all(getattr(r.case, k) == v for k, v in fields.items())), None)


def ratio(num: Row | None, den: Row | None, attr: str = "fwdbwd_s") -> float | None:
    """``num.attr ÷ den.attr`` (None when either is missing); a reference's time ÷ a row's = how many times faster."""
    a, b = (getattr(r, attr) if r is not None else None for r in (num, den))
    return a / b if a and b else None


@dataclass(frozen=True)
class Column:
    header: str
    get: Callable[[Row], Any]
    fmt: str | Callable[[Any], str] = "{}"


COLUMNS = {c.header: c for c in [
    Column("impl", lambda r: r.label), Column("seq", lambda r: r.case.seq, fmt_seq),
    Column("causal", lambda r: "yes" if r.case.causal else "no"), Column("procs × threads", lambda r: r.procs),
    Column("fwd s", lambda r: r.fwd_s, "{:.3f}"), Column("fwd+bwd s", lambda r: r.fwdbwd_s, "{:.3f}"),
    Column("tokens/s", lambda r: r.tokens_per_s, "{:.0f}"), Column("useful GFLOP/s", lambda r: r.gflops, "{:.1f}"),
    Column("peak MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
    Column("inputs MiB/rank", lambda r: r.inputs_mib, "{:.1f}"),
    Column("wall ÷ compute", lambda r: r.overlap_ratio, "{:.2f}"),
    Column("warm-up err", lambda r: r.warmup_max_abs_err, "{:.1e}"),
    Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"), Column("notes", lambda r: "; ".join(r.notes)),
]}  # fmt: skip


def markdown_table(rows: Sequence[Any], columns: Sequence[Column | str]) -> str:
    """GitHub markdown table; a missing (None) value prints as '—'."""

    def cell(row: Any, col: Column) -> str:
        if (value := col.get(row)) is None or (isinstance(value, float) and math.isnan(value)):
            return "—"
        return col.fmt(value) if callable(col.fmt) else col.fmt.format(value)

    cols = [COLUMNS[c] if isinstance(c, str) else c for c in columns]
    lines = ["| " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows])


def dict_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of ``rows`` (the first row's keys are the headers; floats to 2 decimals), "" for no rows."""
    two = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)
    return markdown_table(rows, [Column(h, lambda r, h=h: r[h], two) for h in rows[0]]) if rows else ""


Figure = tuple[str, str, Sequence[tuple[str, Callable[["Row"], float | None], str]]]  # (file suffix, y label, lines)
TIME: Figure = ("time", "fwd+bwd time per call, slowest rank (s)", [("", lambda r: r.fwdbwd_s, "-o")])
MEMORY: Figure = ("memory", "peak working memory, largest rank (MiB)", [("", lambda r: r.peak_mib, "-o")])


def plot_rows(session: Session, panel: Callable[[Row], str | None], title: str,
              figures: Sequence[Figure] = (TIME, MEMORY), logy: bool = True) -> None:  # fmt: skip
    """``<out>/<name>_<figure>.png`` per figure against the length: a panel per ``panel(row)``, a line per label."""
    labels, ticks = list(dict.fromkeys(r.label for r in session.rows)), sorted({r.case.seq for r in session.rows})
    for name, ylabel, phases in figures:
        panels: dict[str, dict[str, Series]] = {}
        for r, (suffix, y, style) in itertools.product(session.rows, phases):
            if panel(r) is not None and y(r) is not None:
                key, color = f"{r.label} {suffix}".strip(), f"C{labels.index(r.label) % 10}"
                s = panels.setdefault(panel(r), {}).setdefault(key, Series(key, style=style, kwargs={"color": color}))
                s.x.append(r.case.seq)
                s.y.append(y(r))
        if items := [(title_, list(series.values())) for title_, series in panels.items()]:
            path, xlabel = session.out / f"{session.bench.name}_{name}.png", "total sequence length"
            common.plot_panels(path, items, xlabel=xlabel, ylabel=ylabel, title=title, xticks=ticks, logy=logy)


def main(bench: Benchmark, argv: list[str] | None = None) -> int:
    mode = argparse.ArgumentParser(add_help=False)
    mode.add_argument("--quick", action="store_true", help="small sizes, one timed call")
    quick = mode.parse_known_args(argv)[0].quick  # picks the defaults below: (full, quick)
    p = argparse.ArgumentParser(prog=f"python -m {bench.module}", description=bench.title, parents=[mode],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--out", default=str(common.RESULTS), help="output directory")
    for flag, pair, kind, text, extra in (  # an option whose pair is None or empty: the benchmark lacks it
        ("--calls", (bench.calls, 1), int, "timed calls per phase", {}),
        ("--max-call-s", bench.max_call_s, float, "skip a case estimated above this many s per fwd+bwd call", {}),
        ("--seqs", bench.seqs, int, "total sequence lengths", {"nargs": "+"}),
        ("--worlds", bench.worlds and (bench.worlds,) * 2, int, "rank counts", {"nargs": "+"}),
        ("--impls", bench.impls and (bench.impls,) * 2, str, "implementations", {"nargs": "+", "choices": bench.impls}),
        ("--threads", bench.threads and (bench.threads,) * 2, int, "torch threads of the one-process cases", {}),
        ("--single-call-above-s", (120.0,) * 2, float, "one timed call when a call is estimated above this many s", {}),
        ("--timeout-s", (600.0,) * 2, float, "bound on every communication wait, s", {}),
        ("--wait-idle-s", (0.0,) * 2, float, "before each case wait up to this many s for idle CPUs", {}),
        ("--idle-threshold", (0.15,) * 2, float, "'idle': at most this share (0..1) of the CPUs busy", {}),
        ("--retries", (0,) * 2, int, "re-run a case disturbed by other processes up to this many times", {}),
        ("--malloc-mmap-threshold", (None,) * 2, int, "glibc's MALLOC_MMAP_THRESHOLD_ for the ranks", {}),
    ):  # fmt: skip
        if pair:
            p.add_argument(flag, type=kind, default=pair[quick], help=text, **extra)
    bench.add_args(p)
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # each rank sets its own count with torch.set_num_threads
    if args.malloc_mmap_threshold is not None:  # read by glibc when the fork server starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    session = Session(bench, args)
    bench.plan(session)
    print(f"\n{session.finish()}\n\nwrote {session.out / bench.name}.json and {bench.name}*.png")
    return 0
