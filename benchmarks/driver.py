"""The benchmark driver: fresh processes per configuration, measured time and memory, JSON/PNG/tables.

A benchmark module is its configurations, how to build the attention, and its tables; it hands
them to :func:`main` as a :class:`Benchmark` (see ``benchmarks/README.md``, "Adding a benchmark").
For every :class:`Case` the driver

- estimates one call from the useful GFLOP/s measured so far and skips it, recorded with the
  estimate, above ``--max-call-s`` or when its extrapolated memory exceeds what is available;
- optionally waits for idle CPUs, then starts ``case.world`` fresh rank processes with
  :func:`ds_ring.testing.spawn_ranks` (forked from a server that imported torch and ds_ring once;
  gloo on loopback unless ``case.group`` is False), each running :func:`attention_rank`;
- measures how much CPU *other* processes used meanwhile and re-runs a disturbed case
  (``--retries``), keeping the least disturbed attempt;
- turns the ranks' results into a :class:`Row` and rewrites the JSON, so an interrupted run keeps
  what it measured.

Units: seconds (``*_s``), MiB = 2**20 bytes (``*_mib``), GFLOP = 1e9 flop. Memory is measured
(resident set size of each rank's own process), never estimated.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ds_ring.testing import PRELOAD as RUNNER_PRELOAD
from ds_ring.testing import RankOutcome, spawn_ranks

__all__ = [
    "AttentionFn", "Benchmark", "Case", "causal_pairs", "Column", "OTHER_CPU_WARN", "Row", "Series", "Session",
    "Skip", "Target", "find", "fmt_seq", "format_targets", "kept_positions", "main", "markdown_table", "pairs_dense",
    "pairs_dilated", "plot_panels", "plot_rows", "ratio", "useful_gflop"
]  # fmt: skip

MIB = float(2**20)
OTHER_CPU_WARN = 0.10
"""Above this share of all CPUs used by other processes while a case ran, its timings are flagged."""
BWD_FLOP_FACTOR = 2.5
"""Backward flop = 2.5 × forward flop (the FlashAttention convention): forward+backward = 3.5 × forward."""
GRACE_AFTER_FAILURE_S = 10.0
"""Once a rank has failed, the others get this many seconds to finish before they are killed."""
ROOT = Path(__file__).resolve().parent.parent
PRELOAD = (*RUNNER_PRELOAD, "ds_ring", "benchmarks.driver")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_CLK_TCK = os.sysconf("SC_CLK_TCK")

AttentionFn = Callable[..., Any]
"""What a benchmark's ``build`` returns: ``attn(q, k, v, segment_lengths, dilation_rates) -> out`` on this
rank's shards ``[batch, seq/p, heads, head_dim]``; the branches are None for dense attention."""


class Skip(Exception):
    """Raised by a ``build`` when a case cannot run here (a peer library not installed): recorded, not an error."""


@dataclass(frozen=True)
class Case:
    """One configuration: which attention, on what shapes, on how many rank processes.

    impl: the implementation's key, read by the benchmark's ``build``. seq: total tokens.
    world: rank processes; threads: torch threads per rank. segment_lengths / dilation_rates:
    LongNet branches over the global sequence (None: dense). layout: how the sequence is sharded.
    ulysses: Ulysses degree of the topology (ring degree = world / ulysses). group: join a gloo
    group (False: one process without ``torch.distributed``). fwd: also time forward-only calls.
    warmup_seq: the untimed warm-up call uses the case's branches at this length (None: dense
    attention over max(1024, 256·world) tokens, checked against ``ds_ring.ring_dilated_attention``).
    tag: the benchmark's grouping of rows (table section, attention kind).
    """

    impl: str
    seq: int
    world: int = 1
    threads: int = 1
    causal: bool = True
    segment_lengths: tuple[int, ...] | None = None
    dilation_rates: tuple[int, ...] | None = None
    layout: str = "contiguous"
    ulysses: int = 1
    group: bool = True
    fwd: bool = False
    warmup_seq: int | None = None
    tag: str = ""
    batch: int = 1
    heads: int = 8
    head_dim: int = 64

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Case:
        branches = {k: tuple(data[k]) if data[k] is not None else None for k in ("segment_lengths", "dilation_rates")}
        return cls(**{**data, **branches})


def kept_positions(seg_len: int, offset: int, rate: int) -> int:
    """Positions ``offset, offset + rate, ...`` inside a segment of ``seg_len``."""
    return 0 if seg_len <= offset else (seg_len - offset + rate - 1) // rate


def causal_pairs(m: int, causal: bool) -> int:
    """(query, key) pairs of an m×m block: all, or the m(m+1)/2 unmasked ones if causal."""
    return m * (m + 1) // 2 if causal else m * m


def pairs_dense(seq: int, heads: int, causal: bool) -> int:
    """Pairs of full attention over ``seq`` positions for ``heads`` heads."""
    return heads * causal_pairs(seq, causal)


def pairs_dilated(seq: int, heads: int, segs: Sequence[int], rates: Sequence[int], causal: bool) -> int:
    """Pairs of LongNet dilated attention where every head runs every branch (ds_ring).

    Head ``h`` uses offset ``h % r``; segments of length ``w``, the last one possibly shorter.
    """
    total = 0
    for w, r in zip(segs, rates, strict=True):
        lens = [w] * (seq // w) + ([seq % w] if seq % w else [])
        total += sum(causal_pairs(kept_positions(n, h % r, r), causal) for h in range(heads) for n in lens)
    return total


def useful_gflop(case: Case, pairs: int | None = None) -> float:
    """Useful forward+backward GFLOP of one call: 4·head_dim flop per computed unmasked (query, key)
    pair (QKᵀ and PV) × batch, × 3.5 for forward + backward. ``pairs`` defaults to dense or every
    head computing every branch; work a kernel wastes on masked blocks is not counted."""
    if pairs is None:
        segs, rates = case.segment_lengths, case.dilation_rates
        pairs = (
            pairs_dense(case.seq, case.heads, case.causal)
            if segs is None
            else pairs_dilated(case.seq, case.heads, segs, rates or (), case.causal)
        )
    return (1.0 + BWD_FLOP_FACTOR) * 4.0 * case.head_dim * case.batch * pairs / 1e9


def current_rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``), bytes."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def max_rss_bytes() -> int:
    """RSS high-water mark of this process (``ru_maxrss``, KiB on Linux), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc ``malloc_trim``) before a baseline."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler:
    """Context manager: the peak RSS above the RSS at entry, sampled every ``interval_s`` (5 ms) by a
    thread and checked against the ``ru_maxrss`` high-water mark (which catches spikes between
    samples, but only counts if it rose during the region). Bytes: ``baseline``, ``peak``."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.baseline = self.peak = self.maxrss_before = self.maxrss_after = self.samples = 0
        self._stop = threading.Event()
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _read(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._read())
            self.samples += 1

    def __enter__(self) -> RssSampler:
        self.baseline = self.peak = self._read()
        self.maxrss_before = max_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())
        self.maxrss_after = max_rss_bytes()
        os.close(self._fd)

    def extra(self) -> tuple[int, int]:
        """(sampled, high-water-mark) peak above the baseline so far (or, after exit, in the region), bytes."""
        running = self._thread.is_alive()
        peak, maxrss = (max(self.peak, self._read()), max_rss_bytes()) if running else (self.peak, self.maxrss_after)
        grown = maxrss - self.baseline if maxrss > self.maxrss_before else 0
        return max(0, peak - self.baseline), max(0, grown)


@dataclass
class Timing:
    """One phase's calls: times (s) and the peak RSS they added above ``baseline_rss_mib`` (MiB).

    ``first_extra_mib`` covers the first call only: over later calls glibc keeps freed heap pages
    resident (its mmap threshold rises after large frees), so a peak over all calls grows with the
    number of calls. ``peak_extra_mib`` covers every call (the larger of ``sampled_extra_mib`` and
    ``maxrss_extra_mib``). ``warm``: the timed calls followed a warm-up call.
    """

    times_s: list[float]
    first_call_s: float
    warm: bool
    baseline_rss_mib: float
    first_extra_mib: float
    peak_extra_mib: float
    sampled_extra_mib: float
    maxrss_extra_mib: float
    rss_samples: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def measure(
    fn: Callable[[], object], *, calls: int, setup: Callable[[], object] | None = None, budget_s: float | None = None
) -> Timing:
    """Time calls of ``fn()`` and measure the peak RSS they add above the RSS right before the first.

    Without ``budget_s``: exactly ``calls`` timed calls, so every rank of a launch makes the same
    calls. With it: the first call is a warm-up, then up to ``calls`` timed calls while the time so
    far plus one more call fits in ``budget_s``; a first call over half the budget is the only
    sample (``warm`` False). ``setup()`` runs untimed before every call.
    """

    def timed() -> float:
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    release_free_memory()
    with RssSampler() as rss:
        start = time.perf_counter()
        first = timed()
        first_extra = max(rss.extra())
        times = [first] if budget_s is None else []
        if budget_s is None or first <= budget_s / 2:
            while len(times) < calls and (
                budget_s is None or time.perf_counter() - start + (times or [first])[-1] <= budget_s
            ):
                times.append(timed())
    sampled, maxrss = rss.extra()
    warm = budget_s is not None and bool(times)
    return Timing(
        times or [first], first, warm, rss.baseline / MIB, first_extra / MIB, max(sampled, maxrss) / MIB,
        sampled / MIB, maxrss / MIB, rss.samples,
    )  # fmt: skip


@dataclass(frozen=True)
class Protocol:
    """What every rank of a launch does: ``calls`` timed calls per phase (or ``budget_s`` per phase, one
    process only), after a small warm-up call if ``warmup``; ``timeout_s`` bounds every communication wait."""

    calls: int
    budget_s: float | None
    warmup: bool
    timeout_s: float


@dataclass
class RankResult:
    """One rank's measurements (:func:`attention_rank`). MiB are RSS of the rank's own process.

    ``rss_before_inputs_mib``: RSS right before the shards q, k, v, grad_out were allocated (after
    imports, process group and warm-up); ``inputs_mib``: what they added. Ring fields (seconds
    blocked in / in flight of ring waits, steps, bytes sent) sum ds_ring's ``ring_step`` events.
    """

    threads: int
    skipped: str | None = None
    warmup_s: float | None = None
    warmup_max_abs_err: float | None = None
    rss_before_inputs_mib: float = 0.0
    inputs_mib: float | None = None
    fwd: Timing | None = None
    fwdbwd: Timing | None = None
    blocked_s: float = 0.0
    in_flight_s: float = 0.0
    ring_steps: int = 0
    ring_bytes_sent: int = 0

    def working_mib(self, timing: Timing) -> float:
        """Peak RSS of a phase above the RSS before the shards existed: inputs, activations, gradients,
        communication buffers and kernel workspace; not the interpreter, torch or gloo's fixed buffers."""
        return timing.baseline_rss_mib + timing.peak_extra_mib - self.rss_before_inputs_mib

    def __call__(self, event: Any) -> None:
        """Hook on ds_ring's events: sum this rank's ring waits."""
        if event.kind == "ring_step":
            self.blocked_s += float(event.extra.get("wait_s", 0.0))
            self.in_flight_s += event.seconds
            self.ring_steps += 1
            self.ring_bytes_sent += event.nbytes


def attention_rank(
    rank: int, world: int, case: Case, build: Callable[[Case, int, float], AttentionFn], protocol: Protocol
) -> RankResult:
    """Rank function: build the attention, warm up, then time ``fwd`` (optional, ``no_grad``) and
    forward+backward calls on this rank's random shards ``[batch, seq/world, heads, head_dim]``."""
    import torch

    import ds_ring

    result = RankResult(threads=torch.get_num_threads())
    try:
        attn = build(case, rank, protocol.timeout_s)
    except Skip as exc:
        result.skipped = str(exc)
        return result
    gen = torch.Generator().manual_seed(1000 + rank)

    def shards(total: int) -> list[torch.Tensor]:
        shape = (case.batch, total // world, case.heads, case.head_dim)
        return [torch.randn(shape, generator=gen) for _ in range(4)]

    segs, rates = case.segment_lengths, case.dilation_rates
    if protocol.warmup:
        dense = case.warmup_seq is None
        q, k, v, grad_out = (
            t.requires_grad_(i < 3) for i, t in enumerate(shards(case.warmup_seq or max(1024, 256 * world)))
        )
        t0 = time.perf_counter()
        out = attn(q, k, v, None if dense else segs, None if dense else rates)
        out.backward(grad_out)
        result.warmup_s = time.perf_counter() - t0
        if dense and case.group:
            with torch.no_grad():
                ref = ds_ring.ring_dilated_attention(
                    q, k, v, causal=case.causal, layout=case.layout, timeout_s=protocol.timeout_s
                )
            result.warmup_max_abs_err = float((out.detach() - ref).abs().max())
        del q, k, v, grad_out, out
    release_free_memory()
    rss0 = current_rss_bytes()
    q, k, v, grad_out = shards(case.seq)
    result.rss_before_inputs_mib, result.inputs_mib = rss0 / MIB, (current_rss_bytes() - rss0) / MIB
    if case.fwd:
        with torch.no_grad():
            result.fwd = measure(lambda: attn(q, k, v, segs, rates), calls=protocol.calls, budget_s=protocol.budget_s)
    for t in (q, k, v):
        t.requires_grad_(True)

    def clear_grads() -> None:
        q.grad = k.grad = v.grad = None

    with ds_ring.register_hook(result):
        step = lambda: attn(q, k, v, segs, rates).backward(grad_out)
        result.fwdbwd = measure(step, calls=protocol.calls, setup=clear_grads, budget_s=protocol.budget_s)
    return result


def _matmul_rank(rank: int, world: int, n: int) -> float:
    """Rank function: best fp32 ``n×n @ n×n`` GFLOP/s (2·n³ flop) of 5 timed calls after one warm-up."""
    import torch

    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    torch.mm(a, b, out=c)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / min(times) / 1e9


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from the first line of ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def wait_for_idle(max_busy: float, timeout_s: float) -> float:
    """Wait up to ``timeout_s`` until the CPUs are at most ``max_busy`` (0..1) busy over 1 s; the last busy share."""
    deadline = time.monotonic() + timeout_s
    while True:
        b0, t0 = cpu_jiffies()
        time.sleep(1.0)
        b1, t1 = cpu_jiffies()
        busy = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        if busy <= max_busy or time.monotonic() >= deadline:
            return busy


def _meminfo_mib(key: str) -> float | None:
    """A ``/proc/meminfo`` field (kB there) in MiB, or None."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return None


def source_digest() -> str:
    """Short SHA-256 over ds_ring's ``*.py`` files (paths and contents): the exact library code measured."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "ds_ring").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def machine_info(packages: Iterable[str]) -> dict[str, Any]:
    """Date, CPU, cores, memory, load, Python, platform, versions of torch and ``packages``, commit, ds_ring digest."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    versions = {}
    for pkg in ("torch", *packages):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    return {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu or platform.processor(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "mem_total_gib": (_meminfo_mib("MemTotal") or 0.0) / 1024,
        "loadavg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "git_commit": commit.stdout.strip() or None,
        "ds_ring_source_sha256": source_digest(),
    }


@dataclass
class Throughput:
    """Useful GFLOP/s per busy core, measured per implementation (row label): estimates cases not yet run.

    A launch keeps min(ranks × threads, cores) cores busy; a measurement during which other processes
    used a share ``f`` of the CPUs is scaled by ``1 − f``. Before an implementation is measured,
    ``efficiency × matmul_per_core`` is assumed.
    """

    cores: int
    matmul_per_core: float
    measured: dict[Any, tuple[float, str]] = field(default_factory=dict)

    def busy_cores(self, case: Case) -> int:
        return max(1, min(case.world * case.threads, self.cores))

    def record(self, key: str, case: Case, gflop: float, seconds: float, other: float | None) -> None:
        """One measured call of ``case``, an implementation named ``key``: ``gflop`` useful GFLOP in ``seconds``."""
        rate = gflop / (seconds * (1.0 - min(other or 0.0, 0.9))) / self.busy_cores(case)
        basis = f"{fmt_seq(case.seq)} p={case.world}"
        self.measured[key] = self.measured[(key, case.world)] = (rate, basis)

    def estimate_s(self, key: str, case: Case, gflop: float, efficiency: float) -> tuple[float, str]:
        """(seconds, how) for one forward+backward call of ``case``: as measured for ``key`` (at the same p if
        possible), else ``efficiency`` × the matmul GFLOP/s per core."""
        known = [k for k in ((key, case.world), key) if k in self.measured]
        if known:
            rate, basis = self.measured[known[0]]
            how = f"measured {rate:.1f} GFLOP/s per core on {basis}"
        else:
            rate = efficiency * self.matmul_per_core
            how = f"assumed {rate:.1f} GFLOP/s per core ({efficiency:.0%} of matmul; not measured yet)"
        cores = self.busy_cores(case)
        seconds = gflop / (rate * cores)
        return seconds, f"{gflop / 1e3:.2f} TFLOP useful at {how} × {cores} cores = {seconds:.0f} s"


@dataclass
class Row:
    """One case's table row: its measurements over all ranks, or why it has none (``notes``).

    Times are the slowest rank's median (ranks wait for each other). ``peak_mib`` / ``fwd_peak_mib``:
    the largest rank's working memory (:meth:`RankResult.working_mib`) during the forward+backward /
    forward calls; ``first_extra_mib`` / ``fwd_first_extra_mib``: the largest rank's peak above the
    phase's baseline during its first call. ``compute_s_per_rank`` = timed wall − blocked in ring
    waits; ``overlap_ratio`` = slowest rank's timed wall ÷ largest compute (1.00: communication
    hidden). ``other_cpu_pct``: share of all CPUs other processes used during the launch.
    """

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
    reused_from: str | None = None
    notes: list[str] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.case.seq / self.fwdbwd_s if self.fwdbwd_s else None

    @property
    def gflops(self) -> float | None:
        """Useful forward+backward GFLOP/s of all ranks together."""
        return self.useful_gflop / self.fwdbwd_s if self.fwdbwd_s else None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Row:
        return cls(**{**data, "case": Case.from_json(data["case"])})


def summarize(row: Row, outcomes: list[RankOutcome], wall_s: float, other: float | None, budgeted: bool) -> None:
    """Fill ``row`` from one launch's outcomes (in place); ``budgeted``: the phases ran on a time budget."""
    row.raw = [
        {"rank": o.rank, "error": o.error, "cpu_s": o.cpu_s, "peak_rss_mib": o.peak_rss_mib,
         **(dataclasses.asdict(o.value) if o.ok else {})}
        for o in outcomes
    ]  # fmt: skip
    row.other_cpu_pct = 100.0 * other if other is not None else None
    row.launch_wall_s, row.loadavg_1m = wall_s, os.getloadavg()[0]
    row.notes = []
    errors = [f"rank {o.rank}: {o.error.strip().splitlines()[-1]}" for o in outcomes if not o.ok]
    if errors:  # a failing rank usually makes its peers fail too: the first error is the cause
        row.notes.append("error: " + errors[0] + (f" (+{len(errors) - 1} more ranks)" if len(errors) > 1 else ""))
    results = [o.value for o in outcomes if o.ok]
    row.notes += sorted({f"skipped: {r.skipped}" for r in results if r.skipped})
    if errors or any(r.fwdbwd is None for r in results):
        return
    fb = [r.fwdbwd for r in results]
    row.calls = len(fb[0].times_s)
    row.fwdbwd_s = max(t.median_s for t in fb)
    row.peak_mib_per_rank = [r.working_mib(r.fwdbwd) for r in results]
    row.peak_mib = max(row.peak_mib_per_rank)
    row.first_extra_mib = max(t.first_extra_mib for t in fb)
    row.inputs_mib = max(r.inputs_mib or 0.0 for r in results)
    if all(r.fwd for r in results):
        row.fwd_s = max(r.fwd.median_s for r in results)
        row.fwd_peak_mib = max(r.working_mib(r.fwd) for r in results)
        row.fwd_first_extra_mib = max(r.fwd.first_extra_mib for r in results)
    errs = [r.warmup_max_abs_err for r in results if r.warmup_max_abs_err is not None]
    row.warmup_max_abs_err = max(errs) if errs else None
    if all(r.ring_steps for r in results):
        walls = [sum(t.times_s) for t in fb]
        row.blocked_s_per_rank = [r.blocked_s for r in results]
        row.compute_s_per_rank = [w - r.blocked_s for w, r in zip(walls, results, strict=True)]
        row.overlap_ratio = max(walls) / max(row.compute_s_per_rank) if max(row.compute_s_per_rank) > 0 else None
    if budgeted:
        row.notes += [
            f"{name}: single cold call" for name, t in (("fwd", results[0].fwd), ("fwd+bwd", fb[0])) if t and not t.warm
        ]
    if other is not None and other > OTHER_CPU_WARN:
        row.notes.append(f"other processes used {100 * other:.0f}% of the CPUs: timing disturbed")


@dataclass(frozen=True)
class Target:
    """A figure the issue set a goal for, reported (never asserted): ``met`` None = for information."""

    target: str
    value: float | str
    met: bool | None
    detail: str


@dataclass(frozen=True)
class Benchmark:
    """What a benchmark module hands to :func:`main`.

    name: output stem (``<name>.json``, ``<name>_*.png``); module: what ``python -m`` runs; title: one line.
    plan(session): runs every case in order with ``session.run(case)`` (later cases may depend on earlier rows).
    build(case, rank, timeout_s): returns the :data:`AttentionFn`; module-level, as it is pickled by
    reference into every rank; raises :class:`Skip` when the case cannot run here.
    report(session): the markdown tables and targets (set ``session.targets``), printed and kept in the JSON.
    plots(session): writes the PNGs into ``session.out``. config(args): the run's settings for the JSON.
    add_args(parser): the benchmark's own options. label(case): the row's name in tables and plots.
    flop(case): useful GFLOP of one forward+backward call. efficiency: GFLOP/s per core as a fraction
    of 1-thread matmul assumed per impl before it is measured (default 0.35). packages: versions to record.
    calls: timed calls per phase (quick: 1). max_call_s: (full, quick) skip threshold. budget_s: (full,
    quick) seconds per phase: one-process cases whose first call is their warm-up (else a small warm-up
    call and exactly ``calls`` calls on every rank). rank: the rank function, ``rank(rank, world, case,
    build, protocol) -> RankResult`` (default :func:`attention_rank`; ``benchmarks.hf`` times training steps).
    """

    name: str
    module: str
    title: str
    plan: Callable[[Session], None]
    build: Callable[[Case, int, float], AttentionFn]
    report: Callable[[Session], str]
    plots: Callable[[Session], None]
    config: Callable[[argparse.Namespace], dict[str, Any]] = lambda args: {}
    add_args: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    label: Callable[[Case], str] = lambda case: case.impl
    flop: Callable[[Case], float] = useful_gflop
    efficiency: Mapping[str, float] = field(default_factory=dict)
    packages: tuple[str, ...] = ()
    calls: int = 2
    max_call_s: tuple[float, float] = (600.0, 120.0)
    budget_s: tuple[float, float] | None = None
    rank: Callable[..., RankResult] = attention_rank


class Session:
    """One run of a benchmark: the rows measured so far, the estimates, and the report they make."""

    def __init__(self, bench: Benchmark, args: argparse.Namespace) -> None:
        self.bench, self.args = bench, args
        self.out = Path(args.out)
        self.started = time.perf_counter()
        self.rows: list[Row] = []
        self.targets: list[Target] = []
        self.extra: dict[str, Any] = {}
        """More for the JSON (the suite's fit search)."""
        self.machine = machine_info(bench.packages)
        self.cores: int = self.machine["usable_cpus"]
        self.matmul_gflops: dict[str, float | None] = {}
        self.throughput = Throughput(self.cores, self.matmul(1, 2048, "start") or 50.0)
        self.memory_seen: dict[tuple[str, int], tuple[int, float]] = {}
        self.reuse = _reusable(args.reuse or [], self.machine["ds_ring_source_sha256"])
        self.text = ""
        print(f"{bench.name}: fp32 matmul 2048², 1 thread: {self.throughput.matmul_per_core:.1f} GFLOP/s", flush=True)

    def matmul(self, threads: int, n: int, when: str) -> float | None:
        """fp32 ``n×n`` matmul GFLOP/s with ``threads`` threads in a fresh process; kept in the JSON under ``when``."""
        (got,) = spawn_ranks(
            _matmul_rank, 1, timeout_s=120, args=(n,), threads_per_rank=threads, process_group=False, preload=PRELOAD
        )
        self.matmul_gflops[f"n={n} threads={threads} {when}"] = got.value
        return got.value

    def run(self, case: Case, *, calls: int | None = None) -> Row:
        """Measure ``case`` (or reuse, or skip it with the reason); append, print and save its row."""
        procs = f"{case.world}×{case.threads}" + (
            f" (>{self.cores} cores)" if case.world * case.threads > self.cores else ""
        )
        row = Row(case, self.bench.label(case), procs, self.bench.flop(case))
        if case in self.reuse:
            old = self.reuse[case]
            row = dataclasses.replace(
                old, label=row.label, procs=procs, notes=[*old.notes, f"reused from {old.reused_from}"]
            )
        else:
            row.estimated_call_s, why = self._estimate(row)
            if why is not None:
                row.notes.append("skipped: " + why)
            else:
                single = row.estimated_call_s > self.args.single_call_above_s
                self._measure(row, calls or (1 if single else self.args.calls))
        if row.fwdbwd_s:
            self.throughput.record(row.label, case, row.useful_gflop, row.fwdbwd_s, (row.other_cpu_pct or 0.0) / 100)
            self.memory_seen[(row.label, case.world)] = (case.seq, row.peak_mib or 0.0)
        self.rows.append(row)
        print(
            f"  {row.label:>44} {fmt_seq(case.seq):>5} {procs:>5} fwd+bwd={row.fwdbwd_s or math.nan:.3f}s "
            f"peak={row.peak_mib or math.nan:.0f}MiB/rank {'; '.join(row.notes)[:300]}",
            flush=True,
        )
        self.write_json()
        return row

    def _estimate(self, row: Row) -> tuple[float | None, str | None]:
        """(one call's estimated seconds, the reason to skip the case or None); estimates are per label."""
        case = row.case
        if case.seq % case.world:
            return None, f"seq {case.seq} is not divisible by {case.world} ranks"
        efficiency = self.bench.efficiency.get(case.impl, 0.35)
        est_s, how = self.throughput.estimate_s(row.label, case, row.useful_gflop, efficiency)
        if est_s > self.args.max_call_s:
            return est_s, f"one fwd+bwd call estimated {how} > --max-call-s {self.args.max_call_s:.0f}"
        seen, available = self.memory_seen.get((row.label, case.world)), _meminfo_mib("MemAvailable")
        if seen and seen[1] and available and seen[1] * case.seq / seen[0] * case.world > 0.8 * available:
            return est_s, (
                f"estimated {seen[1] * case.seq / seen[0]:.0f} MiB per rank × {case.world} ranks (from "
                f"{fmt_seq(seen[0])}: {seen[1]:.0f} MiB, ∝ seq) > 80% of the {available:.0f} MiB available"
            )
        return est_s, None

    def _measure(self, row: Row, calls: int) -> None:
        """Launch the case, re-running it up to ``--retries`` times while disturbed; keep the least disturbed."""
        args, case = self.args, row.case
        budget_s = getattr(args, "budget_s", None)
        assert budget_s is None or case.world == 1, "time-budgeted phases need one process"
        protocol = Protocol(calls, budget_s, warmup=budget_s is None, timeout_s=args.timeout_s)
        timeout_s = max(300.0, 4.0 * (row.estimated_call_s or 0.0) * (calls + 1) + 120.0)
        best: tuple[list[RankOutcome], float, float | None] | None = None
        for _ in range(1 + args.retries):
            if args.wait_idle_s > 0:
                wait_for_idle(args.idle_threshold, args.wait_idle_s)
            got = self._launch(case, protocol, timeout_s)
            row.attempts_other_cpu_pct.append(100.0 * got[2] if got[2] is not None else None)
            if best is None or (got[2] or 0.0) < (best[2] or 0.0):
                best = got
            measured = all(o.ok and o.value.fwdbwd for o in got[0])
            if not measured or (got[2] or 0.0) <= OTHER_CPU_WARN:
                break
        summarize(row, *best, budgeted=budget_s is not None)

    def _launch(
        self, case: Case, protocol: Protocol, timeout_s: float
    ) -> tuple[list[RankOutcome], float, float | None]:
        """(outcomes, wall s, share of all CPUs other processes used meanwhile): /proc/stat busy time minus
        the ranks' and this process's own CPU time."""
        busy0, total0 = cpu_jiffies()
        own0, t0 = _own_cpu_s(), time.perf_counter()
        outcomes = spawn_ranks(
            self.bench.rank, case.world, timeout_s=timeout_s, args=(case, self.bench.build, protocol),
            threads_per_rank=case.threads, process_group=case.group, grace_s=GRACE_AFTER_FAILURE_S, preload=PRELOAD,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        busy1, total1 = cpu_jiffies()
        ours = sum(o.cpu_s or 0.0 for o in outcomes) + _own_cpu_s() - own0
        capacity = (total1 - total0) / _CLK_TCK
        return outcomes, wall, max(0.0, (busy1 - busy0) / _CLK_TCK - ours) / capacity if capacity > 0 else None

    def finish(self) -> str:
        """Matmul ceiling and ds_ring digest at the end, the report, JSON and PNGs; returns the markdown."""
        self.matmul(1, 2048, "end")
        self.extra["ds_ring_source_sha256_end"] = source_digest()
        self.extra["wall_s"] = time.perf_counter() - self.started
        self.text = self.header() + "\n\n" + self.bench.report(self)
        self.write_json()
        self.out.mkdir(parents=True, exist_ok=True)
        self.bench.plots(self)
        return self.text

    def header(self) -> str:
        """One paragraph: what ran, where, the matmul ceiling, and how disturbed the machine was."""
        m, mm, rows = self.machine, self.matmul_gflops, self.rows
        start, end = (mm.get(f"n=2048 threads=1 {w}") or math.nan for w in ("start", "end"))
        loads = max([m["loadavg_1m"], *(r.loadavg_1m or 0.0 for r in rows)])
        reused = sum(r.reused_from is not None for r in rows)
        return (
            f"**{self.bench.title}** ({'quick' if self.args.quick else 'full'}; `{self.command}`): "
            f"{m['cpu_model']}, {self.cores} usable CPUs, {m['mem_total_gib']:.0f} GiB; torch "
            f"{m['versions'].get('torch')}; {m['date_utc']}. fp32 matmul 2048², 1 thread: {start:.1f} GFLOP/s at "
            f"start, {end:.1f} at end. Ranks are processes ('procs × threads'): more than {self.cores} time-share "
            f"the cores (their times include that; their memory does not). Run took {self.extra['wall_s']:.0f} s; "
            f"other processes used at most {max((r.other_cpu_pct or 0.0 for r in rows), default=0.0):.0f}% of the "
            f"CPUs during a configuration ('other load %'); highest 1-min load average {loads:.1f}."
            + (f" {reused} of {len(rows)} rows were reused from earlier undisturbed runs (--reuse)." if reused else "")
        )

    @property
    def command(self) -> str:
        return " ".join(["python", "-m", self.bench.module, *sys.argv[1:]])

    def write_json(self) -> Path:
        """Write ``<out>/<name>.json`` atomically: machine, settings, every row with every rank's numbers."""
        report = {
            "benchmark": self.bench.name,
            "mode": "quick" if self.args.quick else "full",
            "command": self.command,
            "args": vars(self.args),
            "config": self.bench.config(self.args),
            "machine": self.machine,
            "matmul_gflops": self.matmul_gflops,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "targets": [dataclasses.asdict(t) for t in self.targets],
            "report": self.text,
            **self.extra,
        }
        path = self.out / f"{self.bench.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(path)
        return path


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reusable(paths: Sequence[str], digest: str) -> dict[Case, Row]:
    """Measured rows of earlier JSON files of this driver, measured with this ds_ring source (start and end)
    while other processes used at most :data:`OTHER_CPU_WARN` of the CPUs; the least disturbed per case."""
    best: dict[Case, Row] = {}
    for path in paths:
        old = json.loads(Path(path).read_text())
        if "matmul_gflops" not in old:  # rows of the benchmarks before this driver have no Case
            print(f"--reuse {path}: not written by this driver, ignored", file=sys.stderr)
            continue
        if {old["machine"]["ds_ring_source_sha256"], old.get("ds_ring_source_sha256_end", digest)} != {digest}:
            print(f"--reuse {path}: measured with other ds_ring code, ignored", file=sys.stderr)
            continue
        for data in old["rows"]:
            row = Row.from_json(data)
            other = row.other_cpu_pct
            if row.fwdbwd_s is None or other is None or other > 100 * OTHER_CPU_WARN:
                continue
            if row.case not in best or other < (best[row.case].other_cpu_pct or 0.0):
                row.reused_from = row.reused_from or f"{path} ({old['machine']['date_utc']})"
                best[row.case] = row
    return best


def fmt_seq(n: int) -> str:
    """Sequence length for display: 8192 -> '8K', 1536 -> '1536'."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def find(rows: Iterable[Row], **fields: Any) -> Row | None:
    """The first row whose case has these field values, e.g. ``find(rows, impl="rap", seq=8192, world=2)``."""
    return next((r for r in rows if all(getattr(r.case, k) == v for k, v in fields.items())), None)


def ratio(num: Row | None, den: Row | None, attr: str = "fwdbwd_s") -> float | None:
    """``num.attr ÷ den.attr`` (None when either is missing). Time of a reference ÷ a row's = how many times faster."""
    a, b = (getattr(r, attr) if r is not None else None for r in (num, den))
    return a / b if a and b else None


@dataclass(frozen=True)
class Column:
    """One markdown-table column: header, the row's value, and a format spec or callable."""

    header: str
    get: Callable[[Row], Any]
    fmt: str | Callable[[Any], str] = "{}"


def markdown_table(rows: Sequence[Row], columns: Sequence[Column]) -> str:
    """GitHub markdown table; a missing (None) value prints as '—'."""

    def cell(row: Row, col: Column) -> str:
        value = col.get(row)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "—"
        return col.fmt(value) if callable(col.fmt) else col.fmt.format(value)

    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows])


def format_targets(targets: Sequence[Target]) -> str:
    """Markdown list: met / NOT met / info, the value and what it rests on."""
    if not targets:
        return "**Targets**: nothing measured to evaluate."
    lines = ["**Targets** (reported, not asserted):", ""]
    for t in targets:
        shown = f"{t.value:.2f}" if isinstance(t.value, float) else str(t.value)
        lines.append(
            f"- [{ {True: 'met', False: 'NOT met', None: 'info'}[t.met] }] {t.target}: **{shown}** — {t.detail}"
        )
    return "\n".join(lines)


@dataclass
class Series:
    """One line of a plot: x values, y values and a matplotlib format."""

    label: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    style: str = "-o"
    kwargs: dict[str, Any] = field(default_factory=dict)


def plot_panels(
    path: Path, panels: Sequence[tuple[str, Sequence[Series]]], *, xlabel: str, ylabel: str, title: str,
    xticks: Sequence[int], logy: bool = True, logx: bool = True,
) -> Path:  # fmt: skip
    """Side-by-side panels (title, series) sharing the y axis, x ticks labelled with :func:`fmt_seq`; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, (panel_title, series) in zip(axes[0], panels, strict=True):
        for s in series:
            xs, ys = zip(*sorted(zip(s.x, s.y, strict=True)), strict=True)
            ax.plot(xs, ys, s.style, label=s.label, **s.kwargs)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xticks(list(xticks), [fmt_seq(int(t)) for t in xticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set(title=panel_title, xlabel=xlabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_rows(
    path: Path, rows: Sequence[Row], *, panel: Callable[[Row], str | None], ylabel: str, title: str,
    phases: Sequence[tuple[str, Callable[[Row], float | None], str]] = (("", lambda r: r.fwdbwd_s, "-o"),),
    x: Callable[[Row], int] = lambda r: r.case.seq, xlabel: str = "total sequence length", logy: bool = True,
) -> Path | None:  # fmt: skip
    """One panel per ``panel(row)`` (None: row left out), one line per (label, phase) with a colour per label."""
    panels: dict[str, dict[str, Series]] = {}
    labels = list(dict.fromkeys(r.label for r in rows))
    for r in rows:
        name = panel(r)
        for suffix, y, style in phases if name is not None else ():
            if y(r) is not None:
                color = f"C{labels.index(r.label) % 10}"
                s = panels.setdefault(name, {}).setdefault(
                    f"{r.label} {suffix}".strip(),
                    Series(f"{r.label} {suffix}".strip(), style=style, kwargs={"color": color}),
                )
                s.x.append(x(r))
                s.y.append(y(r))
    if not panels:
        return None
    ticks = sorted({x(r) for r in rows})
    items = [(name, list(series.values())) for name, series in panels.items()]
    return plot_panels(path, items, xlabel=xlabel, ylabel=ylabel, title=title, xticks=ticks, logy=logy)


def main(bench: Benchmark, argv: list[str] | None = None) -> int:
    """Parse the command line, run the benchmark's plan, print and write the report."""
    p = argparse.ArgumentParser(prog=f"python -m {bench.module}", description=bench.title)
    p.add_argument("--quick", action="store_true", help="small sizes, one timed call")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output directory")
    p.add_argument("--calls", type=int, help=f"timed calls per phase (default {bench.calls}, quick 1)")
    p.add_argument(
        "--max-call-s", type=float,
        help=f"skip a case whose one fwd+bwd call is estimated above this many s (default {bench.max_call_s[0]:.0f}, "
        f"quick {bench.max_call_s[1]:.0f})",
    )  # fmt: skip
    if bench.budget_s:
        p.add_argument(
            "--budget-s",
            type=float,
            help=f"s per phase (default {bench.budget_s[0]:.0f}, quick {bench.budget_s[1]:.0f})",
        )
    for flag, kind, default, text in (
        ("--single-call-above-s", float, 120.0, "one timed call when a call is estimated above this many s"),
        ("--timeout-s", float, 600.0, "bound on every communication wait, s"),
        ("--wait-idle-s", float, 0.0, "before each case wait up to this many s for idle CPUs"),
        ("--idle-threshold", float, 0.15, "'idle': at most this share (0..1) of the CPUs busy"),
        ("--retries", int, 0, "re-run a case disturbed by other processes up to this many times"),
        ("--malloc-mmap-threshold", int, None, "glibc's MALLOC_MMAP_THRESHOLD_ for the ranks: large tensors mmap'ed"),
    ):
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--reuse", nargs="+", metavar="JSON", help="take undisturbed rows of earlier runs (same ds_ring)")
    bench.add_args(p)
    args = p.parse_args(argv)
    args.calls = args.calls or (1 if args.quick else bench.calls)
    args.max_call_s = args.max_call_s or bench.max_call_s[args.quick]
    if bench.budget_s:
        args.budget_s = args.budget_s or bench.budget_s[args.quick]
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # each rank sets its own count with torch.set_num_threads
    if args.malloc_mmap_threshold is not None:  # read by glibc when the fork server starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    session = Session(bench, args)
    bench.plan(session)
    print("\n" + session.finish())
    print(f"\nwrote {session.out / bench.name}.json and {bench.name}_*.png")
    return 0
