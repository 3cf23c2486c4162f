"""The link probe of ``strategy="auto"``: latency, bandwidth and FLOP rate, measured once per group and agreed.

At the first ``auto`` call on a process group every rank of it times, on the data's device,

- all-to-alls of a small message (``SMALL`` bytes per rank) and of a larger one (``LARGE``), the best of
  ``REPEATS`` each: latency = the small one's time, bandwidth = the extra bytes over the extra time;
- a few small matmuls shaped like attention blocks, the best of ``REPEATS``: the FLOP rate.

About 10 ms on gloo loopback (with one timing per rate). Ranks measure different numbers (a busy core, a far
host), so the numbers are then *agreed*: one all-reduce of every rank's row (a one-hot sum, so every rank ends up
with every row), and every rank takes the worst (largest latency, smallest bandwidth and FLOP rate)
of the same rows — the same floats on every rank, hence the same choice. The result is cached per
process group (the ranks, and so the hosts they run on), so later calls and layers cost nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from ds_ring.auto.model import Link
from ds_ring.comm.collectives import all_reduce, all_to_all
from ds_ring.comm.group_ranks import group_rank, group_size, takes_cpu
from ds_ring.comm.job import job

__all__ = ["probe_link", "measure_link", "agree_link", "SMALL", "LARGE", "REPEATS"]

SMALL = 4 * 2**10
"""Bytes per rank of the latency all-to-all."""
LARGE = 1 * 2**20
"""Bytes per rank of the bandwidth all-to-all."""
REPEATS = 4
"""Timings of each measurement; the best counts."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_all_to_all(nbytes: int, group: ProcessGroup | None, device: torch.device, timeout_s: float | None) -> float:
    """Best of :data:`REPEATS` all-to-alls of ``nbytes`` per rank (one warm-up), seconds."""
    p = group_size(group)
    x = torch.zeros(p, max(1, nbytes // (4 * p)), dtype=torch.float32, device=device)
    best = float("inf")
    for i in range(REPEATS + 1):
        _sync(device)
        start = time.perf_counter()
        all_to_all(x, group=group, op="auto_probe", timeout_s=timeout_s)
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return best


def _time_flops(device: torch.device) -> float:
    """FLOP/s of attention-shaped matmuls (``[8, 256, 64] @ [8, 64, 256]``, bf16 on a GPU, fp32 on a CPU): the best
    of :data:`REPEATS` timings, as the all-to-alls, so that both read the rank's speed when it runs (on shared cores
    a single timing also reads how long the rank waited for one: 0.8-17 GFLOP/s on one machine)."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(8, 256, 64, device=device, dtype=dtype)
    b = torch.randn(8, 64, 256, device=device, dtype=dtype)
    reps = 4 if device.type == "cpu" else 50
    torch.bmm(a, b)
    best = float("inf")
    for _ in range(REPEATS):
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            torch.bmm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return reps * 2 * 8 * 256 * 256 * 64 / max(best, 1e-9)


def measure_link(group: ProcessGroup | None, device: torch.device, timeout_s: float | None = None) -> Link:
    """This rank's own measurement (collective over ``group``: every rank calls it at the same point)."""
    flops = _time_flops(device)
    if group_size(group) == 1:
        return Link(latency_s=0.0, bandwidth=float("inf"), flops=flops, source="measured, 1 rank", device=device.type)
    small = _time_all_to_all(SMALL, group, device, timeout_s)
    large = _time_all_to_all(LARGE, group, device, timeout_s)
    p = group_size(group)
    extra = (LARGE - SMALL) * (p - 1) / p
    # A large exchange timed hardly slower than the small one (noise: both waited for a core) says little about the
    # extra bytes: then the bandwidth is taken as if the whole large exchange were transfer (a lower bound), never
    # extra / ~0 (783 TB/s was read that way on 2 shared cores).
    bandwidth = extra / (large - small) if large - small > 0.1 * large else LARGE * (p - 1) / p / large
    return Link(
        latency_s=small / max(1, p - 1), bandwidth=bandwidth, flops=flops, source="measured", device=device.type
    )


def agree_link(
    mine: Link, group: ProcessGroup | None, timeout_s: float | None = None, device: torch.device | None = None
) -> Link:
    """The worst of every rank's measurement, identical on every rank (one all-reduce of one row per rank;
    ``device``: where the rows travel, ``None``: the CPU)."""
    p, me = group_size(group), group_rank(group)
    if p == 1:
        return mine
    rows = torch.zeros(p, 3, dtype=torch.float64, device=device)
    rows[me] = torch.tensor([mine.latency_s, mine.bandwidth, mine.flops], dtype=torch.float64, device=device)
    rows = all_reduce(rows, group=group, op="auto_probe_agree", timeout_s=timeout_s).cpu()
    latency, bandwidth, flops = (float(x) for x in (rows[:, 0].max(), rows[:, 1].min(), rows[:, 2].min()))
    return Link(
        latency_s=latency, bandwidth=bandwidth, flops=flops, source=f"measured, worst of {p} ranks", device=mine.device
    )


def probe_link(
    group: ProcessGroup | None,
    device: torch.device,
    *,
    control: ProcessGroup | None = None,
    timeout_s: float | None = None,
    measure: Callable[[ProcessGroup | None, torch.device, float | None], Link] | None = None,
) -> Link:
    """The agreed :class:`Link` of ``group`` (measured on its first call, then kept per group by the job).

    Collective over ``group`` on the first call: every rank of it must call at the same point (the
    ``auto`` strategy does, when a call's key is first run). ``control``: a group of the same ranks whose
    backend takes CPU tensors for the agreement (``None``: ``group``, with CPU tensors). ``measure``:
    replaces :func:`measure_link` (tests inject rank-dependent timings).
    """

    def make() -> Link:
        mine = (measure or measure_link)(group, device, timeout_s)
        if control is None and not takes_cpu(group):  # no CPU twin: the rows travel on the data's device
            return agree_link(mine, group, timeout_s, device)
        return agree_link(mine, control if control is not None else group, timeout_s)

    owner = job()  # keeps the link per group (one process alone: per device type)
    if group is None:
        return owner.owned(owner, f"probed link {device.type}", make)
    return owner.owned(group, "probed link", make)
