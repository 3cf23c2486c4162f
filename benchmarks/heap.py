"""What ds_ring's CPU heap setting (``ds_ring/cpu_heap.py``) costs in time: one attention call, fwd+bwd, timed with
the setting (the default) and with ``DS_RING_MMAP_THRESHOLD=off`` (glibc's dynamic threshold), in fresh rank
processes, the two launches alternated round by round (A B, B A, ...), so a change of the machine's load hits both.

Per launch: one warm-up call, then ``--calls`` calls, each started by all ranks together; a call's wall time is the
slowest rank's, its CPU seconds (user, system) the sum over ranks (system time is where page faults of fresh
mappings show). The machine's load average is recorded beside every launch. Writes ``DIR/heap.json``.

    python -m benchmarks.heap --ranks 4 --strategies ulysses ring --tokens-per-rank 1024 4096 --rounds 3"""

import argparse
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_json
from ds_ring.cpu_heap import ENV
from ds_ring.testing import rank_results, spawn_ranks

HEADS, HEAD_DIM = 8, 64


def _rank(rank: int, world: int, strategy: str, local_len: int, calls: int, heap: str) -> dict[str, Any]:
    """One rank's times: ``calls`` fwd+bwd after a warm-up, each started together (a barrier)."""
    import torch
    import torch.distributed as dist

    import ds_ring
    from ds_ring.cpu_heap import heap_setting

    if heap == "off":
        os.environ[ENV] = "off"
    ulysses = 2 if strategy == "hybrid" else (world if strategy == "ulysses" else 1)
    topology = ds_ring.Topology(ulysses=ulysses, ring=world // ulysses)
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn((1, local_len, HEADS, HEAD_DIM), generator=g) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def call() -> None:
        out = ds_ring.sequence_parallel_attention(q, k, v, causal=True, topology=topology, strategy=strategy)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    call()
    walls, user, system = [], [], []
    for _ in range(calls):
        dist.barrier()
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        call()
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        user.append(after.ru_utime - before.ru_utime)
        system.append(after.ru_stime - before.ru_stime)
    return {"wall_s": walls, "user_s": user, "system_s": system, "threshold": heap_setting().threshold}


def launch(world: int, strategy: str, local_len: int, calls: int, heap: str, timeout_s: float) -> dict[str, Any]:
    """One fresh launch; per call: the slowest rank's wall, the ranks' summed user and system seconds."""
    load = Path("/proc/loadavg").read_text().split()[:3]
    args = (strategy, local_len, calls, heap)
    ranks = rank_results(spawn_ranks(_rank, world, timeout_s=timeout_s, args=args, preload=("torch",)))
    per_call = [
        {key: (max if key == "wall_s" else sum)(r[key][i] for r in ranks) for key in ("wall_s", "user_s", "system_s")}
        for i in range(calls)
    ]
    return {"heap": heap, "threshold": ranks[0]["threshold"], "loadavg": load, "calls": per_call}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--strategies", nargs="+", default=["ulysses", "ring"])
    parser.add_argument("--tokens-per-rank", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows = []
    for strategy in args.strategies:
        for local_len in args.tokens_per_rank:
            launches = []
            for round_ in range(args.rounds):
                for heap in ("ds_ring", "off") if round_ % 2 == 0 else ("off", "ds_ring"):
                    launches.append(launch(args.ranks, strategy, local_len, args.calls, heap, args.timeout_s))
            median = {
                heap: {
                    key: statistics.median(c[key] for x in launches if x["heap"] == heap for c in x["calls"])
                    for key in ("wall_s", "user_s", "system_s")
                }
                for heap in ("ds_ring", "off")
            }
            ratio = {key: median["ds_ring"][key] / median["off"][key] for key in ("wall_s", "user_s", "system_s")}
            rows.append({"strategy": strategy, "ranks": args.ranks, "tokens_per_rank": local_len, "median": median,
                         "ds_ring_over_off": ratio, "launches": launches})  # fmt: skip
            walls = f"{median['ds_ring']['wall_s']:.2f} / {median['off']['wall_s']:.2f} s"
            print(f"{strategy:8s} p={args.ranks} {local_len:6d} rows/rank  ds_ring ÷ glibc default: wall "
                  f"{ratio['wall_s']:.3f}  user {ratio['user_s']:.3f}  system {ratio['system_s']:.3f}  ({walls})",
                  flush=True)  # fmt: skip
            write_json(args.out / "heap.json", {"rows": rows})


if __name__ == "__main__":
    main()
