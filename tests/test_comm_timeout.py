"""A silent or departed peer makes every wait fail with an error naming rank, peer, step and op."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_ring.comm import CommError, CommTimeoutError, RingComm, all_gather
from ds_ring.comm.wait import Pending, process_group_timeout_s, wait_all
from tests.dist import run_distributed

SILENT = 1  # the rank that takes no part in any transfer
TIMEOUT_S = 1.0


def _failure(fn) -> dict:
    """Run ``fn`` and describe the CommError it raises (and how long it took to raise it)."""
    started = time.monotonic()
    try:
        fn()
    except CommError as exc:
        return {
            "type": type(exc).__name__,
            "rank": exc.rank,
            "peer": exc.peer,
            "step": exc.step,
            "op": exc.op,
            "timeout_s": getattr(exc, "timeout_s", None),
            "message": str(exc),
            "seconds": time.monotonic() - started,
        }
    return {"type": None, "seconds": time.monotonic() - started}


def _ring_step(group: dist.ProcessGroup, rank: int, world_size: int, step: int, **kwargs: object) -> None:
    comm = RingComm(group, (rank + 1) % world_size, (rank - 1) % world_size, op="ring_kv", **kwargs)
    comm.send_recv(torch.ones(8))
    comm.commit(step)
    comm.wait()


def _silent_peer(rank: int, world_size: int, flag_dir: str) -> dict[str, dict]:
    # A timed-out pair is closed by gloo, so every case gets fresh groups; all ranks create them.
    ranks = list(range(world_size))
    ring_group, gather_group, left_group = (dist.new_group(ranks) for _ in range(3))
    # The collective path leaves its op running in the background: a short group timeout ends it.
    collective_group = dist.new_group(ranks, timeout=timedelta(seconds=3))
    if rank == SILENT:
        dist.destroy_process_group(left_group)  # this peer leaves: the others see it fail fast
        del left_group  # the last reference: gloo closes the group's connections
        others = [r for r in ranks if r != SILENT]
        while not all(Path(flag_dir, str(r)).exists() for r in others):
            time.sleep(0.05)
        return {}
    results = {
        "ring": _failure(lambda: _ring_step(ring_group, rank, world_size, 3, timeout_s=TIMEOUT_S)),
        "p2p_gather": _failure(
            lambda: all_gather(
                torch.ones(4), ranks, group=gather_group, op="allgather_kv", step=7, force_p2p=True, timeout_s=TIMEOUT_S
            )
        ),
        "collective_gather": _failure(
            lambda: all_gather(torch.ones(4), ranks, group=collective_group, op="gather_seq", timeout_s=TIMEOUT_S)
        ),
        "left": _failure(lambda: _ring_step(left_group, rank, world_size, 5, timeout_s=20)),
    }
    Path(flag_dir, str(rank)).touch()
    return results


def _fields(result: dict) -> tuple:
    return tuple(result.get(key) for key in ("type", "rank", "peer", "step", "op", "timeout_s"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_silent_peer_times_out_with_a_named_error(world_size: int, tmp_path: Path) -> None:
    results = run_distributed(_silent_peer, world_size, timeout=45, flag_dir=str(tmp_path))
    for rank, result in enumerate(results):
        if rank == SILENT:
            continue
        # Rank 0 sends to the silent rank 1 (in a ring of two it also receives from it first);
        # rank 2 receives from rank 1.
        what = "recv from rank 1" if rank == 2 or world_size == 2 else "send to rank 1"
        ring = result["ring"]
        assert _fields(ring) == ("CommTimeoutError", rank, 1, 3, "ring_kv", 1.0)
        assert ring["message"] == (
            f"ds_ring: rank {rank} timed out after 1.0 s waiting for {what} (op=ring_kv, step=3); "
            "the peer is slow, hung or dead"
        )
        assert TIMEOUT_S - 0.05 <= ring["seconds"] <= TIMEOUT_S + 10

        gather = result["p2p_gather"]
        assert _fields(gather) == ("CommTimeoutError", rank, 1, 7, "allgather_kv", 1.0)
        assert "timed out after 1.0 s waiting for recv from rank 1 (op=allgather_kv, step=7)" in gather["message"]
        assert TIMEOUT_S - 0.05 <= gather["seconds"] <= TIMEOUT_S + 10

        collective = result["collective_gather"]
        assert _fields(collective) == ("CommTimeoutError", rank, -1, -1, "gather_seq", 1.0)
        assert f"waiting for all_gather among ranks {list(range(world_size))}" in collective["message"]
        assert TIMEOUT_S - 0.05 <= collective["seconds"] <= TIMEOUT_S + 10

        # Posting to a peer that left fails at once; gloo does not say which op of the batch failed.
        left = result["left"]
        assert _fields(left) == ("CommError", rank, 1 if world_size == 2 else -1, 5, "ring_kv", None)
        send_to, recv_from = (rank + 1) % world_size, (rank - 1) % world_size
        assert left["message"].startswith(
            f"ds_ring: rank {rank} failed posting send to rank {send_to} / recv from rank {recv_from} "
            "(op=ring_kv, step=5): "
        )
        assert left["message"].endswith("the peer probably crashed or left the group")
        assert left["seconds"] < 10


class _FailingWork:
    """A ``Work`` whose ``wait`` raises what a backend raised."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: timedelta) -> bool:
        raise self.error


NCCL_TIMEOUT = (
    "[PG ID 1 PG GUID 1 Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
    "OpType=COALESCED, NumelIn=1024, NumelOut=1024, Timeout(ms)=1000) ran for 1003 milliseconds before timing out."
)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (dist.DistBackendError(NCCL_TIMEOUT), CommTimeoutError),  # NCCL: Work.wait(timeout) past its deadline
        (
            RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 1000ms"),
            CommTimeoutError,
        ),
        (dist.DistBackendError("NCCL error: remote process exited or there was a network error"), CommError),
        (RuntimeError("Connection closed by peer [127.0.0.1]:1234"), CommError),
    ],
    ids=["nccl timing out", "gloo timed out", "nccl remote error", "gloo closed"],
)
def test_a_backend_timeout_is_named_a_timeout_before_the_deadline(error, kind):
    """NCCL's "... before timing out" counts as a timeout like gloo's "timed out"; other failures do not."""
    with pytest.raises(CommError) as raised:
        wait_all([Pending(_FailingWork(error), 1, "recv from rank 1")], timeout_s=60, rank=0, op="ring_kv", step=2)
    assert type(raised.value) is kind, raised.value
    assert (raised.value.rank, raised.value.peer, raised.value.step, raised.value.op) == (0, 1, 2, "ring_kv")


def test_nccl_process_group_timeout_leaves_the_watchdog_as_backstop(monkeypatch):
    """The group's timeout is twice ds_ring's (NCCL's watchdog would end the process first otherwise).
    ``init_distributed`` starts the group with it."""
    from ds_ring.engine import initialize as engine

    assert process_group_timeout_s(120) == 240
    assert process_group_timeout_s(300) == 600
    started = {}
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(engine, "discover_launch_env", lambda: None)
    monkeypatch.setattr(engine, "process_group_backend", lambda: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(engine, "_restart_safe_store", lambda timeout: None)
    monkeypatch.setattr(engine.dist, "init_process_group", lambda backend, timeout, **kw: started.update(pg=timeout))
    monkeypatch.setattr(engine.deepspeed, "init_distributed", lambda **kwargs: started.update(ds=kwargs["timeout"]))
    engine.init_distributed(90)
    assert started == {"pg": timedelta(seconds=180), "ds": timedelta(seconds=180)}
