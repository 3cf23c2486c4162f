"""Shared benchmark helpers: fresh-process workers, timing, measured memory, machine info, output.

Every configuration of a benchmark runs in its own fresh Python process, so that one
configuration's allocator state, thread pools or memory high-water mark cannot leak into
the next. A benchmark module ``benchmarks.<name>`` is both the driver and the worker:

    python -m benchmarks.<name> [options]             # driver: loops over configurations
    python -m benchmarks.<name> --worker '<json>'     # worker: runs one, prints one JSON line

The driver calls :func:`run_worker`; the worker's ``main`` hands its ``--worker`` argument to
:func:`worker_main`, which runs the benchmark function and prints its result dict as one
JSON line prefixed with :data:`RESULT_PREFIX`.

Units used throughout: seconds (``*_s``), MiB = 2**20 bytes (``*_mib``), GFLOP/s = 1e9 flop/s.
Memory is *measured* (resident set size of the worker process), never estimated:

- ``peak_rss_mib``: the process's RSS high-water mark (``getrusage().ru_maxrss``).
- ``peak_extra_mib``: the peak RSS above the baseline taken right before the measured region
  (after imports and input allocation). It is the larger of what a background thread sampling
  ``/proc/self/statm`` every ~5 ms saw and what the ``ru_maxrss`` high-water mark grew to
  during the region (the sampler can miss a spike shorter than its interval; the high-water
  mark cannot, but only counts if it rose above its pre-region value).

The driver side of this module imports neither torch nor matplotlib at import time, so the
driver stays light; workers import torch lazily.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
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
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "RESULT_PREFIX",
    "REPO_ROOT",
    "Column",
    "RssSampler",
    "Series",
    "Skip",
    "cpu_busy_fraction",
    "current_rss_bytes",
    "fmt_seq",
    "machine_info",
    "markdown_table",
    "matmul_gflops",
    "max_rss_bytes",
    "measure",
    "plot_panels",
    "release_free_memory",
    "run_worker",
    "set_threads",
    "source_digest",
    "thread_env",
    "wait_for_idle",
    "worker_main",
    "write_json",
]

RESULT_PREFIX = "@@BENCH_RESULT@@ "
"""Prefix of the one stdout line that carries a worker's JSON result."""

REPO_ROOT = Path(__file__).resolve().parent.parent
"""Repository root: workers run with it as working directory and on ``PYTHONPATH``."""

MIB = float(2**20)
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------


def current_rss_bytes() -> int:
    """Current resident set size of this process in bytes (from ``/proc/self/statm``)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE_BYTES


def max_rss_bytes() -> int:
    """RSS high-water mark of this process in bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssSampler:
    """Context manager measuring the peak RSS above the RSS at entry.

    On entry it records ``baseline_bytes`` (current RSS) and the ``ru_maxrss`` high-water
    mark, then starts a daemon thread that reads ``/proc/self/statm`` every ``interval_s``
    seconds (default 5 ms). On exit it stops the thread and takes a last reading.

    Attributes after exit (bytes): ``baseline_bytes``, ``peak_bytes`` (largest sampled RSS),
    ``maxrss_before_bytes``, ``maxrss_after_bytes``; ``samples`` is the number of readings.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self.maxrss_before_bytes = 0
        self.maxrss_after_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1

    def _read(self) -> int:
        data = os.pread(self._fd, 128, 0)
        return int(data.split()[1]) * _PAGE_BYTES

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = self._read()
            self.samples += 1
            if rss > self.peak_bytes:
                self.peak_bytes = rss

    def __enter__(self) -> RssSampler:
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        self._stop.clear()
        self.baseline_bytes = self._read()
        self.peak_bytes = self.baseline_bytes
        self.maxrss_before_bytes = max_rss_bytes()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._read())
        self.maxrss_after_bytes = max_rss_bytes()
        os.close(self._fd)
        self._fd = -1

    def current_extra_bytes(self) -> int:
        """While running: the peak so far above the baseline, in bytes (same rule as ``extra_bytes``)."""
        peak = max(self.peak_bytes, self._read())
        maxrss = max_rss_bytes()
        grown = maxrss - self.baseline_bytes if maxrss > self.maxrss_before_bytes else 0
        return max(0, peak - self.baseline_bytes, grown)

    @property
    def extra_sampled_bytes(self) -> int:
        """Peak sampled RSS minus the baseline, in bytes."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    @property
    def extra_maxrss_bytes(self) -> int:
        """High-water-mark growth above the baseline, in bytes (0 if the mark did not rise)."""
        if self.maxrss_after_bytes <= self.maxrss_before_bytes:
            return 0
        return max(0, self.maxrss_after_bytes - self.baseline_bytes)

    @property
    def extra_bytes(self) -> int:
        """Peak RSS above the baseline in bytes: the larger of the two measurements."""
        return max(self.extra_sampled_bytes, self.extra_maxrss_bytes)


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def set_threads(threads: int) -> None:
    """Set torch's intra-op thread count explicitly (and inter-op to 1 where still allowed)."""
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already started
        torch.set_num_interop_threads(1)


def release_free_memory() -> None:
    """Collect garbage and ask glibc to return freed heap pages to the OS (``malloc_trim``).

    Called before a baseline is taken, so that memory freed by an earlier phase but kept by
    the allocator does not hide inside the baseline. A no-op where glibc is not available.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(
    fn: Callable[[], object],
    *,
    repeats: int = 3,
    budget_s: float = 30.0,
    setup: Callable[[], object] | None = None,
    interval_s: float = 0.005,
) -> dict[str, Any]:
    """Time ``fn()`` and measure the peak RSS it adds above the current RSS.

    The first call is a warm-up (and the one that faults in fresh memory); then up to
    ``repeats`` timed calls follow while the elapsed time plus one more call stays within
    ``budget_s`` seconds. If the first call alone takes more than half the budget, it is
    the only sample and ``warm`` is False. ``setup()`` (e.g. clearing gradients) runs
    untimed before every call. The result of ``fn`` is dropped right away.

    The RSS sampler covers every call; the baseline is the RSS right before the first one,
    after :func:`release_free_memory`. The headline ``peak_extra_mib`` is the peak during the
    *first* call: over later calls glibc keeps freed heap pages resident (its mmap threshold
    rises after large frees), so the all-calls peak (``peak_extra_all_calls_mib``, also
    returned, with its sampled / high-water-mark parts) grows with the number of calls, by up
    to ~100 MiB here, and would make rows with different call counts incomparable.

    Returns a dict: ``times_s`` (timed samples, s), ``best_s``, ``median_s``, ``first_call_s``,
    ``warm``, ``baseline_rss_mib``, ``peak_extra_mib`` (first call, headline),
    ``peak_extra_all_calls_mib``, ``peak_extra_sampled_mib``,
    ``peak_extra_maxrss_mib``, ``peak_rss_mib`` (process high-water mark so far), ``rss_samples``.
    """
    release_free_memory()
    times: list[float] = []
    with RssSampler(interval_s) as sampler:
        start = time.perf_counter()
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        first_extra = sampler.current_extra_bytes()
        warm = first <= budget_s / 2
        if warm:
            last = first
            while len(times) < repeats and (time.perf_counter() - start) + last <= budget_s:
                if setup is not None:
                    setup()
                t0 = time.perf_counter()
                fn()
                last = time.perf_counter() - t0
                times.append(last)
            if not times:  # budget left no room for a second call: report the first one
                times.append(first)
                warm = False
        else:
            times.append(first)
    return {
        "times_s": times,
        "best_s": min(times),
        "median_s": statistics.median(times),
        "first_call_s": first,
        "warm": warm,
        "baseline_rss_mib": sampler.baseline_bytes / MIB,
        "peak_extra_mib": first_extra / MIB,
        "peak_extra_all_calls_mib": sampler.extra_bytes / MIB,
        "peak_extra_sampled_mib": sampler.extra_sampled_bytes / MIB,
        "peak_extra_maxrss_mib": sampler.extra_maxrss_bytes / MIB,
        "peak_rss_mib": sampler.maxrss_after_bytes / MIB,
        "rss_samples": sampler.samples,
    }


def matmul_gflops(n: int = 4096, repeats: int = 5, threads: int | None = None) -> dict[str, Any]:
    """Measure fp32 ``n×n @ n×n`` matmul throughput in this process, in GFLOP/s (2·n³ flop).

    This is the practical compute ceiling that attention kernels (matmul-bound) are judged
    against. One untimed warm-up, then ``repeats`` timed calls; returns best and median.
    """
    import torch

    if threads is not None:
        set_threads(threads)
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t0)
    flop = 2.0 * n**3
    return {
        "n": n,
        "threads": torch.get_num_threads(),
        "gflops_best": flop / min(times) / 1e9,
        "gflops_median": flop / statistics.median(times) / 1e9,
        "times_s": times,
    }


# --------------------------------------------------------------------------------------
# Fresh-process workers
# --------------------------------------------------------------------------------------


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from the first line of ``/proc/stat``."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def cpu_busy_fraction(interval_s: float = 1.0) -> float:
    """Fraction (0..1) of the machine's total CPU capacity that was busy over ``interval_s`` seconds."""
    b0, t0 = _cpu_jiffies()
    time.sleep(interval_s)
    b1, t1 = _cpu_jiffies()
    return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def wait_for_idle(max_busy: float = 0.15, timeout_s: float = 60.0, interval_s: float = 1.0) -> float:
    """Wait (up to ``timeout_s`` seconds) until the CPUs are at most ``max_busy`` busy.

    For shared machines: starting a timed configuration while other work runs skews it.
    Returns the last measured busy fraction (0..1), whether or not it got below the threshold.
    """
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy_fraction(interval_s)
    while busy > max_busy and time.monotonic() < deadline:
        busy = cpu_busy_fraction(interval_s)
    return busy


class Skip(Exception):
    """Raised by a worker function when a configuration cannot run (reported, not an error)."""


def thread_env(threads: int) -> dict[str, str]:
    """Environment for a worker: thread-pool sizes pinned, repository root on ``PYTHONPATH``."""
    env = os.environ.copy()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_worker(
    module: str,
    config: dict[str, Any],
    *,
    threads: int,
    timeout_s: float = 600.0,
    python: str | None = None,
) -> dict[str, Any]:
    """Run ``python -m <module> --worker '<json config>'`` in a fresh process; return its dict.

    The worker must print exactly one line starting with :data:`RESULT_PREFIX`. On a crash,
    a missing result line or a timeout (the child is killed after ``timeout_s`` seconds),
    the returned dict has an ``error`` key with the reason and the tail of stderr. The dict
    always carries ``process_wall_s`` (seconds, start to exit, including imports) and
    ``other_cpu_share``: the share (0..1) of the machine's CPU capacity that *other* processes
    used while the worker ran (all CPUs' busy time minus the worker's own CPU time, from
    ``/proc/stat`` and ``RUSAGE_CHILDREN``). Above ~0.1 the timings were disturbed. It is only
    meaningful while this process runs one worker at a time: concurrent workers (several ranks)
    count each other as "other", and ``RUSAGE_CHILDREN`` counts every child of this process that
    finished meanwhile.
    """
    cmd = [python or sys.executable, "-m", module, "--worker", json.dumps(config)]
    busy0, total0 = _cpu_jiffies()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    result = _run_worker_process(cmd, threads, timeout_s, t0)
    busy1, total1 = _cpu_jiffies()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    own_s = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    busy_s = (busy1 - busy0) / _CLK_TCK
    capacity_s = (total1 - total0) / _CLK_TCK
    result["other_cpu_share"] = max(0.0, busy_s - own_s) / capacity_s if capacity_s > 0 else None
    return result


def _run_worker_process(cmd: list[str], threads: int, timeout_s: float, t0: float) -> dict[str, Any]:
    """Run the worker command; return its parsed result line or an ``error`` dict."""
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO_ROOT,
            env=thread_env(threads),
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        return {
            "error": f"worker killed after the {timeout_s:.0f} s timeout",
            "stderr_tail": (stderr or "")[-2000:],
            "process_wall_s": time.perf_counter() - t0,
        }
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        return {
            "error": f"worker exited with code {proc.returncode} and no result line",
            "stderr_tail": proc.stderr[-2000:],
            "process_wall_s": wall,
        }
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_wall_s"] = wall
    return result


def worker_main(fn: Callable[[dict[str, Any]], dict[str, Any]], config_json: str) -> int:
    """Run one configuration in this (fresh) process and print its result line.

    ``fn(config)`` returns a JSON-serialisable dict. A :class:`Skip` becomes
    ``{"skipped": reason}``, any other exception ``{"error": ..., "traceback": ...}``.
    The process's final ``peak_rss_mib`` (``ru_maxrss``) and load average are added.
    Returns the exit status (0 when a result line was printed).
    """
    config = json.loads(config_json)
    try:
        result = fn(config)
    except Skip as exc:
        result = {"skipped": str(exc)}
    except Exception as exc:  # reported to the driver, which records it per configuration
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    result["process_peak_rss_mib"] = max_rss_bytes() / MIB
    result["loadavg_end"] = os.getloadavg()[0]
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------------------
# Machine info and output
# --------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20  # kB -> GiB
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def source_digest(package_dir: str | os.PathLike[str] = REPO_ROOT / "ds_ring") -> str | None:
    """Short SHA-256 over the ``*.py`` files of ``package_dir`` (paths and contents), or None.

    Identifies the exact library code a result was measured with, even without a commit.
    """
    import hashlib

    root = Path(package_dir)
    files = sorted(root.rglob("*.py"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def machine_info(extra_packages: Iterable[str] = ()) -> dict[str, Any]:
    """Describe the machine and software (without importing torch): for every result JSON.

    Keys: ``date_utc`` (ISO 8601), ``cpu_model``, ``logical_cpus``, ``usable_cpus`` (affinity),
    ``mem_total_gib``, ``loadavg_1m`` (other load on the machine skews timings),
    ``python``, ``platform``, ``torch`` and each of ``extra_packages`` (installed versions,
    None if absent), ``git_commit``, ``ds_ring_source_sha256`` (:func:`source_digest`).
    """
    info: dict[str, Any] = {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "mem_total_gib": _mem_total_gib(),
        "loadavg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
    }
    for pkg in extra_packages:
        info[pkg] = _version(pkg)
    info["git_commit"] = _git_commit()
    info["ds_ring_source_sha256"] = source_digest()
    return info


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically (via ``<path>.tmp``); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
    return path


def fmt_seq(n: int) -> str:
    """Sequence length for display: 8192 -> '8K', 1536 -> '1536'."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class Column:
    """One markdown-table column: row key, header text, and a format spec or callable."""

    key: str
    header: str
    fmt: str | Callable[[Any], str] = "{}"


def _cell(value: Any, fmt: str | Callable[[Any], str]) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if callable(fmt):
        return fmt(value)
    return fmt.format(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Render ``rows`` as a GitHub markdown table; a missing or None value prints as '—'."""
    header = "| " + " | ".join(c.header for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_cell(r.get(c.key), c.fmt) for c in columns) + " |" for r in rows]
    return "\n".join([header, rule, *body])


@dataclass
class Series:
    """One line of a plot: x values, y values (None = missing point) and a matplotlib format."""

    label: str
    x: list[float]
    y: list[float | None]
    style: str = "-o"
    kwargs: dict[str, Any] = field(default_factory=dict)


def plot_panels(
    path: str | os.PathLike[str],
    panels: Sequence[tuple[str, Sequence[Series]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = True,
    logy: bool = True,
    xticks: Sequence[int] | None = None,
) -> Path:
    """Draw side-by-side panels (title, series) sharing the y axis; save a PNG (Agg backend).

    With ``xticks`` the x axis is labelled with those values formatted by :func:`fmt_seq`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    for ax, (panel_title, series) in zip(axes[0], panels, strict=True):
        for s in series:
            pts = [(x, y) for x, y in zip(s.x, s.y, strict=True) if y is not None]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, s.style, label=s.label, **s.kwargs)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        if xticks is not None:
            ax.set_xticks(list(xticks))
            ax.set_xticklabels([fmt_seq(int(t)) for t in xticks])
            ax.xaxis.set_minor_locator(NullLocator())
        ax.set_title(panel_title)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
