"""Activation memory per rank of one forward+backward as a slope in q-shards plus a fixed cost (``SUITE.md``): each
(call, ranks) at two local lengths in fresh rank processes; rows under ``--label`` in ``DIR/memory.json``, plot
``DIR/memory.png``.

    python -m benchmarks.memory --ranks 1 2 4 --calls dense_ring dilated_ring --label before
"""

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import MIB, Series, current_rss_bytes, plot_panels, proc_mib, release_free_memory, write_json
from ds_ring.testing import rank_results, spawn_ranks

HEADS, HEAD_DIM = 8, 64


@dataclass(frozen=True)
class Call:
    """An attention call: strategy, K/V exchange, layout, branches (fractions of S), the two lengths per rank."""

    strategy: str
    communication: str | None = None
    layout: str = "contiguous"
    segments: tuple[float, ...] | None = None
    rates: tuple[int, ...] | None = None
    tokens_per_rank: tuple[int, int] = (4096, 8192)


_LONGNET = {"segments": (1 / 32, 1 / 4, 1), "rates": (1, 4, 16), "tokens_per_rank": (16384, 32768)}
CALLS = {
    "dense_ring": Call("ring"), "dense_ring_zigzag": Call("ring", layout="zigzag"),
    "dense_allgather": Call("allgather", communication="allgather"), "dense_ulysses": Call("ulysses"),
    "dense_hybrid": Call("hybrid"),
    "dilated_local": Call("ring", segments=(1 / 16, 1 / 8, 1 / 4), rates=(1, 2, 4), tokens_per_rank=(16384, 32768)),
    "dilated_ring": Call("ring", **_LONGNET), "dilated_allgather": Call("allgather", "allgather", **_LONGNET),
}  # fmt: skip


def _measure(rank: int, world: int, call: Call, local_len: int, device: str) -> dict:
    """One rank: fwd+bwd of ``call`` on a ``local_len``-row shard; peak extra MiB over q, k, v, dout; seconds."""
    import torch

    import ds_ring

    seq = local_len * world
    segments = None if call.segments is None else [max(1, int(seq * f)) for f in call.segments]
    rates = None if call.rates is None else list(call.rates)
    ulysses = 2 if call.strategy == "hybrid" and world > 1 else (world if call.strategy == "ulysses" else 1)
    topology = ds_ring.Topology(ulysses=ulysses, ring=world // ulysses)
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn((1, local_len, HEADS, HEAD_DIM), generator=g).to(device) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    release_free_memory()  # gc, and (CPU) freed heap back to the OS before the baseline
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / MIB
    else:
        base = current_rss_bytes() / MIB
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    out = ds_ring.sequence_parallel_attention(
        q, k, v, segments, rates, causal=True, topology=topology, strategy=call.strategy,
        communication=call.communication, layout=call.layout,
    )  # fmt: skip
    out.backward(dout)
    seconds = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / MIB
    else:
        peak = proc_mib("VmHWM", "/proc/self/status")
    return {"extra_mib": peak - base, "seconds": seconds, "q_shard_mib": q.numel() * q.element_size() / MIB}


def measure(call: Call, world: int, device: str, timeout_s: float) -> dict[str, Any]:
    """Both lengths of ``call`` on ``world`` ranks: extra MiB (max over ranks), seconds, slope and fixed MiB."""
    points = []
    for local_len in call.tokens_per_rank:
        args = (call, local_len, device)
        values = rank_results(spawn_ranks(_measure, world, timeout_s=timeout_s, args=args, preload=("torch",)))
        extra, seconds = (max(v[key] for v in values) for key in ("extra_mib", "seconds"))
        points.append((extra, seconds, values[0]["q_shard_mib"]))
    (e1, t1, b1), (e2, t2, b2) = points
    slope = (e2 - e1) / (b2 - b1)
    return {"ranks": world, "tokens_per_rank": call.tokens_per_rank, "extra_mib": (e1, e2),
            "seconds": (t1, t2), "slope_q_shards": slope, "fixed_mib": e1 - slope * b1}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", nargs="+", choices=sorted(CALLS), default=list(CALLS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--label", default="after", help="key of this run in the JSON (e.g. before / after)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: p = 1 only (gloo ranks)")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "memory.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    rows = [r for r in results.get(args.label, []) if not (r["call"] in args.calls and r["ranks"] in args.ranks)]
    for world in args.ranks:
        for name in args.calls:
            if CALLS[name].strategy == "hybrid" and world % 2:
                continue  # hybrid needs a ulysses degree of 2 here
            r = {"call": name, **measure(CALLS[name], world, args.device, args.timeout_s)}
            (e1, e2), (t1, t2) = r["extra_mib"], r["seconds"]
            print(f"{name:18s} p={world}  slope {r['slope_q_shards']:5.2f} q-shards  fixed {r['fixed_mib']:6.1f} MiB  "
                  f"extra {e1:.0f}/{e2:.0f} MiB  time {t1:.2f}/{t2:.2f} s", flush=True)  # fmt: skip
            results[args.label] = rows = [*rows, r]
            write_json(path, results)
    panels = {"activation memory slope": [], "fixed cost": []}  # a line per (call, label), dashed for "before"
    for label in (label for label in ("before", "after") if label in results):
        for name in sorted({r["call"] for r in results[label]}):
            mine = [r for r in results[label] if r["call"] == name]
            for key, series in zip(("slope_q_shards", "fixed_mib"), panels.values(), strict=True):
                xy = [r["ranks"] for r in mine], [r[key] for r in mine]
                series.append(Series(f"{name} ({label})", *xy, "--o" if label == "before" else "-o"))
    plot_panels(
        args.out / "memory.png", list(panels.items()),
        xlabel="ranks", ylabel=["slope (q-shards per rank)", "fixed MiB per rank"], xticks=[1, 2, 4, 8], logy=False,
        title="activation memory per rank of one fwd+bwd, fp32, 8 heads × 64, causal",
    )  # fmt: skip


if __name__ == "__main__":
    main()
