"""``strategy="auto"`` vs every strategy timed by hand, its memory model vs measurement; the goals: ``docs/auto.md``."""

import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import auto_fit, strategies
from benchmarks.common import Case, figure, fmt_seq, qkv_dout, rank_values
from benchmarks.driver import Benchmark, Session, dict_table, main
from benchmarks.strategies import STRATEGIES
from ds_ring.auto import strategy as auto
from ds_ring.comm import cores

GRID_HEADS = ((8, 8), (8, 2))
HOST_RANKS = 2  # per host, with --two-hosts
_CAUSE = re.compile(r"terminate called|what\(\)|Aborted|Fatal Python error|Error:")


def interleaved_rank(rank: int, world: int, cases: list[Case], rounds: int, timeout_s: float,
                     probes: int = 0) -> dict[str, Any]:  # fmt: skip
    """Rank function: ``rounds`` interleaved fwd+bwd calls of a grid point's cases (SUITE.md): each case's seconds per
    round (slowest rank) and ``auto``'s pick, or with ``probes`` that many probes and the load before each round."""
    c, gen = cases[0], torch.Generator().manual_seed(1000 + rank)
    q, k, v, dout = qkv_dout(gen, c.batch, c.seq * c.data // world, c.heads, c.kv_heads, c.head_dim)
    calls = {case.impl: strategies.build(case, rank, timeout_s) for case in cases}
    times: dict[str, list[float]] = {name: [] for name in calls}
    links, loads = [], []
    for r in range(rounds + 1):
        if r and probes:
            loads.append(os.getloadavg()[0])
            links.extend(auto_fit.agreed_link(timeout_s) for _ in range(probes))
        for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            q.grad = k.grad = v.grad = None
            dist.barrier()
            start = time.perf_counter()
            calls[name](q, k, v, None, None).backward(dout)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r:
                times[name].append(float(took))
    if probes:
        over = cores.oversubscription(range(world))
        return {"times_s": times, "links": links, "loads": loads, "oversubscription": over}
    chose = auto.decisions()[-1]  # the "auto" case's
    pick = {"pick": chose.strategy, "pick_label": chose.label, "predicted_s": chose.time_s, "link": vars(chose.link),
            "oversubscription": chose.oversubscription}  # fmt: skip
    return {"times_s": times, "choice": pick}


def grid_cases(seq: int, world: int, data: int, heads: int, kv_heads: int, ulysses: int) -> list[Case]:
    """The cases of one grid point: every strategy the model admits on its sequence-parallel ranks, and ``auto``."""
    names = auto_fit.strategies_of(world // data, seq, heads, kv_heads)
    u = ulysses if world // data == 4 else 1  # the hybrid's degrees on 4 sequence-parallel ranks
    return [Case(name, seq, world, ulysses=u, heads=heads, kv_heads=kv_heads, data=data) for name in [*names, "auto"]]


def plan(session: Session) -> None:
    args, session.extra["timing"] = session.args, []
    # (ranks, data-parallel replicas): every world asked for, and 4 ranks as 2 replicas of 2 sequence-parallel ranks
    setups = [(w, 1) for w in args.worlds] + [(4, 2)] * (4 in args.worlds and args.data)
    for (world, data), seq, (heads, kv_heads) in itertools.product(setups, args.seqs, GRID_HEADS):
        cases = grid_cases(seq, world, data, heads, kv_heads, ulysses=2)
        got = rank_values(interleaved_rank, world, args.timeout_s, cases, args.rounds, args.timeout_s)[0]
        point = {"ranks": world, "data": data, "hosts": 1, "seq": seq, "heads": heads, "kv_heads": kv_heads}
        _verdict(session, {**point, **got})
    if args.two_hosts:
        points = time_two_hosts(args.seqs, args.rounds, args.timeout_s)
        if isinstance(points, str):
            print(f"no two-host points: {points}", flush=True)
            session.extra["two_hosts_skipped"], points = points, []
        for got in points:
            _verdict(session, got)
    session.extra["memory"] = [] if args.no_memory else memory_check(args)


def time_two_hosts(seqs: list[int], rounds: int, timeout_s: float) -> list[dict[str, Any]] | str:
    """The grid points of :func:`host_rank` on two hosts (one launch), or why they could not run."""
    from tests.multihost.hosts import TwoHosts, unavailable

    if (reason := unavailable()) is not None:
        return f"two hosts on one machine: {reason}"
    with tempfile.TemporaryDirectory() as tmp:
        out, hosts = Path(tmp), TwoHosts()
        try:
            hosts.open()
            argv = ["-m", "benchmarks.auto", "--host-rank", tmp, str(rounds), str(timeout_s), *map(str, seqs)]
            hosts.torchrun(argv, out, nproc=HOST_RANKS)
            if (codes := hosts.wait(timeout_s)) != [0, 0] or not (out / "hosts.json").exists():
                logs = [hosts.output(0), hosts.output(1)]
                causes = [line for log in logs for line in log.splitlines() if _CAUSE.search(line)][:20]
                return f"two-host launch exited {codes}; {causes}: {logs[0][-1500:]}{logs[1][-1500:]}"
            return json.loads((out / "hosts.json").read_text())
        finally:
            hosts.close()


def host_rank(out: str, rounds: str, timeout_s: str, *seqs: str) -> None:
    """One rank of ``--two-hosts`` under torchrun: every grid point in this launch; rank 0 writes ``OUT/hosts.json``."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    points = []
    for seq, (heads, kv_heads) in itertools.product(map(int, seqs), GRID_HEADS):
        cases = grid_cases(seq, world, 1, heads, kv_heads, ulysses=HOST_RANKS)
        point = {"ranks": world, "data": 1, "hosts": 2, "seq": seq, "heads": heads, "kv_heads": kv_heads}
        points.append({**point, **interleaved_rank(rank, world, cases, int(rounds), float(timeout_s))})
    if rank == 0:
        (Path(out) / "hosts.json").write_text(json.dumps(points))
    dist.destroy_process_group()


def _verdict(session: Session, got: dict[str, Any]) -> None:
    """Adds a grid point's verdict (``got``: the point, ``times_s`` and ``choice``) unless a time is missing."""
    point = {k: v for k, v in got.items() if k not in ("times_s", "choice")}
    med = {name: statistics.median(t) for name, t in got["times_s"].items() if t}
    by_name, choice = {k: v for k, v in med.items() if k != "auto"}, got["choice"]
    if "auto" in med and choice["pick"] in by_name:
        best, worst, auto_s = min(by_name.values()), max(by_name.values()), med["auto"]
        session.extra["timing"].append(got := {
            **point, "measured_s": by_name, "auto_s": auto_s, "pick": choice["pick_label"],
            "pick_s": by_name[choice["pick"]], "rounds": session.args.rounds, "best": min(by_name, key=by_name.get),
            "ratio_to_best": auto_s / best,
            "within_1_10": auto_s <= 1.10 * best, "never_worst": len(by_name) == 1 or auto_s < worst,
            "predicted_pick_s": choice["predicted_s"], "link": choice["link"],
            "oversubscription": choice["oversubscription"],
        })  # fmt: skip
    print(f"{point}: {got}", flush=True)
    session.write_json()


def memory_check(args: Any) -> list[dict[str, Any]]:
    """Measured slope (q-shards, :func:`benchmarks.auto_fit.measure_memory`) vs the model's, per strategy."""
    rows = auto_fit.measure_memory(args.memory_ranks, 8, 8, tuple(args.memory_lengths), args.timeout_s, STRATEGIES)
    for row in rows:
        measured, predicted = row["measured_q_shards"], auto_fit.predict_memory(row)
        row.update(predicted_q_shards=predicted, error=predicted / measured - 1 if measured else None,
                   within_15pct=bool(measured) and abs(predicted / measured - 1) <= 0.15)  # fmt: skip
    return rows


def _dp(point: dict[str, Any]) -> str:
    """The point's data parallelism and hosts, when there are more than one."""
    return f" (dp {point['data']})" * (point["data"] > 1) + " (2 hosts)" * (point["hosts"] > 1)


def report(session: Session) -> str:
    timing = [{
        "point": f"p={v['ranks']}{_dp(v)} {fmt_seq(v['seq'])} {v['heads']}/{v['kv_heads']} heads",
        "median ms": "  ".join(f"{k} {s * 1e3:.0f}" for k, s in {**v["measured_s"], "auto": v["auto_s"]}.items()),
        "auto picks": v["pick"], "× best": v["ratio_to_best"], "within 1.10": v["within_1_10"],
        "never worst": v["never_worst"],
    } for v in session.extra["timing"]]  # fmt: skip
    memory = [{"strategy": m["strategy"], "p": m["ranks"], "measured q-shards": m["measured_q_shards"],
               "predicted q-shards": m["predicted_q_shards"], "within 15 %": m["within_15pct"]}
              for m in session.extra["memory"]]  # fmt: skip
    return f"{dict_table(timing)}\n\n{dict_table(memory)}"


def plots(session: Session) -> None:
    """Median step time per strategy at each grid point; a circle: auto's own median, at its pick's bar."""
    verdicts = session.extra["timing"]
    with figure(session.out / "auto.png", max(6, len(verdicts) * 0.9), 4) as (ax,):
        labels = [f"p{v['ranks']}{_dp(v)} {fmt_seq(v['seq'])}\n{v['heads']}/{v['kv_heads']}h" for v in verdicts]
        for j, name in enumerate(STRATEGIES):
            xs = [i + (j - 1.5) * 0.18 for i, v in enumerate(verdicts) if name in v["measured_s"]]
            ax.bar(xs, [v["measured_s"][name] for v in verdicts if name in v["measured_s"]], width=0.18, label=name)
        for i, v in enumerate(verdicts):
            j = STRATEGIES.index(v["pick"].split()[0].split("/")[0])
            ax.plot(i + (j - 1.5) * 0.18, v["auto_s"], "ko", fillstyle="none", markersize=10)
        ax.set_xticks(range(len(verdicts)), labels, fontsize=7)
        ax.set(ylabel="fwd+bwd seconds (slowest rank)",
               title="strategy='auto' (circled: its own time) vs every strategy, fp32 causal, gloo CPU")  # fmt: skip
        ax.legend(fontsize=7)


def add_args(p: Any) -> None:
    p.add_argument("--rounds", type=int, default=9, help="timed calls per strategy and point, interleaved (median)")
    p.add_argument("--memory-ranks", type=int, default=4)
    p.add_argument("--memory-lengths", nargs=2, type=int, default=[4096, 8192], help="rows per rank")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-data", dest="data", action="store_false", help="no data-parallel point (4 ranks as 2 × 2)")
    p.add_argument("--two-hosts", action="store_true", help="also 4 ranks on two hosts (network namespaces, root)")


BENCHMARK = Benchmark(
    name="auto", module="benchmarks.auto", title="strategy='auto' vs every strategy, fp32 causal, head dim 64",
    plan=plan, build=strategies.build, report=report, plots=plots, add_args=add_args,
    seqs=([2048, 4096], [2048]), worlds=[2, 4], calls=3,
)  # fmt: skip
if __name__ == "__main__":  # --host-rank OUT ROUNDS TIMEOUT_S SEQ...: one rank of --two-hosts, under torchrun
    argv = sys.argv[1:]
    raise SystemExit(host_rank(*argv[1:]) if argv[:1] == ["--host-rank"] else main(BENCHMARK))
