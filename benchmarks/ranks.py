"""Multi-rank benchmark launcher: p ranks as fresh processes, a fixed number of calls, results gathered.

:mod:`benchmarks.harness` runs one configuration in one fresh process. This module runs one
configuration on ``p`` ranks:

- **Processes.** :func:`launch` starts ``p`` processes from a *fork server* that has imported torch
  and ds_ring once (``multiprocessing`` ``forkserver`` with a preload). Every rank is a fresh
  process (its own address space, allocator, thread pools and RSS high-water mark), forked from a
  clean single-threaded server, never from the driver: starting 4 ranks costs ~0.1 s instead of
  ~4 × 3 s of ``import torch`` on 2 busy cores. Each rank pins its torch intra-op threads
  (``threads``, default 1).
- **Rendezvous.** gloo over loopback (``GLOO_SOCKET_IFNAME=lo``), ``init_method="file://..."`` in a
  fresh temporary directory: no ports to clash. ``distributed=False`` runs a single process with no
  process group (single-process baselines).
- **Fixed call count.** :func:`measure_fixed` makes exactly ``calls`` timed calls (no time budget
  deciding per rank), so every rank meets its peers in the same collectives.
- **Memory per rank** is measured in each rank's own process: RSS sampled every 5 ms plus the
  ``ru_maxrss`` high-water mark (:class:`benchmarks.harness.RssSampler`). :func:`attention_rank`
  reports *working memory*: the peak RSS above the RSS taken right before the rank's input shards
  are allocated (after imports, process-group set-up and a small warm-up call), i.e. inputs +
  activations + gradients + communication buffers + kernel workspace, in MiB (2**20 bytes).
- **Disturbance.** Each rank reports the CPU seconds its process used; :func:`launch` subtracts
  them (and the driver's own) from the machine's busy time over the launch (``/proc/stat``):
  ``other_cpu_share`` is the share (0..1) of all CPUs that *other* processes used meanwhile.
- **Deadline.** A launch that does not finish within ``timeout_s`` seconds has its ranks killed and
  is reported as an error naming the ranks still running; once one rank fails, the others get
  :data:`GRACE_AFTER_FAILURE_S` to finish before they are killed.

A rank function is named ``"module:function"`` and called as ``fn(cfg, rank, world) -> dict``;
its dict must be picklable. :class:`benchmarks.harness.Skip` becomes ``{"skipped": reason}``,
any other exception ``{"error": ..., "traceback": ...}``.

:func:`attention_rank` is the rank function shared by ``ring``, ``ring_dilated``, ``strategies``
and the suite: it builds an attention implementation with a *factory* named in the config
(``"module:function"``, called once per process as ``factory(cfg, rank, world)`` and returning
``attn(q, k, v, segment_lengths, dilation_rates) -> out`` on local shards ``[B, S/p, H, D]``),
runs one small warm-up call (dense, checked against ``ds_ring.ring_dilated_attention`` on the
same shards), then times ``calls`` forward+backward calls at the configured size.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from multiprocessing.process import BaseProcess
from typing import Any

from benchmarks.harness import (
    REPO_ROOT,
    RssSampler,
    Skip,
    current_rss_bytes,
    matmul_gflops,
    max_rss_bytes,
    release_free_memory,
    set_threads,
)

__all__ = [
    "ATTENTION_RANK",
    "AttentionFn",
    "GRACE_AFTER_FAILURE_S",
    "MATMUL_N",
    "OTHER_CPU_WARN",
    "Launch",
    "Throughput",
    "attention_rank",
    "base_report",
    "finish_report",
    "format_header",
    "format_targets",
    "launch",
    "matmul_ceiling",
    "matmul_rank",
    "measure_fixed",
    "mem_available_mib",
    "summarize",
]

MIB = float(2**20)
PRELOAD = ["torch", "torch.distributed", "ds_ring", "benchmarks.harness", "benchmarks.ranks"]
"""Modules the fork server imports once; ranks import anything else they need themselves."""
AttentionFn = Callable[..., Any]
"""What a factory returns: ``attn(q, k, v, segment_lengths, dilation_rates) -> out``, all tensors local
shards ``[batch, seq/p, heads, head_dim]``; the branches may be None (dense)."""
ATTENTION_RANK = "benchmarks.ranks:attention_rank"
"""Target of :func:`launch` for :func:`attention_rank`."""
GRACE_AFTER_FAILURE_S = 10.0
"""Once a rank has failed, the others get this many seconds to finish before they are killed."""
EXIT_S = 5.0
"""Seconds a rank that has sent its result may take to exit before it is killed."""
OTHER_CPU_WARN = 0.10
"""Above this share of all CPUs used by other processes during a launch, its timings are flagged."""
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------------------
# Launching ranks
# --------------------------------------------------------------------------------------


@dataclass
class Launch:
    """What one launch of ``world`` ranks gave back.

    ranks: one dict per rank, in rank order (a rank that sent nothing gets ``{"error": ...}``).
    wall_s: seconds from the first fork to the last result (imports are already done by the server).
    other_cpu_share: share (0..1) of all CPUs used by other processes during the launch, or None.
    world, threads: ranks launched and torch threads per rank.
    """

    ranks: list[dict[str, Any]]
    wall_s: float
    other_cpu_share: float | None
    world: int
    threads: int


def _context() -> multiprocessing.context.BaseContext:
    """The fork-server context, preloading torch and ds_ring (set once, before the server starts)."""
    ctx = multiprocessing.get_context("forkserver")
    if str(REPO_ROOT) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")  # ranks set their own count with torch.set_num_threads
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (first line of ``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    total = sum(fields[:8])
    return total - idle, total


def _own_cpu_s() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def launch(
    target: str,
    cfg: dict[str, Any],
    *,
    world: int,
    threads: int = 1,
    timeout_s: float = 600.0,
    distributed: bool = True,
) -> Launch:
    """Run ``target(cfg, rank, world)`` on ``world`` fresh rank processes; gather their dicts.

    ``target`` is ``"module:function"``. With ``distributed`` every rank joins a gloo process group
    of ``world`` ranks (file rendezvous, group timeout ``timeout_s``) before the call. Each rank's
    dict gets ``cpu_s`` (CPU seconds of its process), ``process_peak_rss_mib`` (its ``ru_maxrss``)
    and ``loadavg_end``. Never raises for a failing or hanging rank: its dict carries ``error``.
    """
    ctx = _context()
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    outcomes: dict[int, dict[str, Any]] = {}
    busy0, total0 = _cpu_jiffies()
    own0 = _own_cpu_s()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ds_ring_bench_", ignore_cleanup_errors=True) as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous") if distributed else ""
        try:
            for rank in range(world):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(target, cfg, rank, world, threads, init_method, timeout_s, writer),
                    name=f"bench-rank{rank}",
                    daemon=True,
                )
                proc.start()
                writer.close()
                procs.append(proc)
                readers.append(reader)
            _collect(procs, readers, time.monotonic() + timeout_s, outcomes)
        finally:
            _stop(procs, finished=set(outcomes))
            for reader in readers:
                reader.close()
    wall = time.perf_counter() - t0
    busy1, total1 = _cpu_jiffies()
    ranks = [
        outcomes.get(r) or {"error": f"rank {r}: no result within the {timeout_s:.0f} s deadline"} for r in range(world)
    ]
    ours = sum(r.get("cpu_s", 0.0) for r in ranks) + (_own_cpu_s() - own0)
    capacity = (total1 - total0) / _CLK_TCK
    other = max(0.0, (busy1 - busy0) / _CLK_TCK - ours) / capacity if capacity > 0 else None
    return Launch(ranks=ranks, wall_s=wall, other_cpu_share=other, world=world, threads=threads)


def _rank_main(
    target: str,
    cfg: dict[str, Any],
    rank: int,
    world: int,
    threads: int,
    init_method: str,
    timeout_s: float,
    writer: Connection,
) -> None:
    """Child entry point: set threads, join the group, run the target, send its dict."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        set_threads(threads)
        if init_method:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
            )
        try:
            module, name = target.split(":")
            result = getattr(importlib.import_module(module), name)(cfg, rank, world)
        finally:
            if init_method:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
    except Skip as exc:
        result = {"skipped": str(exc)}
    except BaseException as exc:  # everything goes back to the driver as text
        result = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    result["rank"] = rank
    result["cpu_s"] = _own_cpu_s()
    result["process_peak_rss_mib"] = max_rss_bytes() / MIB
    result["loadavg_end"] = os.getloadavg()[0]
    writer.send(result)
    writer.close()


def _collect(
    procs: list[BaseProcess], readers: list[Connection], deadline: float, outcomes: dict[int, dict[str, Any]]
) -> None:
    """Fill ``outcomes`` until every rank reported, the deadline passed, or the post-failure grace ran out."""
    limit = deadline
    while len(outcomes) < len(procs):
        now = time.monotonic()
        if now >= limit:
            return
        waiting = {reader: rank for rank, reader in enumerate(readers) if rank not in outcomes}
        exits = {procs[rank].sentinel: rank for rank in waiting.values()}
        for ready in wait_ready([*waiting, *exits], timeout=limit - now):
            rank = waiting[ready] if ready in waiting else exits[ready]
            if rank in outcomes:
                continue
            outcomes[rank] = _read_outcome(procs[rank], readers[rank])
            if "error" in outcomes[rank]:
                limit = min(limit, time.monotonic() + GRACE_AFTER_FAILURE_S)


def _read_outcome(proc: BaseProcess, reader: Connection) -> dict[str, Any]:
    """The rank's dict, or an error when it exited without one (crash, killed for memory)."""
    if reader.poll():
        try:
            return reader.recv()
        except EOFError:
            pass
    proc.join(EXIT_S)
    return {"error": f"process exited with code {proc.exitcode} before sending a result"}


def _stop(procs: list[BaseProcess], finished: set[int]) -> None:
    """SIGKILL ranks without a result, give the others a moment to exit, reap them all."""
    for rank, proc in enumerate(procs):
        if rank not in finished and proc.is_alive():
            proc.kill()
    exit_by = time.monotonic() + EXIT_S
    for proc in procs:
        proc.join(max(0.0, exit_by - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


# --------------------------------------------------------------------------------------
# Rank-side measurement
# --------------------------------------------------------------------------------------


def measure_fixed(fn: Callable[[], object], *, calls: int, setup: Callable[[], object] | None = None) -> dict[str, Any]:
    """Time exactly ``calls`` calls of ``fn()`` and measure the peak RSS they add.

    ``setup()`` runs untimed before each call. No warm-up here (the caller decides), no time
    budget: every rank of a launch makes the same calls. The baseline is the RSS right before
    the first call, after :func:`benchmarks.harness.release_free_memory`.

    Returns ``times_s`` (s), ``median_s``, ``best_s``, ``baseline_rss_mib``, ``peak_extra_mib``
    (peak RSS above the baseline, MiB), ``peak_rss_mib`` (baseline + peak extra), ``rss_samples``.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    release_free_memory()
    times: list[float] = []
    with RssSampler() as sampler:
        for _ in range(calls):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {
        "times_s": times,
        "median_s": statistics.median(times),
        "best_s": min(times),
        "baseline_rss_mib": sampler.baseline_bytes / MIB,
        "peak_extra_mib": sampler.extra_bytes / MIB,
        "peak_rss_mib": (sampler.baseline_bytes + sampler.extra_bytes) / MIB,
        "rss_samples": sampler.samples,
    }


def matmul_rank(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Rank function: fp32 ``n×n`` matmul GFLOP/s with this rank's threads (``cfg["n"]``, default :data:`MATMUL_N`)."""
    import torch

    result = matmul_gflops(n=cfg.get("n", MATMUL_N), threads=torch.get_num_threads())
    result.pop("times_s", None)
    return result


class _BlockedTime:
    """Hook on ds_ring's ``ring_step`` end events: seconds this rank spent blocked in ring waits."""

    def __init__(self) -> None:
        self.blocked_s = 0.0
        self.in_flight_s = 0.0
        self.steps = 0
        self.bytes_sent = 0

    def __call__(self, event: Any) -> None:
        if event.kind == "ring_step":
            self.blocked_s += float(event.extra.get("wait_s", 0.0))
            self.in_flight_s += event.seconds
            self.steps += 1
            self.bytes_sent += event.nbytes


def _factory(cfg: dict[str, Any]) -> Callable[..., AttentionFn]:
    """The factory named ``cfg["factory"]`` (``"module:function"``), imported in this rank."""
    module, name = cfg["factory"].split(":")
    return getattr(importlib.import_module(module), name)


def attention_rank(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Rank function: forward+backward of one attention implementation on this rank's shards.

    ``cfg`` keys: ``factory`` (``"module:function"``, see the module docstring), ``seq`` (total
    tokens), ``batch``, ``heads``, ``head_dim``, ``causal``, ``segment_lengths`` /
    ``dilation_rates`` (None: dense), ``calls`` (timed calls), ``fwd`` (first also time ``calls``
    forward calls under ``no_grad``), ``warmup`` (None, or a dict with its own ``seq`` /
    ``segment_lengths`` / ``dilation_rates``: one untimed forward+backward before anything is
    measured), ``check_layout`` (the shards' layout, for checking a dense warm-up against
    ``ds_ring.ring_dilated_attention`` on the same shards; None: no check), ``overlap`` (register a
    hook summing the time blocked in ring waits), ``comm_timeout_s``, plus what the factory reads.

    Returns ``fwdbwd`` (and with ``fwd``, ``fwd``): :func:`measure_fixed` dicts; ``inputs_mib`` (RSS
    the shards q, k, v, grad_out added); ``working_peak_mib`` (peak RSS of the forward+backward
    calls above the RSS before the shards existed, MiB); ``local_seq``; ``warmup_s``;
    ``warmup_max_abs_err``; with ``overlap``, ``blocked_s`` / ``in_flight_s`` (s) / ``ring_steps`` /
    ``ring_bytes_sent`` summed over the timed calls.
    """
    import torch

    seq = cfg["seq"]
    if seq % world:
        raise Skip(f"seq {seq} is not divisible by {world} ranks")
    attn = _factory(cfg)(cfg, rank, world)
    gen = torch.Generator().manual_seed(1000 + rank)

    def shards(total: int) -> list[torch.Tensor]:
        """This rank's q, k, v, grad_out for ``total`` tokens in all: ``[batch, total/p, heads, head_dim]``."""
        shape = (cfg["batch"], total // world, cfg["heads"], cfg["head_dim"])
        return [torch.randn(shape, generator=gen) for _ in range(4)]

    result: dict[str, Any] = {"local_seq": seq // world}
    if cfg.get("warmup"):
        result.update(_warmup(attn, shards(cfg["warmup"]["seq"]), cfg))
    release_free_memory()
    rss0 = current_rss_bytes()
    q, k, v, grad_out = shards(seq)
    for t in (q, k, v):
        t.requires_grad_(True)
    result["inputs_mib"] = (current_rss_bytes() - rss0) / MIB

    def clear_grads() -> None:
        for t in (q, k, v):
            t.grad = None

    segs, rates = cfg.get("segment_lengths"), cfg.get("dilation_rates")
    if cfg.get("fwd"):
        with torch.no_grad():
            result["fwd"] = measure_fixed(lambda: attn(q, k, v, segs, rates), calls=cfg["calls"])
        result["fwd"]["working_peak_mib"] = result["fwd"]["peak_rss_mib"] - rss0 / MIB
    blocked = _BlockedTime()
    handle = None
    if cfg.get("overlap"):
        from ds_ring.hooks import register_hook

        handle = register_hook(blocked)
    try:
        m = measure_fixed(lambda: attn(q, k, v, segs, rates).backward(grad_out), calls=cfg["calls"], setup=clear_grads)
    finally:
        if handle is not None:
            handle.remove()
    result["fwdbwd"] = m
    result["working_peak_mib"] = m["peak_rss_mib"] - rss0 / MIB
    if handle is not None:
        result.update(
            blocked_s=blocked.blocked_s,
            in_flight_s=blocked.in_flight_s,
            ring_steps=blocked.steps,
            ring_bytes_sent=blocked.bytes_sent,
        )
    result["threads"] = torch.get_num_threads()
    return result


def _warmup(attn: Callable[..., Any], tensors: list[Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """One untimed forward+backward with ``cfg["warmup"]``'s branches on ``tensors`` (q, k, v, grad_out).

    With ``check_layout`` and a dense warm-up: also the max abs difference of its output from
    ``ds_ring.ring_dilated_attention`` (ring, that layout) on the same shards.
    """
    import torch

    import ds_ring

    spec = cfg["warmup"]
    q, k, v, grad_out = tensors
    for t in (q, k, v):
        t.requires_grad_(True)
    t0 = time.perf_counter()
    out = attn(q, k, v, spec.get("segment_lengths"), spec.get("dilation_rates"))
    out.backward(grad_out)
    info: dict[str, Any] = {"warmup_s": time.perf_counter() - t0}
    layout = cfg.get("check_layout")
    if layout is not None and spec.get("segment_lengths") is None:
        with torch.no_grad():
            ref = ds_ring.ring_dilated_attention(
                q, k, v, causal=cfg["causal"], layout=layout, timeout_s=cfg.get("comm_timeout_s")
            )
        info["warmup_max_abs_err"] = float((out.detach() - ref).abs().max())
    return info


# --------------------------------------------------------------------------------------
# Driver side: one launch -> one table row
# --------------------------------------------------------------------------------------


def summarize(launch_result: Launch) -> dict[str, Any]:
    """Table fields of an :func:`attention_rank` launch.

    ``fwdbwd_s`` (``fwd_s``): the slowest rank's median forward+backward (forward) seconds: ranks
    wait for each other;
    ``peak_mib`` / ``peak_mib_per_rank``: working memory (:func:`attention_rank`), largest rank and
    every rank; ``peak_extra_mib``: largest peak above the post-input baseline; ``inputs_mib``;
    ``warmup_max_abs_err``: largest over ranks; ``overlap`` fields when measured
    (``blocked_s_per_rank``, ``compute_s_per_rank`` = timed wall − blocked, and ``overlap_ratio`` =
    slowest rank's wall ÷ largest compute); ``other_cpu_pct``; ``notes`` (errors, skips, disturbance).
    """
    ranks = launch_result.ranks
    row: dict[str, Any] = {"world": launch_result.world, "threads_per_rank": launch_result.threads}
    notes: list[str] = []
    errors = [f"rank {r.get('rank', i)}: {r['error']}" for i, r in enumerate(ranks) if "error" in r]
    if errors:
        # A failing rank usually makes its peers fail too (timeouts): the first error is the cause.
        notes.append("error: " + errors[0] + (f" (+{len(errors) - 1} more ranks)" if len(errors) > 1 else ""))
    notes += sorted({f"skipped: {r['skipped']}" for r in ranks if "skipped" in r})
    ok = [r for r in ranks if "fwdbwd" in r]
    if ok and len(ok) == len(ranks):
        walls = [sum(r["fwdbwd"]["times_s"]) for r in ok]
        row["fwdbwd_s"] = max(r["fwdbwd"]["median_s"] for r in ok)
        row["calls"] = len(ok[0]["fwdbwd"]["times_s"])
        row["peak_mib"] = max(r["working_peak_mib"] for r in ok)
        row["peak_mib_per_rank"] = [r["working_peak_mib"] for r in ok]
        row["peak_extra_mib"] = max(r["fwdbwd"]["peak_extra_mib"] for r in ok)
        row["inputs_mib"] = max(r["inputs_mib"] for r in ok)
        if all("fwd" in r for r in ok):
            row["fwd_s"] = max(r["fwd"]["median_s"] for r in ok)
            row["fwd_peak_mib"] = max(r["fwd"]["working_peak_mib"] for r in ok)
        errs = [r["warmup_max_abs_err"] for r in ok if "warmup_max_abs_err" in r]
        row["warmup_max_abs_err"] = max(errs) if errs else None
        if all("blocked_s" in r for r in ok):
            blocked = [r["blocked_s"] for r in ok]
            compute = [w - b for w, b in zip(walls, blocked, strict=True)]
            row["blocked_s_per_rank"] = blocked
            row["compute_s_per_rank"] = compute
            row["overlap_ratio"] = max(walls) / max(compute) if max(compute) > 0 else None
    share = launch_result.other_cpu_share
    row["other_cpu_pct"] = 100.0 * share if share is not None else None
    if share is not None and share > OTHER_CPU_WARN and "fwdbwd_s" in row:
        notes.append(f"other processes used {100 * share:.0f}% of the CPUs: timing disturbed")
    row["launch_wall_s"] = launch_result.wall_s
    row["notes"] = "; ".join(notes)
    row["raw"] = ranks
    return row


def mem_available_mib() -> float | None:
    """``MemAvailable`` of ``/proc/meminfo`` in MiB (memory a new process can use), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def matmul_ceiling(threads: int) -> dict[str, Any]:
    """fp32 :data:`MATMUL_N`² matmul GFLOP/s with ``threads`` threads, in a fresh process (:func:`matmul_rank`)."""
    got = launch("benchmarks.ranks:matmul_rank", {}, world=1, threads=threads, distributed=False, timeout_s=120)
    result = dict(got.ranks[0])
    result["other_cpu_share"] = got.other_cpu_share
    return result


@dataclass
class Throughput:
    """Useful attention GFLOP/s per busy core, measured per implementation: estimates rows not yet run.

    ``busy cores`` of a launch = min(ranks × threads, usable cores). A measurement disturbed by
    other processes using a share ``f`` of the CPUs is scaled by ``1 - f`` first. Before an
    implementation has been measured, ``efficiency × matmul_per_core`` GFLOP/s is assumed.
    """

    cores: int
    matmul_per_core: float
    measured: dict[Hashable, tuple[float, str]] = field(default_factory=dict)

    def busy_cores(self, world: int, threads: int) -> int:
        """Cores a launch of ``world`` ranks × ``threads`` threads can keep busy on this machine."""
        return max(1, min(world * threads, self.cores))

    def record(
        self, key: Hashable, useful_gflop: float, seconds: float, busy_cores: int, other: float | None, basis: str
    ) -> None:
        """Record one measured call under ``key``: ``useful_gflop`` (1e9 flop) in ``seconds`` on ``busy_cores``."""
        clean_s = seconds * (1.0 - min(other or 0.0, 0.9))
        self.measured[key] = (useful_gflop / clean_s / busy_cores, basis)

    def estimate_s(
        self, keys: list[Hashable], useful_gflop: float, busy_cores: int, efficiency: float
    ) -> tuple[float, str]:
        """(seconds, how) for one call of ``useful_gflop`` on ``busy_cores`` cores.

        Uses the first of ``keys`` measured so far, else ``efficiency`` × the matmul GFLOP/s per core.
        """
        known = [k for k in keys if k in self.measured]
        if known:
            rate, basis = self.measured[known[0]]
            how = f"measured {rate:.1f} GFLOP/s per core on {basis}"
        else:
            rate = efficiency * self.matmul_per_core
            how = f"assumed {rate:.1f} GFLOP/s per core ({efficiency:.0%} of matmul; not measured yet)"
        seconds = useful_gflop / (rate * busy_cores)
        return seconds, f"{useful_gflop / 1e3:.2f} TFLOP useful at {how} × {busy_cores} cores = {seconds:.0f} s"


# --------------------------------------------------------------------------------------
# Reports: one JSON per run, a markdown header and the targets
# --------------------------------------------------------------------------------------

MATMUL_N = 2048
"""Matmul size of the ceiling measurement (fp32 n×n @ n×n, 2·n³ flop)."""


def base_report(name: str, args: Any, config: dict[str, Any], extra_packages: list[str]) -> dict[str, Any]:
    """The report skeleton of a run: benchmark name, mode, command, config, every command-line option
    (``args``, an ``argparse.Namespace``), machine and software, the 1-thread matmul ceiling."""
    from benchmarks.harness import machine_info

    report: dict[str, Any] = {
        "benchmark": name,
        "mode": "quick" if args.quick else "full",
        "command": " ".join(["python", "-m", f"benchmarks.{name}" if name != "suite" else "benchmarks", *sys.argv[1:]]),
        "config": config,
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "machine": machine_info(extra_packages),
        "matmul": {"1_thread": matmul_ceiling(1)},
        "rows": [],
    }
    mm = report["matmul"]["1_thread"]
    print(f"{name}: fp32 matmul {MATMUL_N}², 1 thread: {mm.get('gflops_best', float('nan')):.1f} GFLOP/s", flush=True)
    return report


def finish_report(report: dict[str, Any], started: float) -> None:
    """Close a report: matmul ceiling at the end, worst disturbance, load average, wall time (in place)."""
    from benchmarks.harness import source_digest

    report["matmul"]["1_thread_end"] = matmul_ceiling(1)
    report["ds_ring_source_sha256_end"] = source_digest()
    rows = report["rows"]
    loads = [report["machine"]["loadavg_1m"]] + [
        r.get("loadavg_end") or 0.0 for row in rows for r in row.get("raw", []) if isinstance(r, dict)
    ]
    report["max_loadavg_1m"] = max(loads)
    report["max_other_cpu_pct"] = max((r.get("other_cpu_pct") or 0.0 for r in rows), default=0.0)
    report["wall_s"] = time.perf_counter() - started


def format_header(report: dict[str, Any], title: str) -> str:
    """One paragraph: what ran, where, the matmul ceiling, and how disturbed the machine was."""
    m, mm = report["machine"], report["matmul"]
    cores = m["usable_cpus"]
    start = mm["1_thread"].get("gflops_best", float("nan"))
    end = mm.get("1_thread_end", {}).get("gflops_best", float("nan"))
    return (
        f"**{title}** ({report['mode']}; `{report['command']}`): {m['cpu_model']}, {cores} usable CPUs, "
        f"{m['mem_total_gib']:.0f} GiB; torch {m['torch']}; {m['date_utc']}. "
        f"fp32 matmul {MATMUL_N}², 1 thread: {start:.1f} GFLOP/s at start, {end:.1f} at end. "
        f"Ranks are processes with 1 torch thread each unless stated: more ranks than {cores} cores "
        f"time-share the cores (their times include that; their memory does not). "
        f"Run took {report['wall_s']:.0f} s; other processes used at most {report['max_other_cpu_pct']:.0f}% "
        f"of the CPUs during a configuration ('other load %'); "
        f"highest 1-min load average {report['max_loadavg_1m']:.1f}."
    )


def format_targets(targets: list[dict[str, Any]]) -> str:
    """Markdown list of targets: met / not met / no target, value and detail."""
    if not targets:
        return "**Targets**: nothing measured to evaluate."
    lines = ["**Targets** (reported, not asserted):", ""]
    for t in targets:
        mark = {True: "met", False: "NOT met", None: "info"}[t["met"]]
        value = t["value"]
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"- [{mark}] {t['target']}: **{shown}** — {t['detail']}")
    return "\n".join(lines)
