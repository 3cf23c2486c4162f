"""The collective-or-point-to-point choice reads a per-device backend string (``"cpu:gloo,cuda:nccl"``) by the
data's device type: GPU data of a job started the default way takes NCCL's collectives (issue 33, defect 2)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from ds_ring.comm import all_gather, all_to_all, backends, reduce_scatter
from ds_ring.hooks import register_hook
from tests.dist import CaseLog, assert_no_failures, run_distributed

KINDS = ("all_gather", "reduce_scatter", "all_to_all")

# Every backend string a user can start (init_process_group(backend=...), DeepSpeed's default, no backend),
# as dist.get_backend names it, with the backend each device type's data is moved by.
STARTED = {
    "nccl": {"cuda": "nccl"},
    "NCCL": {"cuda": "nccl"},
    "gloo": {"cpu": "gloo"},
    "mpi": {"cpu": "mpi", "cuda": "mpi"},
    "cpu:gloo,cuda:nccl": {"cpu": "gloo", "cuda": "nccl"},
    "cuda:nccl,cpu:gloo": {"cpu": "gloo", "cuda": "nccl"},
    "cuda:nccl": {"cuda": "nccl"},
    "cpu:gloo": {"cpu": "gloo"},
    "cpu:gloo,cuda:ucc": {"cpu": "gloo", "cuda": "ucc"},
}


@pytest.mark.parametrize("started", sorted(STARTED))
def test_each_started_backend_picks_the_collective_of_the_data_device(started: str) -> None:
    for device_type, backend in STARTED[started].items():
        assert backends.device_backend(started, device_type) == backend
        for kind in KINDS:
            expected = backends.runs_collective(backend, kind, torch.bfloat16)
            assert backends.runs_collective(started, kind, torch.bfloat16, device_type) == expected, (kind, device_type)
    if ":" in started and "cuda:nccl" in started:  # the defect: every GPU exchange went point-to-point
        assert all(backends.runs_collective(started, kind, torch.bfloat16, "cuda") for kind in KINDS)
    assert not backends.runs_collective("cpu:gloo", "all_gather", torch.float32, "cuda")  # no backend: p2p


def _cases(rank: int, world_size: int) -> list[str]:
    log, events = CaseLog(), []
    register_hook(events.append)
    span = list(range(world_size))
    # dist.get_backend as a job started without a backend (or by DeepSpeed) reports it; the CPU tensors here
    # are moved by its gloo part, which runs all three as collectives.
    with mock.patch.object(dist, "get_backend", return_value="cuda:nccl,cpu:gloo"):
        with log.case("all_gather"):
            events.clear()
            parts = all_gather(torch.full((3,), float(rank)), span)
            assert_close(torch.stack(parts), torch.arange(float(world_size)).view(-1, 1).expand(-1, 3))
            assert [e.extra["path"] for e in events if e.kind == "all_gather"] == ["collective"]
        with log.case("reduce_scatter"):
            events.clear()
            got = reduce_scatter([torch.full((2,), float(rank + j)) for j in span], span)
            assert_close(got, torch.full((2,), float(sum(span) + world_size * rank)))
            assert [e.extra["path"] for e in events if e.kind == "reduce_scatter"] == ["collective"]
        with log.case("all_to_all"):
            events.clear()
            got = all_to_all((torch.arange(world_size) + 10 * rank).float().view(-1, 1))
            assert_close(got, (10 * torch.arange(world_size) + rank).float().view(-1, 1))
            assert [e.extra["path"] for e in events if e.kind == "all_to_all"] == ["collective"]
    return log.failures


def test_per_device_backend_runs_collectives_on_two_ranks() -> None:
    assert_no_failures(run_distributed(_cases, 2, timeout=60))
