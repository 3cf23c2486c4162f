"""Ulysses groups inside one host: the placement check on faked hosts, and hosts in communication errors.

The two-host runs (``tests/multihost``) check the same on real network hosts; here the hosts are faked:
pure ``check_placement`` cases, and 4 ranks whose ``node_name`` says they run 2 per host building
Topologies (the hosts are exchanged over the control group when the Topology is built).
"""

import pickle
import warnings

import pytest

from ds_ring.comm import hosts as hosts_module
from ds_ring.comm.errors import CommError, CommTimeoutError
from ds_ring.comm.hosts import name_hosts
from ds_ring.comm.job import job
from ds_ring.parallel.layout import RankLayout
from ds_ring.parallel.topology import Topology
from ds_ring.parallel.ulysses_hosts import PlacementWarning, check_placement, ulysses_across_hosts
from tests.dist import CaseLog, assert_no_failures, run_distributed

TWO_BY_TWO = ("node0", "node0", "node1", "node1")


def test_ulysses_inside_each_host_passes_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_placement(RankLayout(1, 2, 2), TWO_BY_TWO, "error") is None  # ulysses 2 × ring 2
        assert check_placement(RankLayout(2, 2, 1), TWO_BY_TWO, "error") is None
        assert check_placement(RankLayout(1, 1, 4), TWO_BY_TWO, "error") is None  # a ring crosses hosts: fine


def test_ulysses_across_hosts_warns_or_raises_naming_ranks_and_hosts():
    layout = RankLayout(1, 4, 1)
    assert ulysses_across_hosts(layout, TWO_BY_TWO) == [(0, 1, 2, 3)]
    with pytest.warns(PlacementWarning, match=r"ranks \[0, 1, 2, 3\] on node0 \(0, 1\), node1 \(2, 3\)") as seen:
        check_placement(layout, TWO_BY_TWO, "warn")
    assert "ulysses_degree 2 × ring_degree 2" in str(seen[0].message)
    with pytest.raises(ValueError, match=r"ulysses_degree 4 span several hosts.*ulysses_across_hosts"):
        check_placement(layout, TWO_BY_TWO, "error")
    assert check_placement(layout, TWO_BY_TWO, "allow") is None
    with pytest.raises(ValueError, match=r"ulysses_across_hosts must be one of \['warn', 'error', 'allow'\]"):
        check_placement(layout, TWO_BY_TWO, "strict")
    # 3 ranks per host: ulysses 2 puts ranks 2 and 3 on different hosts
    assert ulysses_across_hosts(RankLayout(1, 2, 3), ("a", "a", "a", "b", "b", "b")) == [(2, 3)]


def test_errors_name_hosts_only_across_hosts(monkeypatch):
    error = CommTimeoutError(1, 2, 3, "ring_kv", "waiting for recv from rank 2", 10.0)
    assert error.hosts is None and " on " not in str(error)
    assert name_hosts(error).hosts is None, "one host: nothing named"
    monkeypatch.setattr(job(), "hosts", TWO_BY_TWO)
    assert CommTimeoutError(1, 2, 3, "ring_kv", "waiting", 10.0).hosts is None, "an error reads no host table"
    error = name_hosts(CommTimeoutError(1, 2, 3, "ring_kv", "waiting for recv from rank 2", 10.0))
    assert str(error).startswith("ds_ring: rank 1 on node0 timed out after 10.0 s waiting for recv from rank 2 ")
    assert "(op=ring_kv, step=3; rank 2 is on node1)" in str(error)
    again = pickle.loads(pickle.dumps(name_hosts(CommError(3, 0, 1, "ring_kv", "waiting", "reset"))))
    assert again.hosts == ("node1", "node0") and str(again).startswith("ds_ring: rank 3 on node1 failed")


def _topologies_on_fake_hosts(rank: int, world_size: int) -> list[str]:
    hosts_module.node_name = lambda: f"node{rank // 2}"
    log = CaseLog()
    with log.case("ulysses 2 x ring 2: inside each host"), warnings.catch_warnings():
        warnings.simplefilter("error")
        first = Topology(ulysses=2, ring=2, timeout_s=20)
        assert first.hosts == job().hosts == TWO_BY_TWO
        message = str(name_hosts(CommError(rank, 3 - rank, 0, "op", "waiting", "reset")))
        assert (
            f"rank {rank} on node{rank // 2}" in message and f"rank {3 - rank} is on node{(3 - rank) // 2}" in message
        )
    with log.case("a second topology keeps its own facts and overwrites none of the first's"):
        hosts_module.node_name = lambda: f"elsewhere{rank}"
        second = Topology(ring=4, timeout_s=20)
        assert second.hosts == ("elsewhere0", "elsewhere1", "elsewhere2", "elsewhere3")
        assert first.hosts == job().hosts == TWO_BY_TWO
        assert len(first.places) == len(second.places) == 4
        hosts_module.node_name = lambda: f"node{rank // 2}"
    with log.case("ulysses 4: warns"), pytest.warns(PlacementWarning, match=r"node0 \(0, 1\), node1 \(2, 3\)"):
        Topology(ulysses=4, timeout_s=20)
    with log.case("ulysses 4, strict: raises on every rank"), pytest.raises(ValueError, match="span several hosts"):
        Topology(ulysses=4, timeout_s=20, ulysses_across_hosts="error")
    return log.failures


def test_topology_checks_placement_on_every_rank():
    assert_no_failures(run_distributed(_topologies_on_fake_hosts, 4, timeout=60))
