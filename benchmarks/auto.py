"""``strategy="auto"`` against every strategy timed by hand, and its memory model against measurement.

What it runs and how a pick is judged (within 1.10× of the best, never the worst; the memory model within 15 % of the
slope :func:`benchmarks.memory.measure` measures): ``docs/auto.md``, "Predicted vs measured". Writes ``DIR/auto.json``
and ``DIR/auto.png`` (measured step time per strategy, auto's pick circled).

    python -m benchmarks.auto --seqs 4096 --ranks 2 --no-memory
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import common, memory
from benchmarks.common import figure
from ds_ring.testing import rank_results, spawn_ranks

HEAD_DIM = 64
GRID_HEADS = ((8, 8), (8, 2))
STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")


def _step(q, k, v, dout, topology, name: str) -> float:
    """One fwd+bwd of ``name``: wall seconds of the slowest rank."""
    import torch
    import torch.distributed as dist

    import ds_ring

    dist.barrier()
    start = time.perf_counter()
    out = ds_ring.sequence_parallel_attention(q, k, v, causal=True, topology=topology, strategy=name)
    out.backward(dout)
    seconds = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    q.grad = k.grad = v.grad = None
    return float(seconds)


def _time_rank(rank: int, world: int, points: list[tuple[int, int, int]], repeats: int) -> list[dict[str, Any]]:
    """One rank: for every (seq, heads, kv_heads) time each admitted strategy and auto; seconds per call."""
    import torch

    import ds_ring
    from ds_ring.auto import strategy as auto

    ulysses = 2 if world == 4 else 1
    topology = ds_ring.Topology(ulysses=ulysses, ring=world // ulysses)
    rows = []
    for seq, heads, kv_heads in points:
        local = seq // world
        g = torch.Generator().manual_seed(rank)
        q = torch.randn((1, local, heads, HEAD_DIM), generator=g, requires_grad=True)
        k, v = (torch.randn((1, local, kv_heads, HEAD_DIM), generator=g, requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        names = [s for s in STRATEGIES if s != "hybrid" or ulysses > 1] + ["auto"]
        for name in names:
            if name == "ulysses" and heads % world:
                continue
            _step(q, k, v, dout, topology, name)  # warm-up: plans, and for auto the probe and the choice
            seconds = statistics.median(_step(q, k, v, dout, topology, name) for _ in range(repeats))
            row = {"seq": seq, "heads": heads, "kv_heads": kv_heads, "strategy": name, "seconds": seconds}
            if name == "auto":
                chosen = auto.decisions()[-1]
                row.update(pick=chosen.strategy, pick_label=chosen.label, predicted_s=chosen.time_s)
            rows.append(row)
    return rows


def timing(world: int, points: list[tuple[int, int, int]], repeats: int, timeout_s: float) -> list[dict[str, Any]]:
    """Every point's strategies on ``world`` ranks (one spawn), with auto's verdict per point."""
    rows = rank_results(spawn_ranks(_time_rank, world, timeout_s=timeout_s, args=(points, repeats)))[0]
    verdicts = []
    for seq, heads, kv_heads in points:
        mine = [r for r in rows if (r["seq"], r["heads"], r["kv_heads"]) == (seq, heads, kv_heads)]
        by_name = {r["strategy"]: r["seconds"] for r in mine if r["strategy"] != "auto"}
        auto = next(r for r in mine if r["strategy"] == "auto")
        best, worst = min(by_name.values()), max(by_name.values())
        picked = by_name[auto["pick"]]
        verdicts.append({
            "ranks": world, "seq": seq, "heads": heads, "kv_heads": kv_heads, "measured_s": by_name,
            "auto_s": auto["seconds"], "pick": auto["pick_label"], "pick_s": picked,
            "best": min(by_name, key=by_name.get),
            "ratio_to_best": picked / best, "within_1_10": picked <= 1.10 * best,
            "never_worst": len(by_name) == 1 or picked < worst, "predicted_pick_s": auto["predicted_s"],
        })  # fmt: skip
    return verdicts


def memory_check(world: int, lengths: tuple[int, int], timeout_s: float) -> list[dict[str, Any]]:
    """Measured slope (q-shards, :func:`benchmarks.memory.measure`) vs the model's, per strategy."""
    from ds_ring.auto.model import Option, Problem, memory_q_shards

    rows = []
    for name in STRATEGIES:
        comm = {"ring": "ring", "allgather": "allgather", "hybrid": "ring"}.get(name)
        measured = memory.measure(memory.Call(name, comm, tokens_per_rank=lengths), world, "cpu", timeout_s)
        measured = measured["slope_q_shards"]
        u = 2 if name == "hybrid" else (world if name == "ulysses" else 1)
        problem = Problem(seq=lengths[1] * world, heads=memory.HEADS, kv_heads=memory.HEADS, head_dim=memory.HEAD_DIM,
                          world=world, itemsize=4)  # fmt: skip
        option = Option(name, comm, "contiguous", u, world // u, lengths[1] * u)
        predicted = memory_q_shards(problem, option)
        rows.append({"strategy": name, "ranks": world, "tokens_per_rank": lengths, "measured_q_shards": measured,
                     "predicted_q_shards": predicted, "error": predicted / measured - 1 if measured else None,
                     "within_15pct": bool(measured) and abs(predicted / measured - 1) <= 0.15})  # fmt: skip
        print(f"memory {name:9s} p={world}: measured {measured:5.2f} q-shards, predicted {predicted:5.2f}", flush=True)
    return rows


def plot(verdicts: list[dict[str, Any]], path: Path) -> None:
    """Measured step time per strategy at each grid point, auto's pick circled."""
    with figure(path, max(6, len(verdicts) * 0.9), 4) as (ax,):
        labels = [f"p{v['ranks']} {v['seq'] // 1024}K\n{v['heads']}/{v['kv_heads']}h" for v in verdicts]
        for j, name in enumerate(STRATEGIES):
            xs = [i + (j - 1.5) * 0.18 for i, v in enumerate(verdicts) if name in v["measured_s"]]
            ax.bar(xs, [v["measured_s"][name] for v in verdicts if name in v["measured_s"]], width=0.18, label=name)
        for i, v in enumerate(verdicts):
            j = STRATEGIES.index(v["pick"].split()[0].split("/")[0])
            ax.plot(i + (j - 1.5) * 0.18, v["pick_s"], "ko", fillstyle="none", markersize=10)
        ax.set_xticks(range(len(verdicts)), labels, fontsize=7)
        ax.set(ylabel="fwd+bwd seconds (slowest rank)",
               title="strategy='auto' (circled) vs every strategy, fp32 causal, gloo CPU")  # fmt: skip
        ax.legend(fontsize=7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--seqs", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-ranks", type=int, default=4)
    parser.add_argument("--memory-lengths", nargs=2, type=int, default=[2048, 4096], help="rows per rank")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-timing", action="store_true", help="the memory check only")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=65536,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks: tensors over it are mmap'ed, so the RSS "
                        "follows live tensors at small sizes (0: leave glibc's default)")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.malloc_mmap_threshold:  # read by glibc when the fork server starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"load_average_start": os.getloadavg(), "timing": [], "memory": []}
    for world in [] if args.no_timing else args.ranks:
        points = [(seq, h, kv) for seq in args.seqs for h, kv in GRID_HEADS]
        for v in timing(world, points, args.repeats, args.timeout_s):
            result["timing"].append(v)
            times = "  ".join(f"{k} {s * 1e3:.0f}" for k, s in v["measured_s"].items())
            print(f"p={world} seq {v['seq']} {v['heads']}/{v['kv_heads']} heads: {times} ms; auto → {v['pick']} "
                  f"({v['ratio_to_best']:.2f}× best, within 1.10: {v['within_1_10']}, never worst: {v['never_worst']})",
                  flush=True)  # fmt: skip
        common.write_json(args.out / "auto.json", result)
    if not args.no_memory:
        result["memory"] = memory_check(args.memory_ranks, tuple(args.memory_lengths), args.timeout_s)
    result["load_average_end"] = os.getloadavg()
    common.write_json(args.out / "auto.json", result)
    if result["timing"]:
        plot(result["timing"], args.out / "auto.png")
    print(f"wrote {args.out / 'auto.json'} and {args.out / 'auto.png'}")


if __name__ == "__main__":
    main()
