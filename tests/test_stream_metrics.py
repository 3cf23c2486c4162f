"""On NCCL (stream-ordered waits) ``comm_s`` / ``comm_wait_s`` / ``comm_hidden_share`` are GPU times from CUDA
events, read only at the timeline's take and only once complete; gloo keeps host times (issue 33, item 10).
Fake events stand in for CUDA (their timestamps scripted), fake ``Work`` for the backend."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ds_ring.comm import gpu_timing, stream_watch, wait
from ds_ring.comm import ring_comm as ring
from ds_ring.comm.job import process
from ds_ring.comm.ring_comm import RingComm
from ds_ring.hooks import register_hook
from ds_ring.monitor.timeline import StepTimeline


class FakeWork:
    def wait(self, timeout=None):
        return True

    def is_completed(self) -> bool:
        return True


class FakeEvents(gpu_timing.CudaEvents):
    """Timing events whose GPU timestamps (ms) come from ``times``; ``done`` says whether the GPU passed them."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.made, self.log = list(times), [], []

    def new_event(self):
        events = self

        class Event:
            done = False

            def record(self, stream):
                self.t = events.times.pop(0)
                events.log.append(("record", stream))

            def query(self):
                events.log.append("query")
                return self.done

            def elapsed_time(self, other):
                assert self.done and other.done, "elapsed_time on an incomplete event would sync the host"
                return other.t - self.t

            def synchronize(self):
                events.log.append("synchronize")

        event = Event()
        self.made.append(event)
        return event

    def current_stream(self, device):
        return "compute"


@pytest.fixture
def fake_ring(monkeypatch):
    monkeypatch.setattr(process(), "watch", stream_watch.StreamWatch(wait.failed, background=False))
    monkeypatch.setattr(ring, "group_rank", lambda group: 0)
    monkeypatch.setattr(ring, "group_members", lambda group: [0, 1])
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: SimpleNamespace(tensor=tensor))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [FakeWork() for _ in ops])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("host sync in a step"))
    timeline = StepTimeline()
    handle = register_hook(timeline, phases=("start", "end"))
    yield timeline
    handle.remove()


def _step(comm: RingComm, step: int) -> None:
    comm.send_recv(torch.ones(4))
    comm.commit(step)
    comm.wait()


def test_stream_ordered_metrics_come_from_cuda_events_at_take(fake_ring, monkeypatch):
    events = FakeEvents([0.0, 30.0, 40.0, 100.0, 100.0, 100.0])  # step 0: posted, waiting, arrived; step 1: 0 ms
    monkeypatch.setattr(gpu_timing, "EVENTS", events)
    monkeypatch.setattr(ring, "stream_ordered", lambda group, device: True)
    comm = RingComm(None, 1, 1, op="ring_kv")
    _step(comm, 0)
    assert len(events.made) == 3 and events.log == [("record", "compute")] * 3  # no query, no sync in the step
    totals = fake_ring.take()  # the GPU has not got there yet: deferred, not waited for
    assert totals.comm_s == 0 and "synchronize" not in events.log
    for event in events.made:
        event.done = True
    _step(comm, 1)  # its events stay incomplete
    totals = fake_ring.take()
    assert totals.comm_s == pytest.approx(0.040) and totals.comm_wait_s == pytest.approx(0.010)
    assert totals.hidden_share == pytest.approx(0.75)  # 10 ms of 40 exposed; host times would say 100 %
    for event in events.made[3:]:
        event.done = True
    assert fake_ring.take().comm_s == pytest.approx(0.0)  # step 1 counted now: 0 ms in flight
    assert "synchronize" not in events.log and fake_ring._deferred == []


def test_gloo_keeps_host_times(fake_ring, monkeypatch):
    events = FakeEvents([])
    monkeypatch.setattr(gpu_timing, "EVENTS", events)
    monkeypatch.setattr(ring, "stream_ordered", lambda group, device: False)
    _step(RingComm(None, 1, 1, op="ring_kv"), 0)
    totals = fake_ring.take()
    assert events.made == [] and totals.comm_s > 0 and not math.isnan(totals.hidden_share)
