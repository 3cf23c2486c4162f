"""``auto``'s cost and memory model fitted on one grid, checked on another: ``DIR/auto_fit.json`` (docs/auto.md).

python -m benchmarks.auto_fit --grid fit --timing --memory
python -m benchmarks.auto_fit --grid heldout --timing --memory
python -m benchmarks.auto_fit --fit --report"""

import collections
import json
import math
import statistics
from typing import Any

import torch

from benchmarks import memory
from benchmarks.common import Case, rank_values, read_json, script_args, ulysses_degree, write_json
from benchmarks.driver import dict_table
from benchmarks.strategies import STRATEGIES
from ds_ring.auto.model import BUFFERS, Calibration, Link, Option, Problem, memory_q_shards, plan_options
from ds_ring.auto.probe import agree_link, measure_link

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
COMMUNICATION = {"ring": "ring", "allgather": "allgather", "ulysses": None, "hybrid": "ring"}
LINK_KEYS = ("latency_s", "bandwidth", "flops")
BASELINE_CALIBRATION = {"compute": 1.0, "comm": 1.0}  # what auto computed with before any fit: the probe as measured
# the memory coefficients before this fit (calibrated by hand on 4 ranks, 8/8 heads, 4K→8K rows)
BASELINE_BUFFERS = {"ring": 0.75, "ring_dilated": 0.9, "allgather": 0.45, "ulysses": 0.0, "hybrid_ring": 1.0}


def problem(world: int, seq: int, heads: int, kv_heads: int, oversubscription: float = 1.0):
    """A grid point's :class:`~ds_ring.auto.model.Problem` (fp32, causal, head dim 64; hybrid 2 × p/2 at p = 4)."""
    degrees = ((1, world), (2, world // 2)) if world == 4 else ((1, world),)
    return Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=64, world=world, itemsize=4, causal=True,
                   layouts=("contiguous",), degrees=degrees, oversubscription=oversubscription)  # fmt: skip


def strategies_of(world: int, seq: int, heads: int, kv_heads: int) -> list[str]:
    """The strategies the model accepts at a point (hybrid only as 2 × p/2 at 4 ranks)."""
    valid = {o.strategy for o in plan_options(problem(world, seq, heads, kv_heads), Link()) if o.error is None}
    return [s for s in STRATEGIES if s in valid and (s != "hybrid" or world == 4)]


def agreed_link(timeout_s: float | None = None) -> dict[str, float]:
    """One probe of the world group as ``auto``'s first call runs it (``measure_link``, then ``agree_link``)."""
    link = agree_link(measure_link(None, torch.device("cpu"), timeout_s), None, timeout_s)
    return {key: getattr(link, key) for key in LINK_KEYS}


def spread(values: list[float]) -> dict[str, float]:
    """Min, median and max of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def time_point(world: int, seq: int, heads: int, kv_heads: int, rounds: int, probes: int, timeout_s: float) -> dict:
    """One timing point, measured in one launch (:func:`benchmarks.auto.interleaved_rank` with probes)."""
    from benchmarks.auto import interleaved_rank  # auto imports this module

    names = strategies_of(world, seq, heads, kv_heads)
    cases = [Case(n, seq, world, ulysses=2 if n == "hybrid" else 1, heads=heads, kv_heads=kv_heads) for n in names]
    got = rank_values(interleaved_rank, world, timeout_s, cases, rounds, timeout_s, probes)[0]
    point = {"ranks": world, "seq": seq, "heads": heads, "kv_heads": kv_heads, "rounds": rounds,
             "measured_s": {n: statistics.median(t) for n, t in got["times_s"].items()}, "times_s": got["times_s"],
             "link": {key: statistics.median(p[key] for p in got["links"]) for key in LINK_KEYS},
             "probes": got["links"], "loads": got["loads"], "oversubscription": got["oversubscription"]}  # fmt: skip
    times = ", ".join(f"{s} {t * 1e3:.0f} ms" for s, t in point["measured_s"].items())
    print(f"p={world} {seq} {heads}/{kv_heads}: {times}; probe {point['link']['flops'] / 1e9:.1f} GFLOP/s", flush=True)
    return point


def predict_times(point: dict, calibration=None) -> dict[str, float]:
    """The model's seconds per strategy at ``point`` (its median link, ``calibration``) and ``_pick``, its pick."""
    p = problem(point["ranks"], point["seq"], point["heads"], point["kv_heads"], point["oversubscription"])
    options = plan_options(p, Link(**point["link"], device="cpu"), calibration=calibration)
    out: dict[str, Any] = {"_pick": options[0].strategy}
    for o in options:
        if o.error is None and o.strategy in point["measured_s"] and o.communication == COMMUNICATION[o.strategy]:
            out.setdefault(o.strategy, o.time_s)
    return out


def time_ratios(points: list[dict], calibration=None) -> list[float]:
    """Measured ÷ predicted over every strategy of every point."""
    predicted = [predict_times(point, calibration) for point in points]
    return [m / p[s] for point, p in zip(points, predicted, strict=True) for s, m in point["measured_s"].items()]


def fit_time(points: list[dict]) -> tuple[float, float]:
    """``(compute, comm)`` minimising the sum of squared log(measured / predicted), on ever finer log grids."""
    loss = lambda compute, comm: sum(math.log(r) ** 2 for r in time_ratios(points, Calibration(compute, comm)))
    best = (1.0, 1.0)
    for span, steps in ((4.0, 17), (0.5, 21), (0.05, 21)):  # log10 span around the best so far
        grid = [span * (i / (steps - 1) - 0.5) for i in range(steps)]
        best = min([(best[0] * 10**a, best[1] * 10**b) for a in grid for b in grid], key=lambda c: loss(*c))
    return round(best[0], 3), round(best[1], 3)


def measure_memory(world: int, heads: int, kv_heads: int, lengths: tuple[int, int], timeout_s: float,
                   names: list[str]) -> list[dict]:  # fmt: skip
    """The measured slope (q-shards) of each strategy in ``names`` at one (ranks, heads, lengths)."""
    rows = []
    for name in names:
        call = memory.Call(name, COMMUNICATION[name], tokens_per_rank=lengths, mmap_threshold=65536, heads=heads,
                           kv_heads=kv_heads)  # fmt: skip
        got = memory.measure(call, world, "cpu", timeout_s)
        rows.append({"strategy": name, "ranks": world, "heads": heads, "kv_heads": kv_heads,
                     "tokens_per_rank": list(lengths), "measured_q_shards": got["slope_q_shards"],
                     "extra_mib": got["extra_mib"], "seconds": got["seconds"]})  # fmt: skip
        print(f"memory {name} p={world} {heads}/{kv_heads} {lengths}: {got['slope_q_shards']:.2f} q-shards", flush=True)
    return rows


def predict_memory(row: dict, buffers: dict[str, float] | None = None) -> float:
    """The model's q-shards for a memory row (at its longer length), with ``buffers`` (``None``: the model's)."""
    world, length, name = row["ranks"], row["tokens_per_rank"][1], row["strategy"]
    u = ulysses_degree(name, world)
    option = Option(name, COMMUNICATION[name], "contiguous", u, world // u, length * u)
    return memory_q_shards(problem(world, length * world, row["heads"], row["kv_heads"]), option, buffers)


def fit_memory(rows: list[dict]) -> dict[str, float]:
    """Least squares of each :data:`~ds_ring.auto.model.BUFFERS` coefficient the rows exercise (linear in each)."""
    fitted = dict(BUFFERS)  # Ulysses before hybrid: the hybrid's coefficient sits on top of the Ulysses one
    for strategy in STRATEGIES:
        key = "hybrid_ring" if strategy == "hybrid" else strategy
        if mine := [r for r in rows if r["strategy"] == strategy]:
            zero = {**fitted, key: 0.0}
            base = [predict_memory(r, zero) for r in mine]
            x = [predict_memory(r, {**zero, key: 1.0}) - b for r, b in zip(mine, base, strict=True)]
            y = [r["measured_q_shards"] - b for r, b in zip(mine, base, strict=True)]
            fitted[key] = round(sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x), 3)
    return fitted


def coefficients(results: dict) -> dict[str, Any]:
    """Fitted on ``fit``; *used* where its held-out median |log(measured / predicted)| beats the baseline's."""
    fit, held = results["fit"], results["heldout"]
    compute, comm = fit_time(fit["timing"])
    fitted = {"calibration_cpu": {"compute": compute, "comm": comm}, "buffers": fit_memory(fit["memory"])}
    baseline = {"calibration_cpu": BASELINE_CALIBRATION, "buffers": BASELINE_BUFFERS}
    median_abs_log = lambda ratios: statistics.median(abs(math.log(r)) for r in ratios)
    errors = {
        "time": lambda c: median_abs_log(time_ratios(held["timing"], Calibration(**c))),
        "memory": lambda b: median_abs_log([r["measured_q_shards"] / predict_memory(r, b) for r in held["memory"]]),
    }
    error, used = {}, {}
    for (kind, err), key in zip(errors.items(), fitted, strict=True):
        error[f"{kind}_fitted"], error[f"{kind}_baseline"] = err(fitted[key]), err(baseline[key])
        used[key] = fitted[key] if error[f"{kind}_fitted"] < error[f"{kind}_baseline"] else baseline[key]
    return {"fitted": fitted, "heldout_median_abs_log": error, "used": used}


def report(results: dict) -> dict[str, Any]:
    """Per grid, measured ÷ predicted with the model's constants: printed as tables, returned as spreads."""
    summary: dict[str, Any] = {}
    for grid in [g for g in results if g in GRIDS]:
        ratios, times, memories = collections.defaultdict(list), [], []
        for point in results[grid].get("timing", []):
            measured, predicted = point["measured_s"], predict_times(point)
            pick = predicted["_pick"]
            ratios["time"] += time_ratios([point])
            ratios["time_uncalibrated"] += time_ratios([point], Calibration())
            ratios["time_pick"].append(measured[pick] / predicted[pick])
            ratios["pick_over_best"].append(measured[pick] / min(measured.values()))
            ms = {s: f"{measured[s] * 1e3:.0f} / {predicted[s] * 1e3:.0f} ({measured[s] / predicted[s]:.2f})"
                  if s in measured else "" for s in STRATEGIES}  # fmt: skip
            times.append({"point": f"p={point['ranks']}, {point['seq']}, {point['heads']}/{point['kv_heads']}",
                          "load": f"{statistics.median(point['loads']):.1f}",
                          "probe GFLOP/s": f"{point['link']['flops'] / 1e9:.1f}", **ms,
                          "pick: measured / predicted": f"{pick} {ratios['time_pick'][-1]:.2f}",
                          "pick ÷ best": f"{ratios['pick_over_best'][-1]:.2f}"})  # fmt: skip
        for r in results[grid].get("memory", []):
            ratios["memory"].append(r["measured_q_shards"] / (predicted := predict_memory(r)))
            memories.append({"strategy": r["strategy"], "p": r["ranks"], "heads": f"{r['heads']}/{r['kv_heads']}",
                             "rows per rank": "{}→{}".format(*r["tokens_per_rank"]),
                             "measured": r["measured_q_shards"], "predicted": predicted,
                             "measured / predicted": ratios["memory"][-1]})  # fmt: skip
        print(f"\n### {grid}: time (ms), measured / predicted\n\n{dict_table(times)}")
        print(f"\n### {grid}: memory (q-shards), measured / predicted\n\n{dict_table(memories)}")
        summary[grid] = {k: {**spread(v), "n": len(v)} for k, v in ratios.items()}
        print(f"\n{grid}: {json.dumps(summary[grid])}")
    return summary


def main() -> None:
    args = script_args(
        __doc__, ("--grid", {"choices": sorted(GRIDS)}),
        ("--timing", {"action": "store_true", "help": "measure the grid's timing points"}),
        ("--memory", {"action": "store_true", "help": "measure the grid's memory rows"}),
        ("--rounds", {"type": int, "default": 7, "help": "calls per strategy and point (median)"}),
        ("--probes", {"type": int, "default": 3, "help": "agreed probes before each round"}),
        ("--fit", {"action": "store_true", "help": "fit the calibration and BUFFERS on the fit grid"}),
        ("--report", {"action": "store_true", "help": "measured / predicted with the model's constants"}),
        ("--only", {"nargs": "+", "metavar": "STRATEGY@RANKS",
                    "help": "with --memory: measure these rows only (ring@2 hybrid@4), keep the others"}),
        timeout_s=900,
    )  # fmt: skip
    path = args.out / "auto_fit.json"
    results = read_json(path)
    grid = results.setdefault(args.grid, {}) if args.grid else {}
    if args.grid and args.timing:
        grid["timing"] = []
        for world, seq, heads, kv in GRIDS[args.grid]["timing"]:
            grid["timing"].append(time_point(world, seq, heads, kv, args.rounds, args.probes, args.timeout_s))
            write_json(path, results)
    if args.grid and args.memory:
        chosen = lambda name, world: args.only is None or f"{name}@{world}" in args.only
        grid["memory"] = [r for r in grid.get("memory", []) if not chosen(r["strategy"], r["ranks"])]
        for world, heads, kv, lengths in GRIDS[args.grid]["memory"]:
            names = [n for n in strategies_of(world, lengths[1] * world, heads, kv) if chosen(n, world)]
            grid["memory"] += measure_memory(world, heads, kv, lengths, args.timeout_s, names)
            write_json(path, results)
    if args.fit:
        results["coefficients"] = coefficients(results)
        print(json.dumps(results["coefficients"], indent=1))
    if args.report:
        results["summary"] = report(results)
    if args.fit or args.report:
        write_json(path, results)


if __name__ == "__main__":
    main()
