"""What ds_ring's CPU heap setting (``ds_ring/cpu_heap.py``) costs in time: ``benchmarks/SUITE.md``.

python -m benchmarks.heap --ranks 4 --strategies ulysses ring --tokens-per-rank 1024 4096 --rounds 3"""

import itertools
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ds_ring
from benchmarks.common import qkv_dout, script_args, ulysses_degree, write_json
from ds_ring.cpu_heap import ENV, heap_setting
from ds_ring.testing import rank_results, spawn_ranks

HEADS, HEAD_DIM, KEYS = 8, 64, ("wall_s", "user_s", "system_s")


def _rank(rank: int, world: int, strategy: str, local_len: int, calls: int, heap: str) -> dict[str, Any]:
    """One rank's times: ``calls`` fwd+bwd after a warm-up, each started together (a barrier)."""
    if heap == "off":
        os.environ[ENV] = "off"
    ulysses = ulysses_degree(strategy, world)
    topology = ds_ring.Topology(ulysses=ulysses, ring=world // ulysses)
    q, k, v, dout = qkv_dout(torch.Generator().manual_seed(rank), 1, local_len, HEADS, None, HEAD_DIM)

    def call() -> None:
        ds_ring.sequence_parallel_attention(q, k, v, causal=True, topology=topology, strategy=strategy).backward(dout)
        q.grad = k.grad = v.grad = None

    clock = lambda: (time.perf_counter(), *resource.getrusage(resource.RUSAGE_SELF)[:2])  # the seconds of KEYS
    call()
    times = []
    for _ in range(calls):
        dist.barrier()
        before = clock()
        call()
        times.append({key: t - t0 for key, t, t0 in zip(KEYS, clock(), before, strict=True)})
    return {"calls": times, "threshold": heap_setting().threshold}


def launch(world: int, strategy: str, local_len: int, calls: int, heap: str, timeout_s: float) -> dict[str, Any]:
    """One fresh launch; per call: the slowest rank's wall, the ranks' summed user and system seconds."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    args = (strategy, local_len, calls, heap)
    ranks = rank_results(spawn_ranks(_rank, world, timeout_s=timeout_s, args=args, preload=("torch",)))
    per_call = [{key: (max if key == "wall_s" else sum)(r[key] for r in call) for key in KEYS}
                for call in zip(*(r["calls"] for r in ranks), strict=True)]  # fmt: skip
    return {"heap": heap, "threshold": ranks[0]["threshold"], "loadavg": load, "calls": per_call}


def main() -> None:
    args = script_args(__doc__, ("--ranks", {"type": int, "default": 4}),
                       ("--strategies", {"nargs": "+", "default": ["ulysses", "ring"]}),
                       ("--tokens-per-rank", {"nargs": "+", "type": int, "default": [1024, 4096]}),
                       ("--calls", {"type": int, "default": 5}), ("--rounds", {"type": int, "default": 3}))  # fmt: skip
    rows, orders = [], [("ds_ring", "off"), ("off", "ds_ring")]  # alternated round by round
    for strategy, local_len in itertools.product(args.strategies, args.tokens_per_rank):
        launches = [launch(args.ranks, strategy, local_len, args.calls, heap, args.timeout_s)
                    for r in range(args.rounds) for heap in orders[r % 2]]  # fmt: skip
        calls = {heap: [c for x in launches if x["heap"] == heap for c in x["calls"]] for heap in ("ds_ring", "off")}
        median = {heap: {key: statistics.median(c[key] for c in cs) for key in KEYS} for heap, cs in calls.items()}
        ratio = {key: median["ds_ring"][key] / median["off"][key] for key in KEYS}
        rows.append({"strategy": strategy, "ranks": args.ranks, "tokens_per_rank": local_len, "median": median,
                     "ds_ring_over_off": ratio, "launches": launches})  # fmt: skip
        ratios = "  ".join(f"{key} {value:.3f}" for key, value in ratio.items())
        print(f"{strategy:8s} p={args.ranks} {local_len:6d} rows/rank  ds_ring ÷ glibc default: {ratios}", flush=True)
        write_json(args.out / "heap.json", {"rows": rows})


if __name__ == "__main__":
    main()
