"""What every benchmark shares (``benchmarks/README.md``, "Files"). MiB = 2**20 B, GFLOP = 1e9 flop."""

import argparse
import contextlib
import ctypes
import gc
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import torch

import ds_ring
from ds_ring.testing import rank_results, spawn_ranks

MIB = float(2**20)
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"  # where the JSON and PNGs go unless --out says otherwise


def rss_mib() -> float:
    """This process's resident set size now, MiB."""
    return psutil.Process().memory_info().rss / MIB


def reset_peak_rss() -> float:
    """Reset this process's RSS high-water mark (``VmHWM``) to its current RSS; return that RSS in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_mib()


def peak_rss_mib() -> float:
    """This process's RSS high-water mark since the last :func:`reset_peak_rss`, MiB (the kernel's: no sampling)."""
    return int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) / 1024


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


AttentionFn = Callable[..., Any]  # attn(q, k, v, segment_lengths, dilation_rates) -> this rank's output shard


class Skip(Exception):
    """Raised by a ``build`` when a case cannot run here (e.g. a peer not installed): recorded, not an error."""


@dataclass(frozen=True)
class Case:
    """One configuration: which attention, on what shapes, on how many rank processes (``benchmarks/README.md``)."""

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
    kv_heads: int | None = None
    data: int = 1  # data-parallel replicas, each its own sequence of ``seq`` tokens over world / data ranks


def causal_pairs(m: int, causal: bool) -> int:
    return m * (m + 1) // 2 if causal else m * m


def pairs_dilated(seq: int, heads: int, segs: Sequence[int], rates: Sequence[int], causal: bool,
                  split_heads: bool = False) -> int:  # fmt: skip
    """Computed (query, key) pairs of LongNet dilated attention: ds_ring's, dap's with ``split_heads`` (README.md)."""
    total = 0
    for i, (w, r) in enumerate(zip(segs, rates, strict=True)):
        lens = [w] * (seq // w) + ([seq % w] if seq % w else [])
        n = len(rates)
        offsets = [i % r] * (heads // n + (i < heads % n)) if split_heads else [h % r for h in range(heads)]
        total += sum(causal_pairs(len(range(o, m, r)), causal) for o in offsets for m in lens)  # kept rows
    return total


def case_pairs(case: Case, seq: int) -> int:
    if case.segment_lengths is None:
        return case.heads * causal_pairs(seq, case.causal)
    return pairs_dilated(seq, case.heads, case.segment_lengths, case.dilation_rates or (), case.causal)


def useful_gflop(case: Case, pairs: int | None = None) -> float:
    """Useful fwd+bwd GFLOP of one call: 4·head_dim·batch flop per unmasked (query, key) pair, × 3.5 (README.md)."""
    pairs = case_pairs(case, case.seq) if pairs is None else pairs
    return 3.5 * 4.0 * case.head_dim * case.batch * pairs / 1e9  # 3.5: the backward is 2.5 × the forward


@dataclass
class RankResult:
    """One rank's measurements (RSS in MiB before the shards existed, what they added; ds_ring's ring waits)."""

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
        """Peak RSS of a phase above the RSS before the shards existed (``benchmarks/SUITE.md``, working memory)."""
        return timing.baseline_rss_mib + timing.peak_extra_mib - self.rss_before_inputs_mib

    def __call__(self, event: Any) -> None:
        if event.kind == "ring_step":
            self.blocked_s += float(event.extra.get("wait_s", 0.0))
            self.in_flight_s += event.seconds
            self.ring_steps += 1
            self.ring_bytes_sent += event.nbytes


def attention_rank(rank: int, world: int, case: Case, build: Callable[[Case, int, float], AttentionFn], calls: int,
                   timeout_s: float) -> RankResult:  # fmt: skip
    """Rank function: build the attention, warm up, time ``calls`` fwd (if asked) and fwd+bwd calls on random shards."""
    result = RankResult(threads=torch.get_num_threads())
    try:
        attn = build(case, rank, timeout_s)
    except Skip as exc:
        result.skipped = str(exc)
        return result
    gen = torch.Generator().manual_seed(1000 + rank)
    shards = lambda total, grad=True: qkv_dout(gen, case.batch, total * case.data // world, case.heads, case.kv_heads,
                                               case.head_dim, grad=grad)  # fmt: skip
    segs, rates = case.segment_lengths, case.dilation_rates
    dense, warmup = case.warmup_seq is None, case.warmup_seq or max(1024, 256 * world)
    q, k, v, grad_out = shards(warmup)
    t0 = time.perf_counter()
    out = attn(q, k, v, None if dense else segs, None if dense else rates)
    out.backward(grad_out)
    result.warmup_s = time.perf_counter() - t0
    if dense and case.group and case.data == 1:  # the reference runs over the world: one sequence
        with torch.no_grad():
            ref = ds_ring.ring_dilated_attention(q, k, v, causal=case.causal, layout=case.layout,
                                                 timeout_s=timeout_s)  # fmt: skip
        result.warmup_max_abs_err = float((out.detach() - ref).abs().max())
    del q, k, v, grad_out, out
    release_free_memory()
    result.rss_before_inputs_mib = rss_mib()
    q, k, v, grad_out = shards(case.seq, grad=False)
    result.inputs_mib = rss_mib() - result.rss_before_inputs_mib
    if case.fwd:
        with torch.no_grad():
            result.fwd = measure(lambda: attn(q, k, v, segs, rates), calls=calls)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with ds_ring.register_hook(result):
        step = lambda: attn(q, k, v, segs, rates).backward(grad_out)
        clear_grads = lambda: [setattr(t, "grad", None) for t in (q, k, v)]  # untimed, before each call
        result.fwdbwd = measure(step, calls=calls, setup=clear_grads)
    return result


def qkv_dout(gen: torch.Generator | None, batch: int, rows: int, heads: int, kv_heads: int | None, head_dim: int,
             device: str = "cpu", grad: bool = True) -> list[torch.Tensor]:  # fmt: skip
    """Random q, k, v, dout ``[batch, rows, heads, head_dim]`` (K/V: ``kv_heads`` or ``heads``); q, k, v: ``grad``."""
    shapes = [(batch, rows, h, head_dim) for h in (heads, kv_heads or heads, kv_heads or heads, heads)]
    return [torch.randn(s, generator=gen).to(device).requires_grad_(grad and i < 3) for i, s in enumerate(shapes)]


def rank_values(fn: Callable[..., Any], world: int, timeout_s: float, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` of every rank in rank order, run on ``world`` fresh 1-thread rank processes."""
    return rank_results(spawn_ranks(fn, world, timeout_s=timeout_s, args=args))


def matmul_rank(rank: int, world: int, n: int) -> float:
    """Rank function: best fp32 ``n×n @ n×n`` GFLOP/s (2·n³ flop) of 5 timed calls after one warm-up."""
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    times = measure(lambda: torch.mm(a, b, out=c), calls=6).times_s
    return 2.0 * n**3 / min(times[1:]) / 1e9


def cpu_seconds() -> tuple[float, float]:
    """(busy, total) seconds of all CPUs since boot; busy: all but idle and iowait."""
    t = psutil.cpu_times()
    total = sum(t[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - t.idle - t.iowait, total


def machine_info(packages: Iterable[str]) -> dict[str, Any]:
    """Date, CPU, cores, memory, load, versions of torch and ``packages``, commit, a SHA-256 of ds_ring's ``*.py``."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "ds_ring").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    versions = {}
    for pkg in ("torch", *packages):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[pkg] = importlib.metadata.version(pkg)
    return {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"), "cpu_model": cpu or platform.processor(),
        "usable_cpus": len(os.sched_getaffinity(0)), "mem_total_gib": psutil.virtual_memory().total / 2**30,
        "loadavg_1m": os.getloadavg()[0], "python": platform.python_version(), "platform": platform.platform(),
        "versions": versions, "git_commit": commit.stdout.strip() or None, "ds_ring_source_sha256": h.hexdigest()[:16],
    }  # fmt: skip


def ulysses_degree(strategy: str, world: int) -> int:
    """The Ulysses degree the one-topology benchmarks give ``strategy`` on ``world`` ranks (hybrid: 2)."""
    return 2 if strategy == "hybrid" and world > 1 else (world if strategy == "ulysses" else 1)


def script_args(doc: str, *options: tuple[str, dict[str, Any]], argv: list[str] | None = None,
                timeout_s: float | None = 600) -> argparse.Namespace:  # fmt: skip
    """A benchmark's own command line: ``options`` (flag, keywords), ``--timeout-s`` (unless None) and ``--out``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    waits = [] if timeout_s is None else [("--timeout-s", {"type": float, "default": timeout_s})]
    for flag, kwargs in (*options, *waits, ("--out", {"type": Path})):
        p.add_argument(flag, **kwargs)
    args = p.parse_args(argv)
    args.out = args.out or RESULTS
    return args


def read_json(path: Path) -> dict[str, Any]:
    """``path``'s JSON, or ``{}`` where there is none yet (the label-keyed results of ``--label``)."""
    return json.loads(path.read_text()) if path.exists() else {}


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


def plot_panels(path: Path, panels: Sequence[tuple[str, Sequence[Series]]], *, xlabel: str, ylabel: str | Sequence[str],
                title: str, xticks: Sequence[int], logy: bool = True) -> None:  # fmt: skip
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
            ax.set_yscale("log" if logy else "linear")
            ax.set_xticks(list(xticks), [fmt_seq(int(t)) for t in xticks])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set(title=panel_title, xlabel=xlabel, ylabel=axis_label)
            ax.grid(True, which="both", alpha=0.3)
            if legend != (legend := [s.label for s in series]):
                ax.legend(fontsize=8 if len(legend) <= 8 else 6)
        axes[0].figure.suptitle(title)


@contextlib.contextmanager
def figure(path: Path, width: float, height: float, panels: int = 1, dpi: int = 120, **kwargs: Any) -> Any:
    """Axes of a ``width`` × ``height`` inch figure of ``panels`` side by side, saved to ``path`` (no pyplot)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    yield fig.subplots(1, panels, squeeze=False, **kwargs)[0]
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
