"""On NCCL a wait is stream-ordered: ``Work.wait()`` without a timeout (the current CUDA stream waits, the host
goes on), the deadline kept by a watchdog that names the rank, peer and step (issue 33, defect 3); gloo and
CPU data keep the bounded host wait. Pinned with fake Work objects and the watch's own clock."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from ds_ring.comm import stream_watch, wait
from ds_ring.comm.errors import CommTimeoutError
from ds_ring.comm.job import process
from ds_ring.comm.wait import Pending, stream_ordered, wait_all


class FakeWork:
    """A Work that completes when told; records how it was waited on."""

    def __init__(self) -> None:
        self.done, self.waits = False, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True

    def is_completed(self) -> bool:
        return self.done


@pytest.fixture
def watch(monkeypatch):
    """A watch without its polling thread, in place of the process's."""
    fresh = stream_watch.StreamWatch(wait.failed, background=False)
    monkeypatch.setattr(process(), "watch", fresh)
    return fresh


def test_stream_ordered_wait_does_not_block_the_host(watch):
    works = [FakeWork(), FakeWork()]  # never complete: a host wait would block until the deadline
    pending = [Pending(works[0], 3, "recv from rank 3"), Pending(works[1], 1, "send to rank 1")]
    blocked = wait_all(pending, timeout_s=30, rank=2, op="ring_kv", step=4, in_stream=True)
    assert blocked == 0.0
    assert [w.waits for w in works] == [[None], [None]]  # Work.wait() without a timeout: stream-ordered
    assert watch.watched == 2


def test_watchdog_names_rank_peer_and_step_past_the_deadline():
    announced = []
    watch = stream_watch.StreamWatch(announced.append, background=False)
    late, done = FakeWork(), FakeWork()
    watch.watch([Pending(late, 3, "recv from rank 3"), Pending(done, 1, "send to rank 1")], timeout_s=10,
                rank=2, op="ring_kv", step=5, now=100.0)  # fmt: skip
    assert watch.poll(now=105.0) == [] and watch.watched == 2
    done.done = True
    (error,) = watch.poll(now=110.5)
    assert isinstance(error, CommTimeoutError) and announced == [error]
    assert (error.rank, error.peer, error.step, error.op) == (2, 3, 5, "ring_kv")
    assert "recv from rank 3" in str(error) and watch.watched == 0
    with pytest.raises(CommTimeoutError, match="recv from rank 3"):
        watch.raise_expired()
    watch.raise_expired()  # raised once


def test_next_wait_raises_the_expired_error_on_the_training_thread(watch):
    work = FakeWork()
    wait_all([Pending(work, 0, "all_to_all among ranks [0, 1]")], timeout_s=5, rank=1, op="ulysses_qkv", step=0,
             in_stream=True)  # fmt: skip
    watch.poll(now=float("inf"))
    with pytest.raises(CommTimeoutError) as raised:
        wait_all([Pending(FakeWork(), 0, "x")], timeout_s=5, rank=1, op="ulysses_out", step=1, in_stream=True)
    assert (raised.value.rank, raised.value.step, raised.value.op) == (1, 0, "ulysses_qkv")


def test_gloo_and_cpu_data_keep_the_bounded_host_wait(watch):
    work = FakeWork()
    wait_all([Pending(work, 1, "recv from rank 1")], timeout_s=7, rank=0, op="ring_kv", step=0)
    (timeout,) = work.waits
    assert timeout is not None and 0 < timeout.total_seconds() <= 7
    assert watch.watched == 0


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [("cpu:gloo,cuda:nccl", "cuda", True), ("nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cpu", False),
     ("gloo", "cuda", False), ("gloo", "cpu", False), ("mpi", "cuda", False)],
)  # fmt: skip
def test_stream_ordered_for_cuda_data_on_nccl(backend, device, expected):
    with mock.patch.object(wait.dist, "get_backend", return_value=backend):
        assert stream_ordered(None, torch.device(device)) is expected
