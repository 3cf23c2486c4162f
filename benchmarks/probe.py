"""The noise of ``auto``'s probe and what it does to the choice (``benchmarks/SUITE.md``, docs/auto.md).

python -m benchmarks.probe --worlds 2 4 --repeats 20"""

import collections
import itertools
import os
import statistics
from typing import Any

from benchmarks.auto_fit import LINK_KEYS, agreed_link, problem, spread
from benchmarks.common import rank_values, read_json, script_args, write_json
from ds_ring.auto.model import Link, plan_options


def _probe_rank(rank: int, world: int, repeats: int, timeout_s: float) -> list[dict[str, Any]]:
    """``repeats`` agreed probes of the world group (what ``auto``'s first call measures), each with the load before."""
    return [{"load": os.getloadavg()[0], **agreed_link(timeout_s)} for _ in range(repeats)]


def ranges(values: list[float]) -> dict[str, float]:
    """Min, median, max and max ÷ min of ``values``."""
    return {**spread(values), "max_over_min": max(values) / min(values)}


def stability(world: int, probes: list[dict[str, Any]], seqs: list[int]) -> list[dict[str, Any]]:
    """``auto``'s choice under every probe on the grid (oversubscription 2 at 4 ranks, as on 2 cores)."""
    links = [Link(**{key: p[key] for key in LINK_KEYS}, source="probe") for p in probes]
    median = Link(**{key: statistics.median(p[key] for p in probes) for key in LINK_KEYS})
    rows = []
    for seq, (heads, kv) in itertools.product(seqs, ((8, 8), (8, 2))):
        call = problem(world, seq, heads, kv, 2.0 if world == 4 else 1.0)
        options = [plan_options(call, link) for link in links]
        picks = collections.Counter(o[0].label for o in options)
        ranked = [o for o in plan_options(call, median) if o.error is None]
        best, second = ranked[0], next((o for o in ranked[1:] if o.strategy != ranked[0].strategy), None)
        row = {"seq": seq, "heads": heads, "kv_heads": kv, "choices": dict(picks),
               "same_choice": picks.most_common(1)[0][1] / len(links), "median_choice": best.label}  # fmt: skip
        if second is not None:
            times = [{o.label: o.time_s for o in opts} for opts in options]
            ratios = [t[second.label] / t[best.label] for t in times]
            row.update(second=second.label, gap=second.time_s / best.time_s - 1, ratio_spread=ranges(ratios))
        rows.append(row)
    return rows


def main() -> None:
    args = script_args(
        __doc__,
        ("--worlds", {"nargs": "+", "type": int, "default": [2, 4]}),
        ("--repeats", {"type": int, "default": 20}),
        ("--seqs", {"nargs": "+", "type": int, "default": [2048, 4096, 8192, 16384, 32768]}),
        ("--label", {"default": "after", "help": "key of this run in the JSON (before / after)"}),
    )
    path = args.out / "probe.json"
    everything = read_json(path)
    everything[args.label] = results = []
    for world in args.worlds:
        probes = rank_values(_probe_rank, world, args.timeout_s, args.repeats, args.timeout_s)[0]
        s = {key: ranges([p[key] for p in probes]) for key in (*LINK_KEYS, "load")}  # agreed: the same on every rank
        grid = stability(world, probes, args.seqs)
        results.append({"world": world, "probes": probes, "spread": s, "grid": grid})
        text = ", ".join(f"{key} {r['min']:.3g}-{r['max']:.3g} (×{r['max_over_min']:.1f})" for key, r in s.items())
        print(f"p={world}: {args.repeats} probes; {text}", flush=True)
        for row in grid:
            print(f"  {row['seq']:6d} {row['heads']}/{row['kv_heads']}: same choice {row['same_choice']:.2f} "
                  f"{row['choices']}  gap to {row.get('second')} {row.get('gap', 0):.3f}", flush=True)  # fmt: skip
        write_json(path, everything)


if __name__ == "__main__":
    main()
