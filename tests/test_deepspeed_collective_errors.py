"""A failure inside one of DeepSpeed's own collectives is renamed: CommTimeoutError / CommError naming the rank,
the collective, the training step and the group's ranks (by host when the job spans hosts).

DeepSpeed's communication backend is replaced by a stand-in whose collectives fail like gloo's do; the
two-host link-down test (``tests/multihost``) shows the same on DeepSpeed's real gradient all-reduce.
"""

import sys
import types

import pytest
import torch

from ds_ring.comm.errors import CommError, CommTimeoutError
from ds_ring.hooks import labelled
from ds_ring.monitor.deepspeed_collectives import NamedCollectives, running_collective
from tests.dist import CaseLog, assert_no_failures, run_distributed


class _Backend:
    """Fails like gloo: a timeout, or a closed connection; records the collective running meanwhile."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.seen.append(running_collective())
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")

    def broadcast(self, tensor, src, group=None, async_op=False):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.77.0.2]:5140")

    def barrier(self, group=None, async_op=False, device_ids=None):
        return "done"


def _renamed(rank: int, world_size: int) -> list[str]:
    backend = _Backend()
    sys.modules["deepspeed.comm.comm"] = types.SimpleNamespace(cdb=backend)
    log = CaseLog()
    named = NamedCollectives(timeout_s=10)
    with log.case("a timeout in all_reduce"), labelled(train_step=7):
        with pytest.raises(CommTimeoutError) as err:
            backend.all_reduce(torch.zeros(1), None, None, False)
        assert (err.value.rank, err.value.peer, err.value.step) == (rank, -1, 7)
        assert err.value.op == "deepspeed.comm.all_reduce" and backend.seen == ["deepspeed.comm.all_reduce"]
        assert f"rank {rank} timed out after 10.0 s in DeepSpeed's all_reduce over ranks 0, 1" in str(err.value)
        assert running_collective() is None
    with log.case("a closed connection in broadcast"), pytest.raises(CommError, match="Connection closed by peer"):
        backend.broadcast(torch.zeros(1), src=0)
    with log.case("success passes through; close restores"):
        assert backend.barrier() == "done"
        named.close()
        assert "all_reduce" not in vars(backend)
        with pytest.raises(RuntimeError, match="Timed out waiting") as err:
            backend.all_reduce(torch.zeros(1))
        assert not isinstance(err.value, CommError)
    return log.failures


def test_deepspeed_collective_failures_are_named():
    assert_no_failures(run_distributed(_renamed, 2, timeout=60))
