"""The Topology across two network hosts (2 ranks each): ``hybrid`` with Ulysses 2 inside each host × ring 2
across hosts equals the float64 single-process reference (forward and backward), and a Ulysses group that
must span both hosts is warned about (or refused, strict) naming its ranks and hosts
(``tests/multihost/hybrid_rank.py`` on every rank)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multihost.hosts import TwoHosts

SCRIPT = str(Path(__file__).with_name("hybrid_rank.py"))


def test_hybrid_across_hosts_equals_the_reference_and_placement_is_checked(hosts: TwoHosts, tmp_path: Path) -> None:
    hosts.torchrun([SCRIPT, str(tmp_path)], tmp_path)
    codes = hosts.wait(120)
    output = hosts.output(0)[-3000:] + hosts.output(1)[-3000:]
    assert codes == [0, 0], output
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["host"] for r in results] in (["node0"] * 2 + ["node1"] * 2, ["node1"] * 2 + ["node0"] * 2), results
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:2])
