"""Run a function on ``world_size`` spawned gloo ranks and collect what each returns (tests only).

Rendezvous goes through a ``file://`` store in a fresh temporary directory (no ports to clash)
and gloo is pinned to the loopback interface.

Ranks are started with the ``forkserver`` method, the server preloading torch: each rank is a
fork of that clean, single-threaded server process (never of the test process), so only the
first call of a session pays for importing torch. Measured on 2 busy cores: 7-13 s per call for
2-4 ``spawn``-ed ranks, 0.1-0.2 s with the preloaded forkserver. Still, a test should start ranks
once and check many cases inside its rank function, recording failures with :class:`CaseLog`.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_distributed", "CaseLog"]

# Imported once by the fork server instead of by every rank: torch, and what rank functions of
# tests import anyway (pytest; torch.distributed.tensor, imported by the first assert_close: ~1 s).
_PRELOAD = ["torch", "torch.distributed.tensor", "pytest"]
# Once a rank has failed, the others get this long to finish (or fail) before they are killed:
# they are usually blocked on the failed rank, and waiting for the full deadline tells nothing.
_GRACE_AFTER_FAILURE_S = 5.0
# How long a rank that has sent its result may take to exit before it is killed.
_EXIT_S = 5.0


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    timeout: float = 60.0,
    *,
    threads_per_rank: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks; return results in rank order.

    ``fn`` must be a module-level function; results and ``kwargs`` must be picklable. ``timeout``
    (seconds, counted from the start, process start-up included) is also the process group's
    timeout. Raises ``RuntimeError`` with ``"rank r failed:\\n<traceback>"`` for every failing rank,
    or, after killing every child, ``TimeoutError("rank r hung: no result after X s")`` naming
    the ranks still running at the deadline.
    """
    deadline = time.monotonic() + timeout
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    outcomes: dict[int, tuple[bool, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ds_ring_dist_", ignore_cleanup_errors=True) as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(fn, rank, world_size, init_method, timeout, threads_per_rank, kwargs, writer),
                    name=f"ds_ring-rank{rank}",
                    daemon=True,
                )
                proc.start()
                writer.close()
                procs.append(proc)
                readers.append(reader)
            _collect(procs, readers, deadline, outcomes)
        finally:
            _stop(procs, finished=set(outcomes))
            for reader in readers:
                reader.close()
    failed = {rank: detail for rank, (ok, detail) in sorted(outcomes.items()) if not ok}
    missing = [rank for rank in range(world_size) if rank not in outcomes]
    if failed:
        report = "\n\n".join(f"rank {rank} failed:\n{detail}" for rank, detail in failed.items())
        if missing:
            report += (
                f"\n\n{_ranks(missing)} killed: no result within {_GRACE_AFTER_FAILURE_S} s after the first failure"
            )
        raise RuntimeError(report)
    if missing:
        raise TimeoutError(f"{_ranks(missing)} hung: no result after {float(timeout)} s")
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


class CaseLog:
    """Collects failures of named checks inside a rank function.

    ``with log.case("all_gather p=3"): ...`` records the traceback of any exception and carries
    on; the rank function returns ``log.failures`` and the test asserts it is empty.
    """

    def __init__(self) -> None:
        self.failures: list[str] = []

    @contextmanager
    def case(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception:
            self.failures.append(f"{name}:\n{traceback.format_exc()}")


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    timeout: float,
    threads: int,
    kwargs: dict[str, Any],
    writer: Connection,
) -> None:
    """Child entry point: run one rank and send ``(True, pickled result)`` or ``(False, traceback)``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        try:
            outcome = (True, pickle.dumps(fn(rank, world_size, **kwargs)))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # everything, SystemExit included, goes back to the parent as text
        outcome = (False, traceback.format_exc())
    writer.send(outcome)
    writer.close()


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _collect(
    procs: list[BaseProcess],
    readers: list[Connection],
    deadline: float,
    outcomes: dict[int, tuple[bool, Any]],
) -> None:
    """Fill ``outcomes`` until every rank reported, the deadline passed, or the post-failure grace ran out."""
    limit = deadline
    while len(outcomes) < len(procs):
        now = time.monotonic()
        if now >= limit:
            return
        waiting = {reader: rank for rank, reader in enumerate(readers) if rank not in outcomes}
        exits = {procs[rank].sentinel: rank for rank in waiting.values()}
        for ready in wait_ready([*waiting, *exits], timeout=limit - now):
            rank = waiting[ready] if ready in waiting else exits[ready]
            if rank in outcomes:
                continue
            outcomes[rank] = _read_outcome(procs[rank], readers[rank])
            if not outcomes[rank][0]:
                limit = min(limit, time.monotonic() + _GRACE_AFTER_FAILURE_S)


def _read_outcome(proc: BaseProcess, reader: Connection) -> tuple[bool, Any]:
    """The rank's report, or a failure when it exited without one (crash, ``os._exit``)."""
    if reader.poll():
        try:
            return reader.recv()
        except EOFError:
            pass
    proc.join(_EXIT_S)
    return False, f"process exited with code {proc.exitcode} before returning a result"


def _stop(procs: list[BaseProcess], finished: set[int]) -> None:
    """SIGKILL ranks without a result at once, give the others a moment to exit, reap them all."""
    for rank, proc in enumerate(procs):
        if rank not in finished and proc.is_alive():
            proc.kill()
    exit_by = time.monotonic() + _EXIT_S
    for proc in procs:
        proc.join(max(0.0, exit_by - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
