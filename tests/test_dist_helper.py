"""The rank runner: results come back in rank order, failures bring their tracebacks, hangs are killed."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_ring.testing import rank_results, spawn_ranks
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
    assert timeout <= elapsed < 5 * timeout  # idle for the timeout, found within one CPU sample of it
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
    assert time.monotonic() - started < 5 * timeout  # idle for the timeout, not the 20x cap
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
