"""Control traffic runs on a group that takes CPU tensors; data stays on the data groups.

On a GPU, ``ds_ring.initialize`` starts ``"cpu:gloo,cuda:nccl"`` (so every group takes both), and a Topology
built over a plain NCCL job makes a gloo twin of each of its groups for control traffic. Here (gloo only) the
twins are forced (``needs_control_twins``), so each control exchange can be told from data by its group:

- a training step through ``ds_ring.initialize`` — the call's agreement, the monitor's metrics and the
  numerics guard, the checkpoint agreement, ``shard_batch``'s batch agreement and ``gather_batches`` — goes to
  the twins; the ring's K/V and gradients, the loss all-reduce and ``gather_sequence`` go to the data groups;
- unit: the backend chosen when the accelerator is CUDA, and which backends take CPU tensors.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import ds_ring
from ds_ring.comm import collectives
from ds_ring.comm.ring_comm import RingComm
from tests.dist import CaseLog, assert_no_failures, run_distributed

SEQ, VOCAB = 32, 11
CONTROL_OPS = ("agree:", "monitor_", "gather_batches")


def _config(save_dir: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "csv_monitor": {"enabled": True, "output_path": save_dir, "job_name": "control"},
        "ring_attention": {
            "strategy": "ring", "causal": True, "timeout_s": 30,
            "monitoring": {"metrics": True, "numerics_guard": "skip_step"},
        },
    }  # fmt: skip


def _spy(monkeypatch_targets: list, seen: list[tuple[str, object]]) -> None:
    """Record ``(op, group)`` of every collective and ring step."""
    finish, commit = collectives._finish, RingComm.commit

    def finishing(call, *args, **kwargs):
        seen.append((call.op, call.group))
        return finish(call, *args, **kwargs)

    def committing(self, step):
        seen.append((self.op, self.group))
        return commit(self, step)

    monkeypatch_targets += [(collectives, "_finish", finish), (RingComm, "commit", commit)]
    collectives._finish, RingComm.commit = finishing, committing


def _rank(rank: int, world: int) -> list[str]:
    from ds_ring.integrations.hf import register_with_transformers, shard_batch
    from ds_ring.integrations.hf.batches import gather_batches
    from ds_ring.parallel import groups as groups_module
    from launch.model import TinyGPT

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    log = CaseLog()
    groups_module.needs_control_twins = lambda group=None: True
    restore: list = []
    seen: list[tuple[str, object]] = []
    with tempfile.TemporaryDirectory() as save_dir:
        torch.manual_seed(0)
        model = TinyGPT(VOCAB, 16, 4, 2, SEQ, kv_heads=2)
        engine, *_ = ds_ring.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_config(save_dir)
        )
        topology, monitor = engine.mpu, engine.ring_monitor
        data_groups = {topology.sequence_parallel_group, topology.ring_group, topology.ulysses_group, None}
        control = {topology.control_group(g) for g in (None, topology.sequence_parallel_group)}
        with log.case("the topology's control groups are gloo twins, not its data groups"):
            assert not control & data_groups
            assert all(dist.get_backend(g) == "gloo" for g in control)
        _spy(restore, seen)
        try:
            tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
            local = ds_ring.shard_sequence(tokens, topology)
            positions = ds_ring.shard_sequence(torch.arange(SEQ), topology, dim=0)
            monitor.begin_step(1)
            logits = engine(local, positions)
            loss = ds_ring.sequence_parallel_cross_entropy(logits, local, topology)
            if not monitor.skip_step():
                engine.backward(loss)
                engine.step()
            monitor.end_step(loss=loss.item())
            ds_ring.gather_sequence(logits.detach(), topology)
            ds_ring.save_checkpoint(engine, save_dir, "step1")
            session = register_with_transformers(config={"ring_attention": {"strategy": "ring"}}, topology=topology)
            try:
                shard_batch(session, {"input_ids": tokens})
                gather_batches({"input_ids": tokens}, topology)
            finally:
                session.close()
        finally:
            for owner, name, original in restore:
                setattr(owner, name, original)
        with log.case("every control exchange went to a control group, every data exchange to a data group"):
            ops = {op for op, _ in seen}
            assert {"agree:sequence_parallel_attention", "monitor_metrics", "monitor_guard", "agree:save_checkpoint",
                    "agree:shard_batch", "gather_batches", "ring_kv", "ring_dkv", "all_reduce"} <= ops, ops  # fmt: skip
            for op, group in seen:
                is_control = op.startswith(CONTROL_OPS)
                assert (group in control) == is_control, (op, group)
        engine.destroy()
    return log.failures


@pytest.mark.timeout(180)
def test_control_exchanges_take_the_control_groups():
    assert_no_failures(run_distributed(_rank, 2, timeout=150))


def test_backend_on_cuda_is_gloo_for_cpu_and_nccl_for_cuda(monkeypatch):
    from ds_ring.engine import initialize as engine

    class Accelerator:
        def __init__(self, backend: str) -> None:
            self.backend = backend

        def communication_backend_name(self) -> str:
            return self.backend

    monkeypatch.setattr(engine, "get_accelerator", lambda: Accelerator("nccl"))
    assert engine.process_group_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(engine, "get_accelerator", lambda: Accelerator("gloo"))
    assert engine.process_group_backend() == "gloo"


@pytest.mark.parametrize(
    ("backend", "takes"),
    [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl", False), ("mpi", True)],
)
def test_which_backends_take_cpu_tensors(monkeypatch, backend, takes):
    from ds_ring.comm import group_ranks as groups

    monkeypatch.setattr(groups.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(groups.dist, "get_backend", lambda group=None: backend)
    assert groups.takes_cpu(None) is takes
