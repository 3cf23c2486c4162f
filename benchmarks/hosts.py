"""``benchmarks.auto --two-hosts``: the multi-host tests' network namespaces (``benchmarks/SUITE.md``); under
torchrun each rank runs ``python -m benchmarks.hosts OUT ROUNDS TIMEOUT_S SEQ...``, rank 0 writes ``hosts.json``."""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

HOST_RANKS = 2
_CAUSE = re.compile(r"terminate called|what\(\)|Aborted|Fatal Python error|Error:")


def time_two_hosts(seqs: list[int], rounds: int, timeout_s: float) -> list[dict[str, Any]] | str:
    """Per (seq, heads) point the rounds' times of every strategy and ``auto`` and auto's pick, or why the two hosts
    could not run (no namespaces here, or the launch failed: the logs' tail)."""
    from tests.multihost.hosts import TwoHosts, unavailable

    if (reason := unavailable()) is not None:
        return f"two hosts on one machine: {reason}"
    with tempfile.TemporaryDirectory() as tmp:
        out, hosts = Path(tmp), TwoHosts()
        try:
            hosts.open()
            hosts.torchrun(["-m", "benchmarks.hosts", tmp, str(rounds), str(timeout_s), *map(str, seqs)], out,
                           nproc=HOST_RANKS)  # fmt: skip
            codes = hosts.wait(timeout_s)
            if codes != [0, 0] or not (out / "hosts.json").exists():
                logs = [hosts.output(0), hosts.output(1)]
                causes = [line for log in logs for line in log.splitlines() if _CAUSE.search(line)][:20]
                return f"two-host launch exited {codes}; {causes}: {logs[0][-1500:]}{logs[1][-1500:]}"
            return json.loads((out / "hosts.json").read_text())
        finally:
            hosts.close()


def _rank_main(out: Path, rounds: int, timeout_s: float, seqs: list[int]) -> None:
    import torch.distributed as dist

    from benchmarks.auto import GRID_HEADS, grid_cases, interleaved_rank

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    points = []
    for seq in seqs:
        for heads, kv_heads in GRID_HEADS:
            cases = grid_cases(seq, world, 1, heads, kv_heads, ulysses=HOST_RANKS)
            got = interleaved_rank(rank, world, cases, rounds, timeout_s)
            points.append({"seq": seq, "heads": heads, "kv_heads": kv_heads, **got})
    if rank == 0:
        (out / "hosts.json").write_text(json.dumps(points))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), [int(s) for s in sys.argv[4:]])
