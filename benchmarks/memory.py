"""Activation memory per rank of one fwd+bwd: slope (q-shards) and fixed MiB (SUITE.md); DIR/memory.json, .png.

python -m benchmarks.memory --ranks 1 2 4 --calls dense_ring dilated_ring --label before"""

import contextlib
import itertools
import json
import os
import resource
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import ds_ring
from benchmarks import common
from benchmarks.common import MIB, Series, peak_rss_mib, plot_panels, release_free_memory, reset_peak_rss, write_json
from ds_ring.cpu_heap import ENV, configure_cpu_heap, heap_setting

HEADS, HEAD_DIM, HEAP_KEYS = 8, 64, ("wall_s", "user_s", "system_s")


@dataclass(frozen=True)
class Call:
    """One attention call; ``segments``: fractions of S, ``tokens_per_rank``: the slope's two local lengths."""

    strategy: str
    communication: str | None = None
    layout: str = "contiguous"
    segments: tuple[float, ...] | None = None
    rates: tuple[int, ...] | None = None
    tokens_per_rank: tuple[int, int] = (4096, 8192)
    mmap_threshold: int | None = None
    heads: int = HEADS
    kv_heads: int | None = None


_LONGNET = {"segments": (1 / 32, 1 / 4, 1), "rates": (1, 4, 16), "tokens_per_rank": (16384, 32768)}
CALLS = {
    "dense_ring": Call("ring"), "dense_ring_zigzag": Call("ring", layout="zigzag"),
    "dense_allgather": Call("allgather", communication="allgather"), "dense_ulysses": Call("ulysses"),
    "dense_hybrid": Call("hybrid"),
    "dilated_local": Call("ring", segments=(1 / 16, 1 / 8, 1 / 4), rates=(1, 2, 4), tokens_per_rank=(16384, 32768)),
    "dilated_ring": Call("ring", **_LONGNET), "dilated_allgather": Call("allgather", "allgather", **_LONGNET),
}  # fmt: skip


def _peak_allocated_mib(prof) -> float:
    """Peak MiB of live tensors in a finished ``profile(profile_memory=True)``: allocations and frees by address (an
    upper bound: a tensor freed on a thread it does not record stays counted)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    live, total, peak = {}, 0, 0
    # In recording order ("Ev Idx"): timestamps of two threads' events can put a free before its allocation.
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["args"]["Ev Idx"]):
        size, address = event["args"]["Bytes"], event["args"]["Addr"]
        total -= live.pop(address, 0)  # a free, or an allocation where one was freed unseen
        if size > 0:
            live[address] = size
            total += size
        peak = max(peak, total)
    return peak / MIB


def _measure(rank: int, world: int, call: Call, local_len: int, device: str, live: bool = False) -> dict:
    """One rank: extra MiB and seconds of a fwd+bwd of ``call`` on ``local_len`` rows (``live``: live tensors too)."""
    if call.mmap_threshold is not None:
        configure_cpu_heap(call.mmap_threshold)  # kept by ds_ring's own setting on the first call
    seq, cuda = local_len * world, device == "cuda"
    segments = None if call.segments is None else [max(1, int(seq * f)) for f in call.segments]
    ulysses = common.ulysses_degree(call.strategy, world)
    topology = ds_ring.Topology(ulysses=ulysses, ring=world // ulysses)
    q, k, v, dout = common.qkv_dout(torch.Generator().manual_seed(rank), 1, local_len, call.heads, call.kv_heads,
                                    HEAD_DIM, device)  # fmt: skip
    release_free_memory()  # gc, and (CPU) freed heap back to the OS before the baseline
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() / MIB if cuda else reset_peak_rss()
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if live else contextlib.nullcontext()
    start = time.perf_counter()
    with profiler:
        out = ds_ring.sequence_parallel_attention(q, k, v, segments, call.rates and list(call.rates), causal=True,
                                                  topology=topology, strategy=call.strategy,
                                                  communication=call.communication, layout=call.layout)  # fmt: skip
        out.backward(dout)
    seconds = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / MIB if cuda else peak_rss_mib()
    result = {"extra_mib": peak - base, "seconds": seconds, "q_shard_mib": q.numel() * q.element_size() / MIB}
    return {**result, "live_mib": _peak_allocated_mib(profiler)} if live else result


def measure(call: Call, world: int, device: str, timeout_s: float, live: bool = False) -> dict[str, Any]:
    """Both lengths of ``call`` on ``world`` fresh ranks: MiB and seconds (max over ranks), slope and fixed MiB."""
    values = [common.rank_values(_measure, world, timeout_s, call, n, device, live) for n in call.tokens_per_rank]
    both = lambda key: [max(rank[key] for rank in ranks) for ranks in values]  # at each length, max over ranks
    slope, fixed = statistics.linear_regression(both("q_shard_mib"), both("extra_mib"))
    result = {"ranks": world, "tokens_per_rank": call.tokens_per_rank, "extra_mib": both("extra_mib"),
              "seconds": both("seconds"), "slope_q_shards": slope, "fixed_mib": fixed}  # fmt: skip
    if live:
        result["live_mib"] = both("live_mib")
        result["live_slope_q_shards"] = statistics.linear_regression(both("q_shard_mib"), both("live_mib")).slope
    return result


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Slope and fixed cost against the rank count: a line per (call, label in the JSON), dashed for ``before``."""
    panels = {"slope_q_shards": [], "fixed_mib": []}
    for label, name in sorted({(label, r["call"]) for label, rows in results.items() for r in rows}):
        mine = [r for r in results[label] if r["call"] == name]
        for key, series in panels.items():
            xy = [r["ranks"] for r in mine], [r[key] for r in mine]
            series.append(Series(f"{name} ({label})", *xy, "--o" if label == "before" else "-o"))
    plot_panels(path, [("activation memory slope", panels["slope_q_shards"]), ("fixed cost", panels["fixed_mib"])],
                xlabel="ranks", ylabel=["slope (q-shards per rank)", "fixed MiB per rank"], xticks=[1, 2, 4, 8],
                logy=False, title="activation memory per rank of one fwd+bwd, fp32, 8 heads × 64, causal")  # fmt: skip


def main() -> None:
    args = common.script_args(__doc__, ("--calls", {"nargs": "+", "choices": sorted(CALLS), "default": list(CALLS)}),
                       ("--ranks", {"nargs": "+", "type": int, "default": [1, 2, 4, 8]}),
                       ("--label", {"default": "after", "help": "key of this run in the JSON (before / after)"}),
                       ("--device", {"choices": ["cpu", "cuda"], "default": "cpu", "help": "cuda: p = 1 (gloo)"}),
                       ("--live", {"action": "store_true", "help": "also the peak of live tensors (torch.profiler)"}),
                       ("--tokens-per-rank", {"nargs": 2, "type": int, "help": "the two local lengths"}))  # fmt: skip
    path = args.out / "memory.json"  # write_json makes its folder
    results = common.read_json(path)
    rows = [r for r in results.get(args.label, []) if not (r["call"] in args.calls and r["ranks"] in args.ranks)]
    for world, name in itertools.product(args.ranks, args.calls):
        if CALLS[name].strategy == "hybrid" and world % 2:
            continue  # hybrid needs a ulysses degree of 2 here
        call = replace(CALLS[name], tokens_per_rank=tuple(args.tokens_per_rank or CALLS[name].tokens_per_rank))
        r = {"call": name, **measure(call, world, args.device, args.timeout_s, args.live)}
        live = f" (live tensors {r['live_slope_q_shards']:.2f})" if args.live else ""
        print(f"{name:18s} p={world}: {r['slope_q_shards']:.2f}{live} q-shards + {r['fixed_mib']:.1f} MiB", flush=True)
        results[args.label] = rows = [*rows, r]
        write_json(path, results)
    plot(results, args.out / "memory.png")


def _heap_rank(rank: int, world: int, strategy: str, local_len: int, calls: int, heap: str) -> dict[str, Any]:
    """One rank's times: ``calls`` fwd+bwd after a warm-up, each started together (a barrier)."""
    if heap == "off":
        os.environ[ENV] = "off"
    ulysses = common.ulysses_degree(strategy, world)
    topology = ds_ring.Topology(ulysses=ulysses, ring=world // ulysses)
    q, k, v, dout = common.qkv_dout(torch.Generator().manual_seed(rank), 1, local_len, HEADS, None, HEAD_DIM)

    def call() -> None:
        ds_ring.sequence_parallel_attention(q, k, v, causal=True, topology=topology, strategy=strategy).backward(dout)
        q.grad = k.grad = v.grad = None

    clock = lambda: (time.perf_counter(), *resource.getrusage(resource.RUSAGE_SELF)[:2])  # the seconds of HEAP_KEYS
    call()
    times = []
    for _ in range(calls):
        dist.barrier()
        before = clock()
        call()
        times.append({key: t - t0 for key, t, t0 in zip(HEAP_KEYS, clock(), before, strict=True)})
    return {"calls": times, "threshold": heap_setting().threshold}


def heap_launch(world: int, strategy: str, local_len: int, calls: int, heap: str, timeout_s: float) -> dict[str, Any]:
    """One fresh launch; per call: the slowest rank's wall, the ranks' summed user and system seconds."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    ranks = common.rank_values(_heap_rank, world, timeout_s, strategy, local_len, calls, heap)
    per_call = [{key: (max if key == "wall_s" else sum)(r[key] for r in call) for key in HEAP_KEYS}
                for call in zip(*(r["calls"] for r in ranks), strict=True)]  # fmt: skip
    return {"heap": heap, "threshold": ranks[0]["threshold"], "loadavg": load, "calls": per_call}


def heap_main(doc: str) -> None:
    args = common.script_args(doc, ("--ranks", {"type": int, "default": 4}),
                       ("--strategies", {"nargs": "+", "default": ["ulysses", "ring"]}),
                       ("--tokens-per-rank", {"nargs": "+", "type": int, "default": [1024, 4096]}),
                       ("--calls", {"type": int, "default": 5}), ("--rounds", {"type": int, "default": 3}))  # fmt: skip
    rows, orders = [], [("ds_ring", "off"), ("off", "ds_ring")]  # alternated round by round
    for strategy, local_len in itertools.product(args.strategies, args.tokens_per_rank):
        launches = [heap_launch(args.ranks, strategy, local_len, args.calls, heap, args.timeout_s)
                    for r in range(args.rounds) for heap in orders[r % 2]]  # fmt: skip
        calls = {heap: [c for x in launches if x["heap"] == heap for c in x["calls"]] for heap in ("ds_ring", "off")}
        median = {heap: {key: statistics.median(c[key] for c in cs) for key in HEAP_KEYS} for heap, cs in calls.items()}
        ratio = {key: median["ds_ring"][key] / median["off"][key] for key in HEAP_KEYS}
        rows.append({"strategy": strategy, "ranks": args.ranks, "tokens_per_rank": local_len, "median": median,
                     "ds_ring_over_off": ratio, "launches": launches})  # fmt: skip
        ratios = "  ".join(f"{key} {value:.3f}" for key, value in ratio.items())
        print(f"{strategy:8s} p={args.ranks} {local_len:6d} rows/rank  ds_ring ÷ glibc default: {ratios}", flush=True)
        write_json(args.out / "heap.json", {"rows": rows})


if __name__ == "__main__":
    main()
