"""The rank runner: results come back in rank order, failures bring their tracebacks, hangs are killed."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_ring.testing import CAP_FACTOR, rank_results, spawn_ranks
from tests.dist import run_distributed


def _report(rank: int, world_size: int, tag: str) -> dict:
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "tag": tag,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "sum": total.item(),
    }


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _hang_on_rank_one(rank: int, world_size: int, pid_dir: str) -> int:
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    return rank


def _deadlock(rank: int, world_size: int) -> int:
    """Both ranks wait to receive from the other: blocked in gloo, whose threads still wake now and then."""
    buffer = torch.zeros(1)
    dist.recv(buffer, src=1 - rank)
    return rank


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


@pytest.mark.timeout(90)
def test_results_come_back_in_rank_order() -> None:
    results = run_distributed(_report, 3, timeout=60, threads_per_rank=2, tag="hello")
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, result in enumerate(results):
        assert result == {
            "rank": rank,
            "world_size": 3,
            "tag": "hello",
            "dist_rank": rank,
            "dist_world": 3,
            "backend": "gloo",
            "threads": 2,
            "sum": 6.0,
        }


@pytest.mark.timeout(90)
def test_a_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(RuntimeError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 failed:\nTraceback (most recent call last):")
    assert "in _raise_on_rank_one" in message
    assert "ValueError: boom from rank 1" in message
    assert "rank 0" not in message


@pytest.mark.timeout(90)
def test_a_rank_that_dies_is_reported() -> None:
    with pytest.raises(RuntimeError, match="rank 1 failed:\nprocess exited with code 3 before returning a result"):
        run_distributed(_exit_on_rank_one, 2, timeout=60)


@pytest.mark.timeout(60)
def test_a_hanging_rank_is_killed_and_named(tmp_path: Path) -> None:
    run_distributed(_report, 2, tag="warm-up")  # the first call of a session starts the fork server
    timeout = 4.0
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_distributed(_hang_on_rank_one, 2, timeout=timeout, pid_dir=str(tmp_path))
    elapsed = time.monotonic() - started
    assert str(info.value) == "rank 1 hung: no result and no progress for 4.0 s"
    # idle for the timeout, and found so: before the hard cap (a loaded machine may take a while to spawn the ranks)
    assert timeout <= elapsed < CAP_FACTOR * timeout
    assert multiprocessing.active_children() == []
    pids = [int(p.read_text()) for p in sorted(tmp_path.iterdir())]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(120)
def test_ranks_deadlocked_in_a_collective_are_found_hung() -> None:
    run_distributed(_report, 2, tag="warm-up")
    timeout = 6.0
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="hung: no result and no progress"):
        run_distributed(_deadlock, 2, timeout=timeout)
    assert time.monotonic() - started < CAP_FACTOR * timeout  # found idle, before the hard cap
    assert multiprocessing.active_children() == []


def _no_group(rank: int, world_size: int, scale: int) -> int:
    assert not dist.is_initialized()
    return rank * scale


@pytest.mark.timeout(60)
def test_ranks_without_a_process_group_report_their_resources() -> None:
    outcomes = spawn_ranks(_no_group, 2, timeout_s=30, args=(10,), process_group=False)
    assert [o.rank for o in outcomes] == [0, 1]
    assert rank_results(outcomes) == [0, 10]
    for outcome in outcomes:
        assert outcome.ok and not outcome.hung
        assert outcome.cpu_s is not None and outcome.cpu_s >= 0
        assert outcome.peak_rss_mib is not None and outcome.peak_rss_mib > 0


def _stuck_in_teardown(rank: int, world_size: int, pid_dir: str) -> int:
    """Returns, then blocks in destroy_process_group on rank 1 (as torch 2.6's gloo did now and then)."""
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    if rank == 1:
        dist.destroy_process_group = lambda group=None: time.sleep(3600)
    return rank


@pytest.mark.timeout(120)
def test_a_rank_stuck_in_teardown_after_its_result_is_killed(tmp_path: Path) -> None:
    timeout = 600.0  # the hang guard's idle time: far above the run, so it cannot be what ends the stuck rank
    started = time.monotonic()
    assert run_distributed(_stuck_in_teardown, 2, timeout=timeout, pid_dir=str(tmp_path)) == [0, 1]
    assert time.monotonic() - started < timeout  # killed once idle in teardown for 5 s
    assert multiprocessing.active_children() == []
    for pid in (int(p.read_text()) for p in tmp_path.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _rendezvous_fails(fn, rank, setup, args, kwargs, writer) -> None:
    """``ds_ring.testing._rank_main`` whose init_process_group fails on rank 1 the first ``kwargs["failures"]``
    times (counted in ``kwargs["count_dir"]``) like gloo's connectFullMesh on torch 2.6 under load."""
    import ds_ring.testing

    count_dir = Path(kwargs["count_dir"])
    tries = len(list(count_dir.glob(f"{rank}-*")))
    Path(count_dir, f"{rank}-{tries}").touch()
    if rank == 1 and tries < kwargs["failures"]:

        def fail(*a, **k):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

        dist.init_process_group = fail
    ds_ring.testing._rank_main(fn, rank, setup, args, kwargs, writer)


def _tries(rank: int, world_size: int, count_dir: str, failures: int) -> int:
    return len(list(Path(count_dir).glob(f"{rank}-*")))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failures", [1, 2])
def test_a_failed_rendezvous_is_tried_once_more(monkeypatch, tmp_path: Path, failures: int) -> None:
    import ds_ring.testing

    monkeypatch.setattr(ds_ring.testing, "_rank_main", _rendezvous_fails)
    kwargs = {"count_dir": str(tmp_path), "failures": failures}
    if failures == 1:
        assert run_distributed(_tries, 2, timeout=60, **kwargs) == [2, 2]
        return
    with pytest.raises(RuntimeError) as info:
        run_distributed(_tries, 2, timeout=60, **kwargs)
    message = str(info.value)
    assert message.startswith(
        "rank 1 failed:\nin the rendezvous (init_process_group, then a barrier of all ranks), tried 2 times:\n"
    )
    assert "Connection closed by peer" in message
    assert len(list(tmp_path.iterdir())) == 4
