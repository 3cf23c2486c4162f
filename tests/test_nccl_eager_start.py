"""NCCL communicators start eagerly, never from a first batched point-to-point: ``init_distributed`` binds the
world to ``cuda:<LOCAL_RANK>`` (``device_id``), a Topology makes its NCCL groups with ``device_id`` and warms
each up with one all-reduce over all its members, in creation order (issue 33, defect 5). Run on gloo ranks
with the backend string, CUDA's presence and the group calls spied on."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

import ds_ring.parallel.groups as groups_module
from ds_ring.engine import initialize as engine
from ds_ring.parallel.topology import Topology
from tests.dist import CaseLog, assert_no_failures, run_distributed


def _cases(rank: int, world_size: int) -> list[str]:
    log = CaseLog()
    made, warmed = [], []
    real_new_group, real_zeros = dist.new_group, torch.zeros

    def new_group(ranks, **kwargs):
        made.append((tuple(ranks), kwargs.get("backend"), kwargs.get("device_id")))
        kwargs.pop("device_id", None)  # gloo ranks here: the spy records what NCCL would get
        return real_new_group(ranks, **kwargs)

    def zeros(*size, device=None, **kwargs):  # the warm-up's CUDA tensor, as a meta one
        return real_zeros(*size, device="meta" if str(device).startswith("cuda") else device, **kwargs)

    def all_reduce(tensor, *, group, op, timeout_s):
        warmed.append((tuple(dist.get_process_group_ranks(group)), op, timeout_s))
        return tensor

    with (
        mock.patch.object(dist, "get_backend", return_value="cpu:gloo,cuda:nccl"),
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "current_device", return_value=0),
        mock.patch.object(dist, "new_group", new_group),
        mock.patch.object(groups_module.torch, "zeros", zeros),
        mock.patch.object(groups_module, "all_reduce", all_reduce),
    ):
        topology = Topology(1, 2, 2, timeout_s=15.0)
    with log.case("every NCCL group is made with device_id (eager connect)"):
        assert made and all(device == torch.device("cuda", 0) for _, backend, device in made if backend is None)
    with log.case("each of this rank's groups of more than one rank is warmed up once, in creation order"):
        mine = [ranks for ranks, backend, _ in made if backend is None and rank in ranks and len(ranks) > 1]
        assert [ranks for ranks, _, _ in warmed] == mine, (warmed, mine)
        assert {tuple(dist.get_process_group_ranks(topology.ulysses_group)),
                tuple(dist.get_process_group_ranks(topology.ring_group))} <= set(mine)  # fmt: skip
        assert all(op == "Topology warm-up" and timeout_s == 15.0 for _, op, timeout_s in warmed)
    made.clear(), warmed.clear()
    with log.case("gloo data (no NCCL): no device_id, no warm-up"), mock.patch.object(dist, "new_group", new_group):
        with mock.patch.object(groups_module, "all_reduce", all_reduce):
            Topology(1, 2, 2, timeout_s=15.0)
        assert made and all(device is None for _, _, device in made) and not warmed
    return log.failures


def test_topology_groups_connect_eagerly_and_warm_up() -> None:
    assert_no_failures(run_distributed(_cases, 4, timeout=90))


def test_init_distributed_binds_the_world_to_the_local_gpu(monkeypatch) -> None:
    started: dict = {}
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(engine, "discover_launch_env", lambda: None)
    monkeypatch.setattr(engine, "_restart_safe_store", lambda timeout: None)
    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine.torch.cuda, "set_device", lambda device: started.update(current=device))
    monkeypatch.setattr(engine.dist, "init_process_group", lambda backend, **kwargs: started.update(kwargs))
    monkeypatch.setattr(engine.deepspeed, "init_distributed", lambda **kwargs: None)
    for backend, device in (("cpu:gloo,cuda:nccl", torch.device("cuda", 3)), ("nccl", torch.device("cuda", 3)),
                            ("gloo", None)):  # fmt: skip
        started.clear()
        monkeypatch.setattr(engine, "process_group_backend", lambda backend=backend: backend)
        engine.init_distributed(30)
        assert started.get("device_id") == device and started.get("current") == device, (backend, started)
        assert started["timeout"] == timedelta(seconds=60)
