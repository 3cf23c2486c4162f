"""Every process group a Topology makes (and every gloo twin) has twice ``timeout_s`` as its timeout, not the
backend's default (1,800 s gloo, 600 s NCCL): ds_ring's bounded waits name the fault before the backend's
own bound ends the job (issue 33, defect 4). The group of every rank is the world only when the world's own
timeout is as long; else a group of its own, with a warning naming both timeouts (issue 42)."""

from __future__ import annotations

import logging
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import ds_ring.parallel.groups as groups_module
from ds_ring.parallel.layout import ROLES
from ds_ring.parallel.topology import Topology
from tests.dist import CaseLog, assert_no_failures, run_distributed

WORLD_TIMEOUT_S = 120.0  # run_distributed's: the world group's timeout


def _timeout_s(group: ProcessGroup) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _warnings_of(build) -> list:
    """The ``ds_ring.parallel`` warnings logged while ``build()`` runs, then what it returned."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("ds_ring.parallel")
    logger.addHandler(handler)
    try:
        built = build()
    finally:
        logger.removeHandler(handler)
    return [record.getMessage() for record in records] + [built]


def _cases(rank: int, world_size: int) -> list[str]:
    log = CaseLog()
    for degrees, timeout_s in (((2, 1, 2), 20.0), ((1, 2, 2), 25.0), ((1, 4, 1), 1200.0 / 24)):
        with log.case(f"groups of Topology{degrees} timeout_s={timeout_s}"):
            topology = Topology(*degrees, timeout_s=timeout_s)
            for role in ROLES:
                group = getattr(topology, f"{role}_group")
                assert _timeout_s(group) >= 2 * timeout_s, (role, _timeout_s(group))
                if group is not dist.group.WORLD:
                    assert _timeout_s(group) == 2 * timeout_s, (role, _timeout_s(group))
    world_s = _timeout_s(dist.group.WORLD)  # the spawn helper's hard cap: a multiple of WORLD_TIMEOUT_S
    with log.case("the world reused for every rank's groups when its timeout is at least twice timeout_s"):
        records = _warnings_of(lambda: Topology(1, 4, 1, timeout_s=world_s / 2))
        topology = records.pop()
        assert topology.sequence_data_parallel_group is dist.group.WORLD and records == [], records
    with log.case("a world with a shorter timeout: every rank's groups are a group of their own, with a warning"):
        records = _warnings_of(lambda: Topology(1, 4, 1, timeout_s=world_s))
        topology = records.pop()
        for role in ("sequence_data_parallel", "sequence_parallel", "ulysses"):
            group = getattr(topology, f"{role}_group")
            assert group is not dist.group.WORLD and _timeout_s(group) == 2 * world_s, (role, _timeout_s(group))
        assert topology.control_group(None) is topology.sequence_data_parallel_group
        expected = (
            f"the world process group's timeout ({world_s:g} s) is shorter than twice timeout_s (2 × {world_s:g} s)"
        )
        assert [expected in message for message in records] == ([True] if rank == 0 else []), records
    with log.case("gloo twins for control traffic (a backend that takes no CPU tensors)"):
        with mock.patch.object(groups_module, "needs_control_twins", return_value=True):
            topology = Topology(2, 1, 2, timeout_s=30.0)
        for role in ROLES:
            twin = topology.control_group(getattr(topology, f"{role}_group"))
            assert _timeout_s(twin) == 60.0, (role, _timeout_s(twin))
    return log.failures


def test_every_topology_group_has_twice_timeout_s() -> None:
    assert_no_failures(run_distributed(_cases, 4, timeout=WORLD_TIMEOUT_S))
