"""One rank of the two-host topology run (started by torchrun on each host): ``hybrid`` attention with
Ulysses 2 inside each host × ring 2 across hosts against the float64 single-process reference (forward,
LSE, q/k/v gradients), then the placement check on Ulysses groups that must cross hosts.

Writes its failures (a JSON list of strings) to ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from ds_ring.calls import sequence_parallel_attention  # noqa: E402
from ds_ring.comm.hosts import host_of  # noqa: E402
from ds_ring.parallel.topology import Topology  # noqa: E402
from ds_ring.parallel.ulysses_hosts import PlacementWarning  # noqa: E402
from tests.dist import CaseLog  # noqa: E402
from tests.sharded_cases import run_cases  # noqa: E402

L = 8  # rows per rank


def _cases(seq: int) -> list[dict]:
    common = dict(strategy="hybrid", layout="contiguous", batch=2, seq=seq, head_dim=4, dtype="float64")
    return [
        dict(common, communication="ring", segments=None, rates=None, causal=True, heads=4, kv_heads=2, head_offset=0,
             seed=0),
        dict(common, communication="ring", segments=[L // 2, 2 * L, seq], rates=[1, 2, 4], causal=False, heads=8,
             kv_heads=2, head_offset=1, seed=1),
        dict(common, communication="allgather", segments=[L, seq], rates=[3, 2], causal=True, heads=4, kv_heads=4,
             head_offset=0, seed=2),
    ]  # fmt: skip


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = CaseLog()
    with log.case("ulysses 2 inside each host x ring 2 across hosts"), warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        topology = Topology(ulysses=2, ring=2, timeout_s=30)
        hosts = [host_of(r) for r in range(world)]
        assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # torchrun: consecutive ranks per host
        for case in _cases(world * L):
            attention = functools.partial(sequence_parallel_attention, topology=topology, strategy="hybrid",
                                          communication=case["communication"])  # fmt: skip
            log.failures += run_cases([case], attention, group=topology.sequence_parallel_group)
    with (
        log.case("ulysses 4 spans both hosts: a warning naming ranks and hosts"),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        Topology(ulysses=4, timeout_s=30)
        messages = [str(w.message) for w in seen if issubclass(w.category, PlacementWarning)]
        assert len(messages) == 1 and f"{hosts[0]} (0, 1), {hosts[2]} (2, 3)" in messages[0], messages
    with log.case("ulysses 4, strict placement: ValueError on every rank"):
        try:
            Topology(ulysses=4, timeout_s=30, ulysses_across_hosts="error")
            raise AssertionError("no ValueError")
        except ValueError as err:
            assert "span several hosts" in str(err), err
    (out / f"rank{rank}.json").write_text(json.dumps({"host": hosts[rank], "failures": log.failures}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
