"""The benchmark driver: :func:`main`, the command line every benchmark module shares, and :class:`Session`, which runs
a :class:`Benchmark`'s cases in fresh rank processes and writes rows, a report, JSON and PNGs (``benchmarks/*.md``)."""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.cases import AttentionFn, Case, Protocol, RankResult, attention_rank, matmul_rank, useful_gflop
from benchmarks.common import fmt_seq
from benchmarks.rows import OTHER_CPU_WARN, Row, summarize
from ds_ring import testing

GRACE_AFTER_FAILURE_S = 10.0  # once a rank has failed, the others get this long to finish before they are killed
PRELOAD = (*testing.PRELOAD, "ds_ring", "benchmarks.cases")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


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
    rank: Callable[..., RankResult] = attention_rank


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
        self.seen: dict[tuple[str, int], tuple[int, float, float]] = {}  # (label, p): (seq, s, MiB) last measured
        print(f"{bench.name}: fp32 matmul 2048², 1 thread: {self.matmul(1, 2048, 'start') or 0:.1f} GFLOP/s")

    def matmul(self, threads: int, n: int, when: str) -> float | None:
        """fp32 ``n×n`` matmul GFLOP/s with ``threads`` threads in a fresh process, kept under ``when``."""
        (got,) = testing.spawn_ranks(
            matmul_rank, 1, timeout_s=120, args=(n,), threads_per_rank=threads, process_group=False, preload=PRELOAD
        )
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
            self.seen[(row.label, case.world)] = (case.seq, row.fwdbwd_s, row.peak_mib or 0.0)
        self.rows.append(row)
        print(f"  {row.label:>44} {fmt_seq(case.seq):>5} {procs:>5} fwd+bwd={row.fwdbwd_s or math.nan:.3f}s "
              f"peak={row.peak_mib or math.nan:.0f}MiB/rank {'; '.join(row.notes)[:300]}", flush=True)  # fmt: skip
        self.write_json()
        return row

    def _estimate(self, row: Row) -> tuple[float | None, str | None]:
        """(one call's seconds, scaled as S² from the last length measured for the label and p; the reason to skip
        the case or None): above ``--max-call-s``, or memory (∝ S) over 80 % of what is available."""
        case = row.case
        if case.seq % case.world:
            return None, f"seq {case.seq} is not divisible by {case.world} ranks"
        if (seen := self.seen.get((row.label, case.world))) is None:
            return None, None
        (seq, seconds, mib), available = seen, common.proc_mib("MemAvailable")
        grow, at, limit = case.seq / seq, f"from {fmt_seq(seq)}", self.args.max_call_s
        if (est_s := seconds * grow**2) > limit:
            return est_s, f"one fwd+bwd call estimated {est_s:.0f} s (∝ S² {at}) > --max-call-s {limit:.0f}"
        if available and mib * grow * case.world > 0.8 * available:
            return est_s, f"{mib * grow:.0f} MiB/rank (∝ S {at}) × {case.world} > 80% of {available:.0f} MiB available"
        return est_s, None

    def _measure(self, row: Row, calls: int) -> None:
        """Launch the case, again (``--retries``) while others used over :data:`OTHER_CPU_WARN` of the CPUs."""
        args, case = self.args, row.case
        protocol = Protocol(calls, args.timeout_s)
        timeout_s = max(300.0, 4.0 * (row.estimated_call_s or 0.0) * (calls + 1) + 120.0)
        best: tuple[list[testing.RankOutcome], float, float | None] | None = None
        own_cpu_s = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # this process's user + system s
        for _ in range(1 + args.retries):
            if args.wait_idle_s > 0:
                common.wait_for_idle(args.idle_threshold, args.wait_idle_s)
            (busy0, total0), own0, t0 = common.cpu_jiffies(), own_cpu_s(), time.perf_counter()
            outcomes = testing.spawn_ranks(
                self.bench.rank, case.world, timeout_s=timeout_s, args=(case, self.bench.build, protocol),
                threads_per_rank=case.threads, process_group=case.group, grace_s=GRACE_AFTER_FAILURE_S, preload=PRELOAD,
            )  # fmt: skip
            wall, (busy1, total1) = time.perf_counter() - t0, common.cpu_jiffies()
            ours, capacity = sum(o.cpu_s or 0.0 for o in outcomes) + own_cpu_s() - own0, (total1 - total0) / _CLK_TCK
            other = max(0.0, (busy1 - busy0) / _CLK_TCK - ours) / capacity if capacity > 0 else None
            row.attempts_other_cpu_pct.append(100.0 * other if other is not None else None)
            if best is None or (other or 0.0) < (best[2] or 0.0):
                best = (outcomes, wall, other)
            if not all(o.ok and o.value.fwdbwd for o in outcomes) or (other or 0.0) <= OTHER_CPU_WARN:
                break
        summarize(row, *best)

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
        paths = {"out": common.rel(self.args.out)}
        common.write_json(self.out / f"{self.bench.name}.json", {
            "benchmark": self.bench.name, "mode": "quick" if self.args.quick else "full", "command": self.command,
            "args": vars(self.args) | paths, "config": self.bench.config(self.args), "machine": self.machine,
            "matmul_gflops": self.matmul_gflops, "rows": [asdict(r) for r in self.rows],
            "report": self.text, **self.extra,
        })  # fmt: skip


def main(bench: Benchmark, argv: list[str] | None = None) -> int:
    listed = lambda v: " ".join(map(str, v)) if isinstance(v, Sequence) else f"{v:g}"
    p = argparse.ArgumentParser(prog=f"python -m {bench.module}", description=bench.title)
    p.add_argument("--quick", action="store_true", help="small sizes, one timed call")
    p.add_argument("--out", default=str(common.RESULTS), help="output directory")
    by_mode: dict[str, tuple[Any, Any]] = {}  # option: its (full, quick) default, where the benchmark has the option
    for flag, pair, kind, text, extra in (
        ("--calls", (bench.calls, 1), int, "timed calls per phase", {}),
        ("--max-call-s", bench.max_call_s, float, "skip a case estimated above this many s per fwd+bwd call", {}),
        ("--seqs", bench.seqs, int, "total sequence lengths", {"nargs": "+"}),
        ("--worlds", bench.worlds and (bench.worlds,) * 2, int, "rank counts", {"nargs": "+"}),
        ("--impls", bench.impls and (bench.impls,) * 2, str, "implementations", {"nargs": "+", "choices": bench.impls}),
        ("--threads", bench.threads and (bench.threads,) * 2, int, "torch threads of the one-process cases", {}),
    ):  # fmt: skip
        if pair:
            text += f" (default {listed(pair[0])}" + (f", quick {listed(pair[1])})" if pair[1] != pair[0] else ")")
            p.add_argument(flag, type=kind, help=text, **extra)
            by_mode[flag[2:].replace("-", "_")] = pair
    for flag, kind, default, text in (
        ("--single-call-above-s", float, 120.0, "one timed call when a call is estimated above this many s"),
        ("--timeout-s", float, 600.0, "bound on every communication wait, s"),
        ("--wait-idle-s", float, 0.0, "before each case wait up to this many s for idle CPUs"),
        ("--idle-threshold", float, 0.15, "'idle': at most this share (0..1) of the CPUs busy"),
        ("--retries", int, 0, "re-run a case disturbed by other processes up to this many times"),
        ("--malloc-mmap-threshold", int, None, "glibc's MALLOC_MMAP_THRESHOLD_ for the ranks: large tensors mmap'ed"),
    ):
        p.add_argument(flag, type=kind, default=default, help=text)
    bench.add_args(p)
    args = p.parse_args(argv)
    for name, pair in by_mode.items():  # the option's value if given, else the benchmark's default for this mode
        setattr(args, name, getattr(args, name) or pair[args.quick])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # each rank sets its own count with torch.set_num_threads
    if args.malloc_mmap_threshold is not None:  # read by glibc when the fork server starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    session = Session(bench, args)
    bench.plan(session)
    print("\n" + session.finish())
    print(f"\nwrote {session.out / bench.name}.json and {bench.name}_*.png")
    return 0
