"""Run a function on N fresh CPU ranks and collect what each returns: the rank runner of the tests
and the benchmarks (like ``torch.testing``, not imported by ``ds_ring/__init__``).

Ranks are started with the ``forkserver`` method, the server preloading torch (and whatever
``preload`` names): each rank is a fork of that clean, single-threaded server process, never of
the caller, so only the first call of a process pays for importing torch. Measured on 2 busy cores:
7-13 s per call for 2-4 ``spawn``-ed ranks, 0.1-0.2 s with the preloaded forkserver. Every rank is
still a process of its own: address space, allocator, thread pools and RSS high-water mark.

Rendezvous goes through a ``file://`` store in a fresh temporary directory (no ports to clash) and
gloo is pinned to the loopback interface. The hang guard waits on progress, not on the clock
(:class:`Progress`): ranks that together use no CPU for ``timeout_s`` seconds are hung — a rank blocked
on a peer that never comes uses none, a slow rank on a loaded machine keeps using some — and a cap of
``CAP_FACTOR × timeout_s`` ends even a spinning hang. Hung ranks are killed (SIGKILL) and reported;
once a rank has failed, the others get ``grace_s`` to finish, since they are usually blocked on it.

A rank sends its result *before* it tears down its process group: a teardown that blocks (seen on torch 2.6:
a rank stuck in ``destroy_process_group`` after its function had returned) can no longer hold a result back, and
once every rank has reported, ranks that stop exiting (no CPU for :data:`_EXIT_S`) are killed. A rendezvous that
fails (``init_process_group`` and a first barrier of all ranks; gloo's ``connectFullMesh`` "Connection closed by
peer", seen on torch 2.6 under load) before any rank got through it is tried once more, from a fresh rendezvous
file; a second failure is reported naming the rank, the stage and the cause.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import resource
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["CAP_FACTOR", "PRELOAD", "Progress", "RankOutcome", "cpu_seconds", "rank_results", "spawn_ranks"]

PRELOAD = ("torch", "torch.distributed")
"""Modules the fork server imports once. The server starts on the first call of a process and keeps
the ``preload`` of that call; ranks import anything else their function needs themselves."""
_EXIT_S = 5.0
"""Ranks that have sent their results and then use no CPU for this long (seconds) while exiting are killed."""
_RENDEZVOUS_TRIES = 2
"""How often a rendezvous that failed before any rank got through it is tried, each from a fresh file."""
_JOINED = "joined"
"""What a rank sends once it got through the rendezvous, before it runs the function."""
CAP_FACTOR = 20.0
"""A guard's hard cap, in units of its idle time: only a hang that keeps using CPU lasts that long."""
_TICK_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SAMPLE_S = 2.0
_BUSY = 0.01
"""Progress: a process used at least this share of a core over the last idle window (1 %: a runnable process gets
more even at a load of 50 per core). Not over one sample: the polling threads of ranks blocked in a gloo
collective wake in bursts (0.1–0.4 % of a core on average, but now and then 20 ms within 2 s)."""


def cpu_seconds(pids: Sequence[int]) -> dict[int, float] | None:
    """CPU seconds (user + system, every thread) used so far by each live process of ``pids`` with every process
    below it (children already reaped count through their parent), from ``/proc``; ``None`` without ``/proc``."""
    try:
        entries = list(os.scandir("/proc"))
    except OSError:
        return None
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        used[pid] = sum(int(f) for f in fields[11:15]) / _TICK_S  # utime, stime, cutime, cstime
    totals = {}
    for root in pids:
        if root not in used:
            continue
        tree, frontier = set(), {root}
        while frontier:
            tree |= frontier
            frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in tree}
        totals[root] = sum(used[pid] for pid in tree)
    return totals


class Progress:
    """A hang guard that waits on progress: :meth:`stalled` is true once none of the processes ``pids()`` names
    (each with its descendants) used more than :data:`_BUSY` of a core over the last ``idle_s`` seconds, or
    ``CAP_FACTOR × idle_s`` seconds passed.

    A loaded machine slows a job down but never stops its CPU clock; a process blocked on a peer, a lock or a
    dead link all but stops it. Where CPU time cannot be read, ``idle_s`` is a plain deadline.
    """

    def __init__(self, pids: Callable[[], Sequence[int]], idle_s: float) -> None:
        self.pids, self.idle_s = pids, idle_s
        self.started = self._sampled_at = time.monotonic()
        self._samples: deque[tuple[float, dict[int, float]]] = deque([(self.started, {})])
        self._busy = True

    def stalled(self) -> bool:
        now = time.monotonic()
        if now - self._sampled_at >= _SAMPLE_S:
            self._sampled_at, cpu = now, cpu_seconds(self.pids()) or {}
            self._samples.append((now, cpu))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.idle_s:
                self._samples.popleft()  # the window starts at the newest sample at least idle_s old
            since, before = self._samples[0]
            used = max((c - before.get(pid, 0.0) for pid, c in cpu.items()), default=0.0)
            self._busy = now - since < self.idle_s or used >= _BUSY * (now - since)
        return not self._busy or now - self.started >= CAP_FACTOR * self.idle_s

    def wait_until(self, condition: Callable[[], bool], what: str) -> None:
        """Poll ``condition`` every 0.1 s until it holds; ``TimeoutError`` naming ``what`` once :meth:`stalled`."""
        while not condition():
            if self.stalled():
                raise TimeoutError(f"no {what}: the processes used no CPU for {self.idle_s} s")
            time.sleep(0.1)


@dataclass(frozen=True)
class RankOutcome:
    """What one rank gave back.

    rank: its rank. value: what the function returned (None unless ``ok``).
    error: the rank's traceback, or why it sent nothing (None when ``ok``).
    hung: killed without a result, at the deadline or after the grace that followed a failure.
    cpu_s: CPU seconds (user + system, all threads) its process used; None if it sent nothing.
    peak_rss_mib: its process's RSS high-water mark, MiB (2**20 bytes); None if it sent nothing.
    """

    rank: int
    value: Any = None
    error: str | None = None
    hung: bool = False
    cpu_s: float | None = None
    peak_rss_mib: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout_s: float,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    threads_per_rank: int = 1,
    process_group: bool = True,
    grace_s: float = 5.0,
    preload: Sequence[str] = PRELOAD,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes; outcomes in rank order.

    ``fn`` must be a module-level function; ``args``, ``kwargs`` and its results must be picklable.
    Each rank sets ``torch.set_num_threads(threads_per_rank)`` (and one inter-op thread) and, with
    ``process_group``, joins a gloo group of ``world_size`` ranks whose timeout is the hard cap,
    ``CAP_FACTOR × timeout_s``. Ranks that use no CPU for ``timeout_s`` seconds (:class:`Progress`)
    are hung. Never raises for a failing or hanging rank: its :class:`RankOutcome` says what happened.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    call = (fn, tuple(args), dict(kwargs or {}))
    for attempt in range(1, _RENDEZVOUS_TRIES + 1):
        sent, joined = _attempt(ctx, call, world_size, timeout_s, threads_per_rank, process_group, grace_s)
        # retried only where no rank got through the rendezvous, so no rank has run any of fn
        rendezvous_failed = process_group and not joined and any(not ok for ok, *_ in sent.values())
        if not rendezvous_failed or attempt == _RENDEZVOUS_TRIES:
            break
    if rendezvous_failed:
        stage = f"in the rendezvous (init_process_group, then a barrier of all ranks), tried {attempt} times:\n"
        sent = {rank: (ok, payload if ok else stage + payload, *rest) for rank, (ok, payload, *rest) in sent.items()}
    if any(not ok for ok, *_ in sent.values()):
        why = f"killed: no result within {grace_s} s after the first failure"
    else:
        why = f"no result and no progress for {float(timeout_s)} s"
    outcomes = []
    for rank in range(world_size):
        if rank not in sent:
            outcomes.append(RankOutcome(rank, error=why, hung=True))
            continue
        ok, payload, cpu_s, peak_rss_mib = sent[rank]
        value, error = (pickle.loads(payload), None) if ok else (None, payload)
        outcomes.append(RankOutcome(rank, value, error, cpu_s=cpu_s, peak_rss_mib=peak_rss_mib))
    return outcomes


def _attempt(
    ctx: Any,
    call: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]],
    world_size: int,
    timeout_s: float,
    threads_per_rank: int,
    process_group: bool,
    grace_s: float,
) -> tuple[dict[int, tuple], set[int]]:
    """Start the ranks once, from a fresh rendezvous: ``({rank: (ok, payload, cpu_s, peak_rss_mib)}, joined)``,
    ``joined`` the ranks that got through the rendezvous. Every rank has exited or been killed on return."""
    fn, args, kwargs = call
    procs: list[BaseProcess] = []
    readers: list[Connection] = []
    sent: dict[int, tuple] = {}
    joined: set[int] = set()
    with tempfile.TemporaryDirectory(prefix="ds_ring_ranks_", ignore_cleanup_errors=True) as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous") if process_group else ""
        setup = (world_size, init_method, CAP_FACTOR * timeout_s, threads_per_rank)
        try:
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_rank_main,
                    args=(fn, rank, setup, args, kwargs, writer),
                    name=f"ds_ring-rank{rank}",
                    daemon=True,
                )
                proc.start()
                writer.close()
                procs.append(proc)
                readers.append(reader)
            running = [proc.pid for proc in procs]
            _collect(procs, readers, Progress(lambda: running, timeout_s), grace_s, sent, joined)
        finally:
            _stop(procs, finished=set(sent))
            for reader in readers:
                reader.close()
    return sent, joined


def rank_results(outcomes: Sequence[RankOutcome]) -> list[Any]:
    """The values of ``outcomes`` in rank order, or an exception naming every rank that did not return.

    Raises ``RuntimeError`` with ``"rank r failed:\\n<traceback>"`` for every failing rank (and the
    ranks killed after it), or ``TimeoutError("rank r hung: no result and no progress for X s")`` when ranks hung
    without any failure.
    """
    failed = [o for o in outcomes if not o.ok and not o.hung]
    hung = [o for o in outcomes if o.hung]
    if failed:
        report = "\n\n".join(f"rank {o.rank} failed:\n{o.error}" for o in failed)
        if hung:
            report += f"\n\n{_ranks(hung)} {hung[0].error}"
        raise RuntimeError(report)
    if hung:
        raise TimeoutError(f"{_ranks(hung)} hung: {hung[0].error}")
    return [o.value for o in outcomes]


def _ranks(outcomes: Sequence[RankOutcome]) -> str:
    ranks = [o.rank for o in outcomes]
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    setup: tuple[int, str, float, int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    writer: Connection,
) -> None:
    """Child entry point: run one rank and send ``(ok, pickled result or traceback, cpu_s, peak_rss_mib)``."""
    import torch
    import torch.distributed as dist

    world_size, init_method, timeout_s, threads = setup
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only allowed before any inter-op work started
        torch.set_num_interop_threads(1)
    try:
        if init_method:
            dist.init_process_group(
                "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
            )
            dist.barrier()  # every pair is connected: a failure after this is fn's, never the rendezvous's
        writer.send(_JOINED)
        try:
            ok, payload = True, pickle.dumps(fn(rank, world_size, *args, **kwargs))
        except BaseException:  # everything, SystemExit included, goes back to the parent as text
            ok, payload = False, traceback.format_exc()
    except BaseException:
        ok, payload = False, traceback.format_exc()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    writer.send((ok, payload, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024))  # ru_maxrss: KiB
    writer.close()
    # Teardown only once the result is out: the parent kills a rank stuck here (see _stop)
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _collect(
    procs: list[BaseProcess],
    readers: list[Connection],
    progress: Progress,
    grace_s: float,
    sent: dict[int, tuple],
    joined: set[int],
) -> None:
    """Fill ``sent`` (and ``joined``) until every rank reported, the ranks stalled, or the post-failure grace ran
    out."""
    limit = float("inf")
    while len(sent) < len(procs):
        now = time.monotonic()
        if now >= limit or progress.stalled():
            return
        waiting = {reader: rank for rank, reader in enumerate(readers) if rank not in sent}
        exits = {procs[rank].sentinel: rank for rank in waiting.values()}
        for ready in wait_ready([*waiting, *exits], timeout=min(limit - now, 0.5)):
            rank = waiting[ready] if ready in waiting else exits[ready]
            if rank in sent:
                continue
            report = _receive(rank, procs[rank], readers[rank], joined)
            if report is None:
                continue
            sent[rank] = report
            if not report[0]:
                limit = min(limit, time.monotonic() + grace_s)


def _receive(rank: int, proc: BaseProcess, reader: Connection, joined: set[int]) -> tuple | None:
    """The rank's report; a failure when it exited without one (crash, ``os._exit``, killed for memory); ``None``
    while it is running and has only said that it got through the rendezvous."""
    try:
        while reader.poll():
            message = reader.recv()
            if message != _JOINED:
                return message
            joined.add(rank)
        if proc.is_alive():
            return None
    except EOFError:
        pass
    proc.join(_EXIT_S)
    return False, f"process exited with code {proc.exitcode} before returning a result", None, None


def _stop(procs: list[BaseProcess], finished: set[int]) -> None:
    """SIGKILL ranks without a result at once; the others may exit as long as they use CPU doing so
    (:data:`_EXIT_S` idle: stuck in teardown, killed); reap them all."""
    for rank, proc in enumerate(procs):
        if rank not in finished and proc.is_alive():
            proc.kill()
    exiting = Progress(lambda: [proc.pid for proc in procs if proc.is_alive()], _EXIT_S)
    with contextlib.suppress(TimeoutError):
        exiting.wait_until(lambda: not any(proc.is_alive() for proc in procs), "exit")
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
