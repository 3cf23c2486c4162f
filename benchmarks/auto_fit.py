"""``auto``'s cost and memory model fitted on one grid and validated on another (``docs/auto.md`` "Fitted, then held
out"). Writes ``DIR/auto_fit.json``: per grid (``fit``, ``heldout``) the timing points and the memory rows.

Timing, per grid point (one launch of 1-thread CPU ranks, gloo; fp32, causal, contiguous, head dim 64): every strategy
the heads and ranks admit (``ring``, ``allgather``, ``ulysses``, and ``hybrid`` 2 × p/2 at 4 ranks) built side by side,
warmed up, then ``--rounds`` rounds; each round starts with ``--probes`` agreed probes (what ``auto``'s first call
measures, :func:`ds_ring.auto.probe.measure_link` then :func:`~ds_ring.auto.probe.agree_link`) and then one fwd+bwd
call of every strategy, the order reversed every other round, all ranks starting each call together and the slowest
rank's time counted. A strategy's measured time is the median of its rounds; its prediction is the model's under the
median of the point's probes, taken between its calls, so load changes the probe and the calls alike. The point keeps
the raw link (no calibration), so the fit can be redone from the JSON.

Memory, per row (:func:`benchmarks.memory.measure`: fresh rank processes per length, slope between two lengths in
q-shards, every block over 64 KiB mmap'ed so the RSS follows live tensors), against :func:`ds_ring.auto.model.
memory_q_shards`.

The fit (``--fit``: no measurement) reads the ``fit`` grid only: the time calibration (:class:`ds_ring.auto.model.
Calibration`: compute and communication scales, least squares of log(measured / predicted) over every strategy of
every point) and the memory coefficients (:data:`ds_ring.auto.model.BUFFERS`, least squares per coefficient). Then
the gate (:func:`coefficients`): each fit is used only if it predicts the ``heldout`` grid better than what the model
had before (median |log(measured / predicted)|). The model carries the used ones as constants, and
``tests/test_auto_fit.py`` checks they are this gate's.
``--report`` prints predicted against measured with the model's constants, per grid.

    python -m benchmarks.auto_fit --grid fit --timing --memory
    python -m benchmarks.auto_fit --grid heldout --timing --memory
    python -m benchmarks.auto_fit --fit --report"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, Case, write_json

GRIDS: dict[str, dict[str, Any]] = {
    # the grid the model is fitted on (the grid docs/auto.md's timing table was tuned on)
    "fit": {
        "timing": [(w, s, h, kv) for w in (2, 4) for s in (2048, 4096) for h, kv in ((8, 8), (8, 2))],
        "memory": [(w, h, kv, (4096, 8192)) for w in (2, 4) for h, kv in ((8, 8),)],
    },
    # held out: other lengths, head counts (12/4 GQA, 6/6 MHA), and 3 ranks; memory: 8/2 GQA (K/V a quarter of the
    # fit's) and 3 ranks, at the fit's lengths (at 3K→6K rows, 12/4 heads, the slope read 0.9 q-shards: fixed costs)
    "heldout": {
        "timing": [(w, s, h, kv) for w in (2, 3, 4) for s in (3072, 6144) for h, kv in ((12, 4), (6, 6))],
        "memory": [(w, 8, 2, (4096, 8192)) for w in (2, 3, 4)],
    },
}
STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
COMMUNICATION = {"ring": "ring", "allgather": "allgather", "ulysses": None, "hybrid": "ring"}
LINK_KEYS = ("latency_s", "bandwidth", "flops")


def problem(world: int, seq: int, heads: int, kv_heads: int, oversubscription: float = 1.0):
    """The :class:`~ds_ring.auto.model.Problem` of a grid point as ``auto`` sees it (degrees ``1 × p``, and
    ``2 × p/2`` when ``p`` is 4)."""
    from ds_ring.auto.model import Problem

    degrees = ((1, world), (2, world // 2)) if world == 4 else ((1, world),)
    return Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=64, world=world, itemsize=4, causal=True,
                   layouts=("contiguous",), degrees=degrees, oversubscription=oversubscription)  # fmt: skip


def strategies_of(world: int, seq: int, heads: int, kv_heads: int) -> list[str]:
    """The strategies the model accepts at a point (hybrid only as 2 × p/2 at 4 ranks)."""
    from ds_ring.auto.model import Link, plan_options

    valid = {o.strategy for o in plan_options(problem(world, seq, heads, kv_heads), Link()) if o.error is None}
    return [s for s in STRATEGIES if s in valid and (s != "hybrid" or world == 4)]


def _point_rank(rank: int, world: int, cases: list[Case], rounds: int, probes: int, timeout_s: float) -> dict:
    """Rank function of one timing point: the strategies' slowest-rank seconds per round, the agreed probes taken
    before each round (with the load average), and the oversubscription the topology records."""

    import torch

    from benchmarks import strategies
    from ds_ring.auto.probe import agree_link, measure_link
    from ds_ring.comm import cores

    first = cases[0]
    gen = torch.Generator().manual_seed(1000 + rank)
    rows, kv = first.seq // world, first.kv_heads or first.heads
    q, k, v, dout = (torch.randn(1, rows, h, first.head_dim, generator=gen) for h in (first.heads, kv, kv, first.heads))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    calls = {case.impl: strategies.build(case, rank, timeout_s) for case in cases}
    links, loads = [], []
    cpu = torch.device("cpu")

    def probe() -> None:  # before each timed round: the probes auto's first call runs, under the same load
        loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
        for _ in range(probes):
            link = agree_link(measure_link(None, cpu, timeout_s), None, timeout_s)
            links.append({key: getattr(link, key) for key in LINK_KEYS})

    times = strategies.interleaved_rounds(calls, (q, k, v, dout), rounds, before_round=probe)
    return {"times_s": times, "links": links, "loads": loads, "oversubscription": cores.oversubscription(range(world))}


def time_point(world: int, seq: int, heads: int, kv_heads: int, rounds: int, probes: int, timeout_s: float) -> dict:
    """One timing point, measured (one launch)."""
    from ds_ring import testing

    names = strategies_of(world, seq, heads, kv_heads)
    cases = [Case(n, seq, world, ulysses=2 if n == "hybrid" else 1, heads=heads, kv_heads=kv_heads) for n in names]
    kwargs = {"cases": cases, "rounds": rounds, "probes": probes, "timeout_s": timeout_s}
    got = testing.rank_results(testing.spawn_ranks(_point_rank, world, timeout_s=timeout_s, kwargs=kwargs))[0]
    link = {key: statistics.median(p[key] for p in got["links"]) for key in LINK_KEYS}
    return {"ranks": world, "seq": seq, "heads": heads, "kv_heads": kv_heads, "rounds": rounds,
            "measured_s": {n: statistics.median(t) for n, t in got["times_s"].items()}, "times_s": got["times_s"],
            "link": link, "probes": got["links"], "loads": got["loads"],
            "oversubscription": got["oversubscription"]}  # fmt: skip


def predict_times(point: dict, calibration=None) -> dict[str, float]:
    """The model's seconds per strategy at ``point`` under its median raw link with ``calibration`` (``None``: the
    model's own, :data:`ds_ring.auto.model.CALIBRATION` for a CPU link) and which strategy it picks."""
    from ds_ring.auto.model import Link, plan_options

    link = Link(**point["link"], device="cpu")
    p = problem(point["ranks"], point["seq"], point["heads"], point["kv_heads"], point["oversubscription"])
    options = plan_options(p, link, calibration=calibration)
    out: dict[str, float] = {}
    for o in options:
        if o.error is None and o.strategy in point["measured_s"] and o.communication == COMMUNICATION[o.strategy]:
            out.setdefault(o.strategy, o.time_s)
    out["_pick"] = options[0].strategy  # type: ignore[assignment]
    return out


def fit_time(points: list[dict]) -> tuple[float, float]:
    """``(compute, comm)`` scales minimising the sum of squared log(measured / predicted) over every strategy of every
    point: a coarse log grid, then a finer one around its best."""
    from ds_ring.auto.model import Calibration

    def loss(compute: float, comm: float) -> float:
        total = 0.0
        for point in points:
            predicted = predict_times(point, Calibration(compute, comm))
            total += sum(math.log(point["measured_s"][s] / predicted[s]) ** 2 for s in point["measured_s"])
        return total

    best = (1.0, 1.0)
    for span, steps in ((4.0, 17), (0.5, 21), (0.05, 21)):  # log10 span around the best so far
        grid = [span * (i / (steps - 1) - 0.5) for i in range(steps)]
        candidates = [(best[0] * 10**a, best[1] * 10**b) for a in grid for b in grid]
        best = min(candidates, key=lambda c: loss(*c))
    return round(best[0], 3), round(best[1], 3)


def measure_memory(
    world: int, heads: int, kv_heads: int, lengths: tuple[int, int], timeout_s: float, only: set[str] | None = None
) -> list[dict]:
    """Every strategy's measured slope at one (ranks, heads, lengths) (``only``: those named ``strategy@ranks``)."""
    from benchmarks import memory

    rows = []
    for name in strategies_of(world, lengths[1] * world, heads, kv_heads):
        if only is not None and f"{name}@{world}" not in only:
            continue
        call = memory.Call(name, COMMUNICATION[name], tokens_per_rank=lengths, mmap_threshold=65536, heads=heads,
                           kv_heads=kv_heads)  # fmt: skip
        got = memory.measure(call, world, "cpu", timeout_s)
        rows.append({"strategy": name, "ranks": world, "heads": heads, "kv_heads": kv_heads,
                     "tokens_per_rank": list(lengths), "measured_q_shards": got["slope_q_shards"],
                     "extra_mib": got["extra_mib"], "seconds": got["seconds"]})  # fmt: skip
        print(f"memory {name:9s} p={world} {heads}/{kv_heads} {lengths}: {got['slope_q_shards']:.2f} q-shards",
              flush=True)  # fmt: skip
    return rows


def predict_memory(row: dict, buffers: dict[str, float] | None = None) -> float:
    """The model's q-shards for a memory row (at its longer length), with ``buffers`` (``None``: the model's)."""
    from ds_ring.auto import model

    world, length = row["ranks"], row["tokens_per_rank"][1]
    u = 2 if row["strategy"] == "hybrid" else (world if row["strategy"] == "ulysses" else 1)
    option = model.Option(row["strategy"], COMMUNICATION[row["strategy"]], "contiguous", u, world // u, length * u)
    return model.memory_q_shards(problem(world, length * world, row["heads"], row["kv_heads"]), option, buffers)


def fit_memory(rows: list[dict]) -> dict[str, float]:
    """Each coefficient of :data:`~ds_ring.auto.model.BUFFERS` that the rows exercise, by least squares (the model
    is linear in each: prediction = base + x · coefficient)."""
    from ds_ring.auto.model import BUFFERS

    uses = {"ring": "ring", "allgather": "allgather", "ulysses": "ulysses", "hybrid": "hybrid_ring"}  # Ulysses first:
    # the hybrid's coefficient sits on top of the Ulysses one
    fitted = dict(BUFFERS)
    for strategy, key in uses.items():
        mine = [r for r in rows if r["strategy"] == strategy]
        if not mine:
            continue
        zero = {**fitted, key: 0.0}
        base = [predict_memory(r, zero) for r in mine]
        x = [predict_memory(r, {**zero, key: 1.0}) - b for r, b in zip(mine, base, strict=True)]
        y = [r["measured_q_shards"] - b for r, b in zip(mine, base, strict=True)]
        fitted[key] = round(sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x), 3)
    return fitted


BASELINE_CALIBRATION = {"compute": 1.0, "comm": 1.0}
"""What ``auto`` computed with before any fit: the probe's rates as measured."""
BASELINE_BUFFERS = {"ring": 0.75, "ring_dilated": 0.9, "allgather": 0.45, "ulysses": 0.0, "hybrid_ring": 1.0}
"""The memory coefficients before this fit (calibrated by hand on 4 ranks, 8/8 heads, 4K→8K rows)."""


def _median_abs_log(ratios: list[float]) -> float:
    return statistics.median(abs(math.log(r)) for r in ratios)


def time_error(points: list[dict], calibration: dict[str, float]) -> float:
    """Median |log(measured / predicted)| over every strategy of every point under ``calibration``."""
    from ds_ring.auto.model import Calibration

    ratios = []
    for point in points:
        predicted = predict_times(point, Calibration(**calibration))
        ratios += [point["measured_s"][s] / predicted[s] for s in point["measured_s"]]
    return _median_abs_log(ratios)


def memory_error(rows: list[dict], buffers: dict[str, float]) -> float:
    """Median |log(measured / predicted)| over the memory rows with ``buffers``."""
    return _median_abs_log([row["measured_q_shards"] / predict_memory(row, buffers) for row in rows])


def coefficients(results: dict) -> dict[str, Any]:
    """Fitted on the ``fit`` grid, then gated on the ``heldout`` grid: a fit is *used* (what the model carries) only
    where its median |log(measured / predicted)| on the held-out grid is below the baseline's (what ``auto`` used
    before), else the baseline stays."""
    fit, held = results["fit"], results["heldout"]
    compute, comm = fit_time(fit["timing"])
    fitted = {"calibration_cpu": {"compute": compute, "comm": comm}, "buffers": fit_memory(fit["memory"])}
    error = {
        "time_fitted": time_error(held["timing"], fitted["calibration_cpu"]),
        "time_baseline": time_error(held["timing"], BASELINE_CALIBRATION),
        "memory_fitted": memory_error(held["memory"], fitted["buffers"]),
        "memory_baseline": memory_error(held["memory"], BASELINE_BUFFERS),
    }
    used = {
        "calibration_cpu": fitted["calibration_cpu"] if error["time_fitted"] < error["time_baseline"]
        else BASELINE_CALIBRATION,
        "buffers": fitted["buffers"] if error["memory_fitted"] < error["memory_baseline"] else BASELINE_BUFFERS,
    }  # fmt: skip
    return {"fitted": fitted, "heldout_median_abs_log": error, "used": used}


def spread(ratios: list[float]) -> dict[str, float]:
    """Median, min and max of measured ÷ predicted."""
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def report(results: dict) -> dict[str, Any]:
    """Per grid: measured ÷ predicted (time of every strategy and of the model's pick; memory) with the model's own
    constants (and the time uncalibrated, for comparison), rows and median / range; printed as markdown tables."""
    from ds_ring.auto.model import Calibration

    summary: dict[str, Any] = {}
    for grid, data in results.items():
        if grid not in GRIDS:
            continue
        time_rows, picked, mem_rows, raw, regret = [], [], [], [], []
        print(f"\n### {grid}: time (ms), measured / predicted\n")
        print(
            "| point | load | probe GFLOP/s | "
            + " | ".join(STRATEGIES)
            + " | pick: measured / predicted | pick ÷ best |"
        )
        print("|---|---|---|" + "---|" * len(STRATEGIES) + "---|---|")
        for point in data.get("timing", []):
            predicted = predict_times(point)
            pick = predicted.pop("_pick")
            uncalibrated = predict_times(point, Calibration())
            raw += [point["measured_s"][s] / uncalibrated[s] for s in point["measured_s"]]
            cells = []
            for s in STRATEGIES:
                if s not in point["measured_s"]:
                    cells.append("")
                    continue
                ratio = point["measured_s"][s] / predicted[s]
                time_rows.append(ratio)
                cells.append(f"{point['measured_s'][s] * 1e3:.0f} / {predicted[s] * 1e3:.0f} ({ratio:.2f})")
            picked.append(point["measured_s"][pick] / predicted[pick])
            regret.append(point["measured_s"][pick] / min(point["measured_s"].values()))
            load = statistics.median(point["loads"])
            print(
                f"| p={point['ranks']}, {point['seq']}, {point['heads']}/{point['kv_heads']} | {load:.1f} | "
                f"{point['link']['flops'] / 1e9:.1f} | "
                + " | ".join(cells)
                + f" | {pick} {picked[-1]:.2f} | {regret[-1]:.2f} |"
            )
        print(f"\n### {grid}: memory (q-shards), measured / predicted\n")
        print("| strategy | p | heads | rows per rank | measured | predicted | measured / predicted |")
        print("|---|---|---|---|---|---|---|")
        for row in data.get("memory", []):
            predicted = predict_memory(row)
            mem_rows.append(row["measured_q_shards"] / predicted)
            print(f"| {row['strategy']} | {row['ranks']} | {row['heads']}/{row['kv_heads']} | "
                  f"{row['tokens_per_rank'][0]}→{row['tokens_per_rank'][1]} | {row['measured_q_shards']:.2f} | "
                  f"{predicted:.2f} | {mem_rows[-1]:.2f} |")  # fmt: skip
        pairs = (("time", time_rows), ("time_pick", picked), ("time_uncalibrated", raw), ("pick_over_best", regret),
                 ("memory", mem_rows))  # fmt: skip
        summary[grid] = {k: spread(v) for k, v in pairs if v}
        print(f"\n{grid}: {json.dumps(summary[grid])}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=sorted(GRIDS))
    parser.add_argument("--timing", action="store_true", help="measure the grid's timing points")
    parser.add_argument("--memory", action="store_true", help="measure the grid's memory rows")
    parser.add_argument("--rounds", type=int, default=7, help="calls per strategy and point (median)")
    parser.add_argument("--probes", type=int, default=3, help="agreed probes before each round")
    parser.add_argument("--fit", action="store_true", help="fit the calibration and BUFFERS on the fit grid")
    parser.add_argument("--report", action="store_true", help="measured / predicted with the model's constants")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", nargs="+", metavar="STRATEGY@RANKS",
                        help="with --memory: measure these rows only (ring@2 hybrid@4), keep the others")  # fmt: skip
    args = parser.parse_args()
    path = args.out / "auto_fit.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    if args.grid and args.timing:
        grid = results.setdefault(args.grid, {})
        grid["timing"] = []
        for world, seq, heads, kv in GRIDS[args.grid]["timing"]:
            point = time_point(world, seq, heads, kv, args.rounds, args.probes, args.timeout_s)
            grid["timing"].append(point)
            print(
                f"{args.grid} p={world} {seq} {heads}/{kv}: "
                + ", ".join(f"{s} {t * 1e3:.0f} ms" for s, t in point["measured_s"].items())
                + f"; probe {point['link']['flops'] / 1e9:.1f} GFLOP/s, load {point['loads']}",
                flush=True,
            )
            write_json(path, results)
    if args.grid and args.memory:
        grid = results.setdefault(args.grid, {})
        only = None if args.only is None else set(args.only)
        kept = [r for r in grid.get("memory", []) if only is not None and f"{r['strategy']}@{r['ranks']}" not in only]
        grid["memory"] = kept
        for world, heads, kv, lengths in GRIDS[args.grid]["memory"]:
            grid["memory"] += measure_memory(world, heads, kv, lengths, args.timeout_s, only)
            write_json(path, results)
    if args.fit:
        results["coefficients"] = coefficients(results)
        print(json.dumps(results["coefficients"], indent=1))
        write_json(path, results)
    if args.report:
        results["summary"] = report(results)
        write_json(path, results)


if __name__ == "__main__":
    main()
