"""``benchmarks.auto`` on two hosts: 4 ranks, 2 per host, in the multi-host tests' setup (two network namespaces
of this machine joined by a veth pair, one ``torchrun`` agent each: ``tests/multihost/hosts.py``).

:func:`time_two_hosts` (driver) opens the hosts and runs this module on both; each rank (``python -m
benchmarks.hosts OUT ROUNDS CALLS SEQ...``, under torchrun) times every strategy and ``auto`` on the topology
Ulysses 2 (inside a host) × ring 2 (across them) with :func:`benchmarks.auto.auto_rank` (a warm-up, then ``CALLS``
timed calls), ``ROUNDS`` rounds in alternating order, all in one launch; rank 0 writes each case's slowest rank's
median to ``OUT/hosts.json``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HOST_RANKS = 2


def time_two_hosts(seqs: list[int], rounds: int, calls: int, timeout_s: float) -> list[dict[str, Any]] | str:
    """Per (seq, heads) point the rounds' times of every strategy and ``auto`` and auto's pick, or why the two hosts
    could not run (no namespaces here, or the launch failed: the logs' tail)."""
    from tests.multihost.hosts import TwoHosts, unavailable

    if (reason := unavailable()) is not None:
        return f"two hosts on one machine: {reason}"
    with tempfile.TemporaryDirectory() as tmp:
        out, hosts = Path(tmp), TwoHosts()
        try:
            hosts.open()
            hosts.torchrun(["-m", "benchmarks.hosts", tmp, str(rounds), str(calls), *map(str, seqs)], out,
                           nproc=HOST_RANKS)  # fmt: skip
            codes = hosts.wait(timeout_s)
            if codes != [0, 0] or not (out / "hosts.json").exists():
                return f"two-host launch exited {codes}: {hosts.output(0)[-1500:]}{hosts.output(1)[-1500:]}"
            return json.loads((out / "hosts.json").read_text())
        finally:
            hosts.close()


def _rank_main(out: Path, rounds: int, calls: int, seqs: list[int]) -> None:
    import torch.distributed as dist

    from benchmarks import strategies
    from benchmarks.auto import GRID_HEADS, STRATEGIES, auto_rank
    from benchmarks.common import Case, Protocol

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    points = []
    for seq in seqs:
        for heads, kv_heads in GRID_HEADS:
            names = [s for s in STRATEGIES if s != "ulysses" or heads % world == 0] + ["auto"]
            times, pick = {name: [] for name in names}, None
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    case = Case(name, seq, world, ulysses=HOST_RANKS, heads=heads, kv_heads=kv_heads, warmup_seq=seq)
                    result = auto_rank(rank, world, case, strategies.build, Protocol(calls, 600.0))
                    medians = [None] * world
                    dist.all_gather_object(medians, result.fwdbwd.median_s)
                    times[name].append(max(medians))  # the slowest rank's
                    if name == "auto" and pick is None:
                        pick = {"pick": result.pick, "pick_label": result.pick_label, "predicted_s": result.predicted_s}
            points.append({"seq": seq, "heads": heads, "kv_heads": kv_heads, "times_s": times, "choice": pick})
    if rank == 0:
        (out / "hosts.json").write_text(json.dumps(points))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), [int(s) for s in sys.argv[4:]])
