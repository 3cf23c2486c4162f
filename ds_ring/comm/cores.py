"""Which CPU cores every rank of the job computes on: recorded once when a :class:`~ds_ring.Topology` is built.

A rank's place is its machine (the kernel's boot id: ranks in network namespaces or containers of one machine
share it, where their host names may differ), the cores it may run on (its affinity) and the threads its
matmuls use (``torch.get_num_threads()``). From these :func:`oversubscription` says how many compute threads
each core of the busiest machine under a group carries: above 1, a rank that idles (waiting for a peer) hands
its core to another rank, which ``strategy="auto"`` counts when it prices a causal ring's idle steps. It means
nothing for ranks that compute on an accelerator (``auto`` asks only for CPU ranks).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_ring.comm.job import job

__all__ = ["CpuPlace", "this_place", "oversubscription"]

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class CpuPlace:
    """Where one rank computes on the CPU: ``machine`` (boot id, or host name), ``cores`` it may run on,
    ``threads`` its matmuls use."""

    machine: str
    cores: frozenset[int]
    threads: int

    def to_text(self) -> str:
        """``machine|threads|0-15,32-47``: one text of a gather (the cores as ranges, short on any machine)."""
        return f"{self.machine}|{self.threads}|{_ranges(self.cores)}"

    @classmethod
    def from_text(cls, text: str) -> CpuPlace:
        machine, threads, ranges = text.split("|")
        cores = set()
        for part in filter(None, ranges.split(",")):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
        return cls(machine, frozenset(cores), int(threads))


def _ranges(cores: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` → ``"0-2,5"``."""
    parts: list[list[int]] = []
    for core in sorted(cores):
        if parts and core == parts[-1][1] + 1:
            parts[-1][1] = core
        else:
            parts.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts)


def this_place() -> CpuPlace:
    """This process's :class:`CpuPlace`."""
    try:
        machine = BOOT_ID.read_text().strip()
    except OSError:
        import socket

        machine = socket.gethostname()
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return CpuPlace(machine, frozenset(cores), torch.get_num_threads())


def oversubscription(ranks: Iterable[int], places: Sequence[CpuPlace] | None = None) -> float:
    """Compute threads per core on the busiest machine running one of ``ranks`` (global ranks): every rank of
    the job on that machine counts, other groups' too (1.0 when the places are not known, or cores are spare).
    ``places``: every global rank's, in rank order (``None``: the job's, :attr:`ds_ring.comm.job.Job.places`)."""
    ranks, places = list(ranks), job().places if places is None else places
    if not places or any(not 0 <= r < len(places) for r in ranks):
        return 1.0
    worst = 1.0
    for machine in {places[r].machine for r in ranks}:
        there = [place for place in places if place.machine == machine]
        cores = frozenset().union(*(place.cores for place in there))
        worst = max(worst, sum(place.threads for place in there) / max(1, len(cores)))
    return worst
