"""The benchmark driver: fresh processes per configuration, measured time and memory, JSON/PNG/tables.

A benchmark module is its configurations, how to build the attention, and its tables; it hands them to :func:`main`
as a :class:`Benchmark` (see ``benchmarks/README.md``, "Adding a benchmark"). For every :class:`Case` the driver
estimates one call from the useful GFLOP/s measured so far and skips it, recorded with the estimate, above
``--max-call-s`` or when its extrapolated memory exceeds what is available; optionally waits for idle CPUs; starts
``case.world`` fresh rank processes with :func:`ds_ring.testing.spawn_ranks` (forked from a server that imported
torch and ds_ring once; gloo on loopback unless ``case.group`` is False), each running :func:`attention_rank`;
measures how much CPU *other* processes used meanwhile and re-runs a disturbed case (``--retries``), keeping the
least disturbed attempt; turns the ranks' results into a :class:`Row` and rewrites the JSON, so an interrupted run
keeps what it measured.

Units: seconds (``*_s``), MiB = 2**20 bytes (``*_mib``), GFLOP = 1e9 flop. Memory is measured (resident set size of
each rank's own process), never estimated.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import importlib.metadata
import itertools
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
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ds_ring import testing

MIB = float(2**20)
OTHER_CPU_WARN = 0.10
"""Above this share of all CPUs used by other processes while a case ran, its timings are flagged."""
BWD_FLOP_FACTOR = 2.5
"""Backward flop = 2.5 × forward flop (the FlashAttention convention): forward+backward = 3.5 × forward."""
GRACE_AFTER_FAILURE_S = 10.0
"""Once a rank has failed, the others get this many seconds to finish before they are killed."""
ROOT = Path(__file__).resolve().parent.parent
PRELOAD = (*testing.PRELOAD, "ds_ring", "benchmarks.driver")
_PAGE, _CLK_TCK = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_CLK_TCK")

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


def pairs_dilated(seq: int, heads: int, segs: Sequence[int], rates: Sequence[int], causal: bool) -> int:
    """Pairs of LongNet dilated attention where every head runs every branch (ds_ring).

    Head ``h`` uses offset ``h % r``; segments of length ``w``, the last one possibly shorter.
    """
    total = 0
    for w, r in zip(segs, rates, strict=True):
        lens = [w] * (seq // w) + ([seq % w] if seq % w else [])
        total += sum(causal_pairs(kept_positions(n, h % r, r), causal) for h in range(heads) for n in lens)
    return total


def case_pairs(case: Case, seq: int) -> int:
    """Pairs of ``case``'s attention over ``seq`` positions: dense (every head), or every head running every
    branch of ``case``."""
    if case.segment_lengths is None:
        return case.heads * causal_pairs(seq, case.causal)
    return pairs_dilated(seq, case.heads, case.segment_lengths, case.dilation_rates or (), case.causal)


def useful_gflop(case: Case, pairs: int | None = None) -> float:
    """Useful forward+backward GFLOP of one call: 4·head_dim flop per computed unmasked (query, key)
    pair (QKᵀ and PV) × batch, × 3.5 for forward + backward. ``pairs`` defaults to dense or every
    head computing every branch; work a kernel wastes on masked blocks is not counted."""
    pairs = case_pairs(case, case.seq) if pairs is None else pairs
    return (1.0 + BWD_FLOP_FACTOR) * 4.0 * case.head_dim * case.batch * pairs / 1e9


def current_rss_bytes() -> int:
    """Current resident set size of this process (``/proc/self/statm``), bytes."""
    return int(Path("/proc/self/statm").read_bytes().split()[1]) * _PAGE


def max_rss_bytes() -> int:
    """RSS high-water mark of this process (``ru_maxrss``, KiB on Linux), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def proc_mib(key: str, path: str = "/proc/meminfo") -> float | None:
    """A ``key: N kB`` field of ``path`` (``/proc/meminfo``, ``/proc/self/status``) in MiB, or None."""
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return None


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
        self.interval_s, self.samples, self._stop = interval_s, 0, threading.Event()
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _read(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak, self.samples = max(self.peak, self._read()), self.samples + 1

    def __enter__(self) -> RssSampler:
        self.baseline = self.peak = self._read()
        self.maxrss_before = self.maxrss_after = max_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak, self.maxrss_after = max(self.peak, self._read()), max_rss_bytes()
        os.close(self._fd)

    def extra(self) -> tuple[int, int]:
        """(sampled, high-water-mark) peak above the baseline so far (or, after exit, in the region), bytes."""
        running = self._thread.is_alive()
        peak, maxrss = (max(self.peak, self._read()), max_rss_bytes()) if running else (self.peak, self.maxrss_after)
        return max(0, peak - self.baseline), max(0, maxrss - self.baseline) if maxrss > self.maxrss_before else 0


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
        (setup or (lambda: None))()
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
    return Timing(
        times or [first], first, budget_s is not None and bool(times), rss.baseline / MIB, first_extra / MIB,
        max(sampled, maxrss) / MIB, sampled / MIB, maxrss / MIB, rss.samples,
    )  # fmt: skip


@dataclass(frozen=True)
class Protocol:
    """What every rank of a launch does: ``calls`` timed calls per phase after a small warm-up call, or
    ``budget_s`` per phase (one process only, no separate warm-up); ``timeout_s`` bounds every communication wait."""

    calls: int
    budget_s: float | None
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
    if protocol.budget_s is None:
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

    a, b, c, times = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n), []
    for _ in range(6):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / min(times[1:]) / 1e9


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from the first line of ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - fields[3] - fields[4], total  # busy: all but idle and iowait


def wait_for_idle(max_busy: float, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` until the CPUs are at most ``max_busy`` (0..1) busy over 1 s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        b0, t0 = cpu_jiffies()
        time.sleep(1.0)
        b1, t1 = cpu_jiffies()
        if t1 <= t0 or (b1 - b0) / (t1 - t0) <= max_busy:
            return


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
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"), "cpu_model": cpu or platform.processor(),
        "usable_cpus": len(os.sched_getaffinity(0)), "mem_total_gib": (proc_mib("MemTotal") or 0.0) / 1024,
        "loadavg_1m": os.getloadavg()[0], "python": platform.python_version(), "platform": platform.platform(),
        "versions": versions, "git_commit": commit.stdout.strip() or None, "ds_ring_source_sha256": source_digest(),
    }  # fmt: skip


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
        self.measured[key] = self.measured[(key, case.world)] = (rate, f"{fmt_seq(case.seq)} p={case.world}")

    def estimate_s(self, key: str, case: Case, gflop: float, efficiency: float) -> tuple[float, str]:
        """(seconds, how) for one forward+backward call of ``case``: as measured for ``key`` (at the same p if
        possible), else ``efficiency`` × the matmul GFLOP/s per core."""
        rate, basis = self.measured.get((key, case.world)) or self.measured.get(key) or (None, "")
        how = f"measured {rate:.1f} GFLOP/s per core on {basis}" if rate else ""
        if not rate:
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
        return self.case.batch * self.case.seq / self.fwdbwd_s if self.fwdbwd_s else None

    @property
    def gflops(self) -> float | None:
        """Useful forward+backward GFLOP/s of all ranks together."""
        return self.useful_gflop / self.fwdbwd_s if self.fwdbwd_s else None

    def largest(self, key: str) -> float | None:
        """The largest rank's raw ``key`` (None unless every rank has it)."""
        values = [r.get(key) for r in self.raw]
        return max(values) if values and None not in values else None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Row:
        return cls(**{**data, "case": Case.from_json(data["case"])})


def summarize(
    row: Row, outcomes: list[testing.RankOutcome], wall_s: float, other: float | None, budgeted: bool
) -> None:
    """Fill ``row`` from one launch's outcomes (in place); ``budgeted``: the phases ran on a time budget."""
    row.raw = [
        {"rank": o.rank, "error": o.error, "cpu_s": o.cpu_s, "peak_rss_mib": o.peak_rss_mib,
         **(asdict(o.value) if o.ok else {})}
        for o in outcomes
    ]  # fmt: skip
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
    row.calls, row.fwdbwd_s = len(fb[0].times_s), max(t.median_s for t in fb)
    row.peak_mib_per_rank = [r.working_mib(r.fwdbwd) for r in results]
    row.peak_mib, row.first_extra_mib = max(row.peak_mib_per_rank), max(t.first_extra_mib for t in fb)
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
    cold = [name for name, t in (("fwd", results[0].fwd), ("fwd+bwd", fb[0])) if budgeted and t and not t.warm]
    row.notes += [f"{name}: single cold call" for name in cold]
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
    """What a benchmark module hands to :func:`main` (``benchmarks/README.md``, "Adding a benchmark"): plan(session)
    runs ``session.run(case)`` per case; build(case, rank, timeout_s) -> :data:`AttentionFn` (module-level, pickled by
    reference into every rank; may raise :class:`Skip`); report -> markdown; targets -> :class:`Target` s printed after
    it; plots write PNGs into ``session.out``. seqs (full, quick), worlds, impls, threads: defaults of ``--seqs``,
    ``--worlds``, ``--impls``, ``--threads`` (each option only where given). flop(case): useful GFLOP of one fwd+bwd
    call; efficiency: per impl, the share of 1-thread matmul GFLOP/s per core assumed until measured (else 0.35).
    max_call_s (full, quick): skip threshold, s; budget_s (full, quick): s per phase of one-process cases whose first
    call is their warm-up; rank: the rank function (:func:`attention_rank`).
    """

    name: str
    module: str
    title: str
    plan: Callable[[Session], None]
    build: Callable[[Case, int, float], AttentionFn]
    report: Callable[[Session], str]
    plots: Callable[[Session], None]
    targets: Callable[[Session], list[Target]] | None = None
    seqs: tuple[Sequence[int], Sequence[int]] | None = None
    worlds: Sequence[int] | None = None
    impls: Sequence[str] = ()
    threads: int | None = None
    add_args: Callable[[argparse.ArgumentParser], None] = lambda parser: None
    config: Callable[[argparse.Namespace], dict[str, Any]] = lambda args: {}
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
        self.bench, self.args, self.out, self.started, self.text = bench, args, Path(args.out), time.perf_counter(), ""
        self.command = " ".join(["python", "-m", bench.module, *sys.argv[1:]])
        self.rows: list[Row] = []
        self.targets: list[Target] = []
        self.extra: dict[str, Any] = {}  # more for the JSON (the suite's fit search)
        self.machine, self.matmul_gflops = machine_info(bench.packages), {}
        self.cores: int = self.machine["usable_cpus"]
        self.throughput = Throughput(self.cores, self.matmul(1, 2048, "start") or 50.0)
        self.memory_seen: dict[tuple[str, int], tuple[int, float]] = {}  # (label, p): (seq, MiB per rank) last seen
        self.reuse = _reusable(args.reuse or [], self.machine["ds_ring_source_sha256"])
        print(f"{bench.name}: fp32 matmul 2048², 1 thread: {self.throughput.matmul_per_core:.1f} GFLOP/s", flush=True)

    def matmul(self, threads: int, n: int, when: str) -> float | None:
        """fp32 ``n×n`` matmul GFLOP/s with ``threads`` threads in a fresh process; kept in the JSON under ``when``."""
        (got,) = testing.spawn_ranks(
            _matmul_rank, 1, timeout_s=120, args=(n,), threads_per_rank=threads, process_group=False, preload=PRELOAD
        )
        self.matmul_gflops[f"n={n} threads={threads} {when}"] = got.value
        return got.value

    def run(self, case: Case, *, calls: int | None = None) -> Row:
        """Measure ``case`` (or reuse, or skip it with the reason); append, print and save its row."""
        over = case.world * case.threads > self.cores
        procs = f"{case.world}×{case.threads}" + (f" (>{self.cores} cores)" if over else "")
        row = Row(case, self.bench.label(case), procs, self.bench.flop(case))
        if case in self.reuse:
            old = self.reuse[case]
            row = replace(old, label=row.label, procs=procs, notes=[*old.notes, f"reused from {old.reused_from}"])
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
        print(f"  {row.label:>44} {fmt_seq(case.seq):>5} {procs:>5} fwd+bwd={row.fwdbwd_s or math.nan:.3f}s "
              f"peak={row.peak_mib or math.nan:.0f}MiB/rank {'; '.join(row.notes)[:300]}", flush=True)  # fmt: skip
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
        seen, available = self.memory_seen.get((row.label, case.world)), proc_mib("MemAvailable")
        if seen and seen[1] and available and seen[1] * case.seq / seen[0] * case.world > 0.8 * available:
            return est_s, (
                f"estimated {seen[1] * case.seq / seen[0]:.0f} MiB per rank × {case.world} ranks (from "
                f"{fmt_seq(seen[0])}: {seen[1]:.0f} MiB, ∝ seq) > 80% of the {available:.0f} MiB available"
            )
        return est_s, None

    def _measure(self, row: Row, calls: int) -> None:
        """Launch the case, re-running it up to ``--retries`` times while disturbed; keep the least disturbed.
        Disturbance: the share of all CPUs other processes used during the launch (``/proc/stat`` busy time
        minus the ranks' and this process's own CPU time)."""
        args, case = self.args, row.case
        budget_s = getattr(args, "budget_s", None)
        assert budget_s is None or case.world == 1, "time-budgeted phases need one process"
        protocol = Protocol(calls, budget_s, args.timeout_s)
        timeout_s = max(300.0, 4.0 * (row.estimated_call_s or 0.0) * (calls + 1) + 120.0)
        best: tuple[list[testing.RankOutcome], float, float | None] | None = None
        own_cpu_s = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # this process's user + system s
        for _ in range(1 + args.retries):
            if args.wait_idle_s > 0:
                wait_for_idle(args.idle_threshold, args.wait_idle_s)
            (busy0, total0), own0, t0 = cpu_jiffies(), own_cpu_s(), time.perf_counter()
            outcomes = testing.spawn_ranks(
                self.bench.rank, case.world, timeout_s=timeout_s, args=(case, self.bench.build, protocol),
                threads_per_rank=case.threads, process_group=case.group, grace_s=GRACE_AFTER_FAILURE_S, preload=PRELOAD,
            )  # fmt: skip
            wall, (busy1, total1) = time.perf_counter() - t0, cpu_jiffies()
            ours, capacity = sum(o.cpu_s or 0.0 for o in outcomes) + own_cpu_s() - own0, (total1 - total0) / _CLK_TCK
            other = max(0.0, (busy1 - busy0) / _CLK_TCK - ours) / capacity if capacity > 0 else None
            row.attempts_other_cpu_pct.append(100.0 * other if other is not None else None)
            if best is None or (other or 0.0) < (best[2] or 0.0):
                best = (outcomes, wall, other)
            if not all(o.ok and o.value.fwdbwd for o in outcomes) or (other or 0.0) <= OTHER_CPU_WARN:
                break
        summarize(row, *best, budgeted=budget_s is not None)

    def finish(self) -> str:
        """Matmul ceiling and ds_ring digest at the end, the report and targets, JSON and PNGs; returns the markdown."""
        self.matmul(1, 2048, "end")
        self.extra["ds_ring_source_sha256_end"] = source_digest()
        self.extra["wall_s"] = time.perf_counter() - self.started
        self.targets = self.bench.targets(self) if self.bench.targets else []
        targets = [format_targets(self.targets)] if self.bench.targets else []
        self.text = "\n\n".join([self.header(), self.bench.report(self), *targets])
        self.write_json()
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

    def write_json(self) -> None:
        """Write ``<out>/<name>.json``: machine, settings, every row with every rank's numbers."""
        write_json(self.out / f"{self.bench.name}.json", {
            "benchmark": self.bench.name, "mode": "quick" if self.args.quick else "full", "command": self.command,
            "args": vars(self.args), "config": self.bench.config(self.args), "machine": self.machine,
            "matmul_gflops": self.matmul_gflops, "rows": [asdict(r) for r in self.rows],
            "targets": [asdict(t) for t in self.targets], "report": self.text, **self.extra,
        })  # fmt: skip


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it), creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def _reusable(paths: Sequence[str], digest: str) -> dict[Case, Row]:
    """Measured rows of earlier JSON files of this driver, measured with this ds_ring source (start and end)
    while other processes used at most :data:`OTHER_CPU_WARN` of the CPUs; the least disturbed per case."""
    best: dict[Case, Row] = {}
    for path in paths:
        old = json.loads(Path(path).read_text())
        measured = old.get("machine", {}).get("ds_ring_source_sha256"), old.get("ds_ring_source_sha256_end", digest)
        if set(measured) != {digest}:
            print(f"--reuse {path}: not measured with this ds_ring code by this driver, ignored", file=sys.stderr)
            continue
        for row in map(Row.from_json, old["rows"]):
            undisturbed = row.fwdbwd_s and row.other_cpu_pct is not None and row.other_cpu_pct <= 100 * OTHER_CPU_WARN
            if undisturbed and (row.case not in best or row.other_cpu_pct < (best[row.case].other_cpu_pct or 0.0)):
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


COLUMNS = {c.header: c for c in [
    Column("impl", lambda r: r.label),
    Column("seq", lambda r: r.case.seq, fmt_seq),
    Column("causal", lambda r: "yes" if r.case.causal else "no"),
    Column("procs × threads", lambda r: r.procs),
    Column("fwd s", lambda r: r.fwd_s, "{:.3f}"),
    Column("fwd+bwd s", lambda r: r.fwdbwd_s, "{:.3f}"),
    Column("tokens/s", lambda r: r.tokens_per_s, "{:.0f}"),
    Column("useful GFLOP/s", lambda r: r.gflops, "{:.1f}"),
    Column("peak MiB/rank", lambda r: r.peak_mib, "{:.1f}"),
    Column("inputs MiB/rank", lambda r: r.inputs_mib, "{:.1f}"),
    Column("wall ÷ compute", lambda r: r.overlap_ratio, "{:.2f}"),
    Column("warm-up err", lambda r: r.warmup_max_abs_err, "{:.1e}"),
    Column("other load %", lambda r: r.other_cpu_pct, "{:.0f}"),
    Column("notes", lambda r: "; ".join(r.notes)),
]}  # fmt: skip
"""The columns tables share, by header: :func:`markdown_table` takes a header for one of these."""


def markdown_table(rows: Sequence[Any], columns: Sequence[Column | str]) -> str:
    """GitHub markdown table; a missing (None) value prints as '—'."""

    def cell(row: Any, col: Column) -> str:
        value = col.get(row)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "—"
        return col.fmt(value) if callable(col.fmt) else col.fmt.format(value)

    cols = [COLUMNS[c] if isinstance(c, str) else c for c in columns]
    lines = ["| " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows])


def format_targets(targets: Sequence[Target]) -> str:
    """Markdown list: met / NOT met / info, the value and what it rests on."""
    if not targets:
        return "**Targets**: nothing measured to evaluate."
    met = {True: "met", False: "NOT met", None: "info"}
    shown = lambda v: f"{v:.2f}" if isinstance(v, float) else v
    lines = [f"- [{met[t.met]}] {t.target}: **{shown(t.value)}** — {t.detail}" for t in targets]
    return "\n".join(["**Targets** (reported, not asserted):", "", *lines])


def compare(
    target: str, num: Row | None, den: Row | None, attr: str = "fwdbwd_s",
    met: Callable[[float], bool | None] = lambda x: None, note: str = "",
) -> list[Target]:  # fmt: skip
    """``[Target]`` of ``num.attr ÷ den.attr`` (how many times faster: a reference's time ÷ a row's), ``met(value)``,
    both values (s or MiB) and ``note`` as its detail; ``[]`` while either row is not measured."""
    if (x := ratio(num, den, attr)) is None:
        return []
    unit, spec = (" s", "{:.2f}") if attr.endswith("_s") else (" MiB", "{:.0f}")
    a, b = (spec.format(getattr(r, attr)) + unit for r in (num, den))
    return [Target(target, x, met(x), f"{a} vs {b}{note}")]


@dataclass
class Series:
    """One line of a plot: x values, y values and a matplotlib format."""

    label: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    style: str = "-o"
    kwargs: dict[str, Any] = field(default_factory=dict)


def plot_panels(
    path: Path, panels: Sequence[tuple[str, Sequence[Series]]], *, xlabel: str, ylabel: str | Sequence[str],
    title: str, xticks: Sequence[int], logy: bool = True,
) -> None:  # fmt: skip
    """Side-by-side panels (title, series), x on a log2 axis with ticks labelled by :func:`fmt_seq`; a PNG.
    ``ylabel``: of the y axis the panels share, or one per panel (each its own y axis). A panel whose lines are
    those of the panel before it gets no legend of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    shared = isinstance(ylabel, str)
    ylabels = [ylabel] + [""] * (len(panels) - 1) if shared else ylabel
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=shared, squeeze=False)
    legend: list[str] = []
    for ax, (panel_title, series), axis_label in zip(axes[0], panels, ylabels, strict=True):
        for s in series:
            xs, ys = zip(*sorted(zip(s.x, s.y, strict=True)), strict=True)
            ax.plot(xs, ys, s.style, label=s.label, **s.kwargs)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xticks(list(xticks), [fmt_seq(int(t)) for t in xticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set(title=panel_title, xlabel=xlabel, ylabel=axis_label)
        ax.grid(True, which="both", alpha=0.3)
        if legend != (legend := [s.label for s in series]):
            ax.legend(fontsize=8 if len(legend) <= 8 else 6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


Figure = tuple[str, str, Sequence[tuple[str, Callable[["Row"], float | None], str]]]
"""A figure of :func:`plot_rows`: (file name suffix, y label, phases: (line name suffix, value, matplotlib format))."""
TIME: Figure = ("time", "fwd+bwd time per call, slowest rank (s)", [("", lambda r: r.fwdbwd_s, "-o")])
MEMORY: Figure = ("memory", "peak working memory, largest rank (MiB)", [("", lambda r: r.peak_mib, "-o")])


def plot_rows(
    session: Session, panel: Callable[[Row], str | None], title: str,
    figures: Sequence[Figure] = (TIME, MEMORY), logy: bool = True,
) -> None:  # fmt: skip
    """``<out>/<name>_<figure>.png`` per figure, against the total sequence length: one panel per ``panel(row)``
    (None: row left out), one line per (label, phase) with a colour per label."""
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
            plot_panels(path, items, xlabel=xlabel, ylabel=ylabel, title=title, xticks=ticks, logy=logy)


def main(bench: Benchmark, argv: list[str] | None = None) -> int:
    """Parse the command line, run the benchmark's plan, print and write the report."""
    listed = lambda v: " ".join(map(str, v)) if isinstance(v, Sequence) else f"{v:g}"
    p = argparse.ArgumentParser(prog=f"python -m {bench.module}", description=bench.title)
    p.add_argument("--quick", action="store_true", help="small sizes, one timed call")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output directory")
    by_mode: dict[str, tuple[Any, Any]] = {}  # option: its (full, quick) default, where the benchmark has the option
    for flag, pair, kind, text, extra in (
        ("--calls", (bench.calls, 1), int, "timed calls per phase", {}),
        ("--max-call-s", bench.max_call_s, float, "skip a case estimated above this many s per fwd+bwd call", {}),
        ("--budget-s", bench.budget_s, float, "s per phase", {}),
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
    p.add_argument("--reuse", nargs="+", metavar="JSON", help="take undisturbed rows of earlier runs (same ds_ring)")
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
