"""What every benchmark shares: RSS and its peak, timed calls, the machine, the CPU time others used, JSON and PNGs.
MiB = 2**20 bytes, seconds, GFLOP = 1e9 flop."""

import contextlib
import ctypes
import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MIB = float(2**20)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"  # where the JSON and PNGs go unless --out says otherwise
_PAGE = os.sysconf("SC_PAGE_SIZE")


def current_rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_bytes().split()[1]) * _PAGE


def proc_mib(key: str, path: str = "/proc/meminfo") -> float | None:
    """A ``key: N kB`` field of ``path`` (``/proc/meminfo``, ``/proc/self/status``) in MiB, or None."""
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return None


def reset_peak_rss() -> float:
    """Reset this process's RSS high-water mark (``VmHWM``) to its current RSS; return that RSS in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return current_rss_bytes() / MIB


def peak_rss_mib() -> float:
    """This process's RSS high-water mark since the last :func:`reset_peak_rss`, MiB (the kernel's: no sampling)."""
    return proc_mib("VmHWM", "/proc/self/status") or 0.0


def release_free_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc ``malloc_trim``) before a baseline."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class Timing:
    """One phase's calls: times (s), the peak RSS above ``baseline_rss_mib`` over the first call and over all."""

    times_s: list[float]
    baseline_rss_mib: float
    first_extra_mib: float
    peak_extra_mib: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def measure(fn: Callable[[], object], *, calls: int, setup: Callable[[], object] | None = None) -> Timing:
    """Time ``calls`` calls of ``fn()`` (``setup()`` untimed before each) and the peak RSS they add."""
    release_free_memory()
    base, times, first = reset_peak_rss(), [], 0.0
    for i in range(calls):
        (setup or (lambda: None))()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        first = peak_rss_mib() - base if i == 0 else first
    return Timing(times, base, first, peak_rss_mib() - base)


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (``/proc/stat``)."""
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
    """Short SHA-256 over ds_ring's ``*.py`` files (paths and contents): the library code measured."""
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


def rel(path: str | Path) -> str:
    """``path`` relative to the repository root, as the JSON records it (never an absolute machine path)."""
    return os.path.relpath(Path(path).resolve(), ROOT)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically; the repository's and interpreter's directories as relative / $PREFIX."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, text = path.with_name(path.name + ".tmp"), json.dumps(data, indent=1, default=str)
    for prefix, short in ((f"{ROOT}/", ""), (sys.prefix, "$PREFIX"), (sys.base_prefix, "$BASE_PREFIX")):
        text = text.replace(prefix, short)
    tmp.write_text(text + "\n")
    tmp.replace(path)


def fmt_seq(n: int) -> str:
    """Sequence length for display: 8192 -> '8K', 1536 -> '1536'."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


@dataclass
class Series:
    label: str
    x: list[float] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    style: str = "-o"
    kwargs: dict[str, Any] = field(default_factory=dict)


def plot_panels(
    path: Path, panels: Sequence[tuple[str, Sequence[Series]]], *, xlabel: str, ylabel: str | Sequence[str],
    title: str, xticks: Sequence[int], logy: bool = True,
) -> None:  # fmt: skip
    """Side-by-side panels (title, series), x on a log2 axis; ``ylabel`` shared, or one per panel (own y axes)."""
    from matplotlib.ticker import NullLocator

    shared = isinstance(ylabel, str)
    ylabels = [ylabel] + [""] * (len(panels) - 1) if shared else ylabel
    legend: list[str] = []
    with figure(path, 5.5 * len(panels), 4.2, len(panels), sharey=shared) as axes:
        for ax, (panel_title, series), axis_label in zip(axes, panels, ylabels, strict=True):
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
        axes[0].figure.suptitle(title)


@contextlib.contextmanager
def figure(path: Path, width: float, height: float, panels: int = 1, dpi: int = 120, **kwargs: Any) -> Any:
    """Matplotlib (Agg) axes of a ``width`` × ``height`` inch figure of ``panels`` side by side, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(width, height), squeeze=False, **kwargs)
    try:
        yield axes[0]
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
