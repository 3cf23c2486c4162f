"""What a strategy's cost and memory model computes with: the call (:class:`Problem`), the measured link
(:class:`Link`, calibrated per device type by :data:`CALIBRATION`), one way to run the call (:class:`Option`) and
its predicted :class:`Cost`; plus the arithmetic every model shares (branches, query-key pairs, FLOPs, K/V heads an
all-to-all sends, the output and gradients every strategy makes).

Each strategy's own model lives in its module (:meth:`~ds_ring.strategies.base.Strategy.options`,
:meth:`~ds_ring.strategies.base.Strategy.cost`, :meth:`~ds_ring.strategies.base.Strategy.memory_q_shards`);
:mod:`ds_ring.auto.model` ranks what every registered strategy offers. Pure arithmetic: no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

__all__ = [
    "Calibration", "CALIBRATION", "Cost", "Link", "Option", "Problem", "BWD_FLOPS", "branches", "pairs", "flops",
    "kv_heads_sent", "acc_itemsize", "own_memory", "kv_ratio",
]  # fmt: skip

BWD_FLOPS = 2.5
"""Backward FLOPs over forward FLOPs of one attention block (recompute S, then dV, dP, dQ, dK)."""


@dataclass(frozen=True)
class Calibration:
    """What the model's seconds are multiplied by to read like measured ones on a device type: ``compute`` on the
    compute seconds (FLOPs over the probe's FLOP rate: attention kernels run at another rate than the probe's small
    matmuls), ``comm`` on the link seconds (bytes over the probe's bandwidth, latency per message)."""

    compute: float = 1.0
    comm: float = 1.0


CALIBRATION: dict[str, Calibration] = {"cpu": Calibration(compute=1.0, comm=1.0)}
"""The calibration of a link the probe measured, by device type (none: 1, 1): what ``python -m benchmarks.auto_fit
--fit`` fitted on its ``fit`` grid if that predicts its ``heldout`` grid better than 1, 1, else 1, 1
(``benchmarks/results/auto_fit.json``: ``coefficients.used``; docs/auto.md "Fitted, then held out"). CPU: the fit
(compute 0.708, comm 5.339) predicted the held-out grid worse, so 1, 1."""


@dataclass(frozen=True)
class Link:
    """What the ranks measured (and agreed on): the link and the attention FLOP rate, per rank.

    ``latency_s``: seconds per message; ``bandwidth``: bytes/s one rank sends (all-to-all over the
    group: what crosses hosts when it spans several); ``intra_bandwidth``: bytes/s between ranks of
    one host (``None``: ``bandwidth``); ``flops``: attention FLOP/s of one rank.
    """

    latency_s: float = 20e-6
    bandwidth: float = 10e9
    flops: float = 50e12
    intra_bandwidth: float | None = None
    source: str = "default"
    device: str | None = None
    """The device type the probe measured on: its :data:`CALIBRATION` applies (``None``: not measured, none)."""

    @classmethod
    def default(cls, device_type: str) -> Link:
        """Rough rates when nothing is measured: a CPU rank over loopback, or a GPU over NVLink."""
        if device_type == "cpu":
            return cls(latency_s=100e-6, bandwidth=2e9, flops=20e9, source="default cpu")
        return cls(latency_s=20e-6, bandwidth=100e9, flops=300e12, source=f"default {device_type}")

    def within_host(self) -> float:
        """Bytes/s between ranks of one host."""
        return self.bandwidth if self.intra_bandwidth is None else self.intra_bandwidth

    def calibrated(self, calibration: Calibration | None = None) -> Link:
        """The rates the model computes with: the FLOP rate over ``calibration.compute``, the bandwidths over and
        the latency times ``calibration.comm`` (``None``: :data:`CALIBRATION` of :attr:`device`, if any)."""
        if calibration is None:
            calibration = CALIBRATION.get(self.device or "", Calibration())
        comm = calibration.comm
        intra = None if self.intra_bandwidth is None else self.intra_bandwidth / comm
        return replace(
            self, latency_s=self.latency_s * comm, bandwidth=self.bandwidth / comm,
            flops=self.flops / calibration.compute, intra_bandwidth=intra,
        )  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """One attention call as every rank sees it (all agreed): global sizes, branches, ranks, hosts.

    ``seq``: global tokens; ``world``: sequence-parallel ranks; ``itemsize``: bytes per element of
    q/k/v; ``ranks_per_host``: consecutive ranks sharing a host (``world``: one host). ``layouts`` /
    ``degrees``: what the options may use (a run fixes both: the shards' layout and the topology's
    ``(ulysses, ring)``; ``None``: every factorisation of ``world``); ``communication``: the exchange
    the user fixed (``None``: auto picks); ``memory_limit``: bytes per rank an option may use
    (``None``: no limit); ``oversubscription``: CPU ranks' compute threads per core on the busiest machine
    (:func:`ds_ring.comm.cores.oversubscription`; 1 on accelerators): above 1, a rank idle in a causal ring's
    unbalanced steps lends its core to another, so the imbalance costs ``max(1, imbalance / oversubscription)``.
    """

    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    world: int
    v_head_dim: int | None = None
    batch: int = 1
    itemsize: int = 2
    causal: bool = True
    window: int | None = None
    segment_lengths: tuple[int, ...] | None = None
    dilation_rates: tuple[int, ...] | None = None
    backward: bool = True
    ranks_per_host: int | None = None
    layouts: tuple[str, ...] = ("contiguous", "zigzag")
    degrees: tuple[tuple[int, int], ...] | None = None
    communication: str | None = None
    memory_limit: int | None = None
    documents: tuple[int, ...] | None = None
    oversubscription: float = 1.0

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def local(self) -> int:
        """Rows of one rank's shard."""
        return self.seq // self.world

    def factorisations(self) -> tuple[tuple[int, int], ...]:
        """The ``(ulysses, ring)`` degrees options may use: :attr:`degrees`, or every factorisation of ``world``."""
        return self.degrees or tuple((u, self.world // u) for u in range(1, self.world + 1) if self.world % u == 0)

    @property
    def q_shard_bytes(self) -> int:
        """Bytes of one rank's ``q`` shard: the memory unit."""
        return self.batch * self.local * self.heads * self.head_dim * self.itemsize


@dataclass(frozen=True)
class Option:
    """One way to run the call, and what the model predicts for it (seconds and bytes per rank)."""

    strategy: str
    communication: str | None
    layout: str
    ulysses: int
    ring: int
    chunk: int
    """Rows of one ring block (``ulysses × local``)."""
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    sent_bytes: int = 0
    memory_bytes: int = 0
    memory_q_shards: float = 0.0
    error: str | None = None
    """Why the strategy refuses this option (``None``: valid)."""
    notes: tuple[str, ...] = field(default=())
    link: Link | None = None
    """The link the predictions assumed."""
    oversubscription: float = 1.0
    """The problem's CPU oversubscription they assumed."""

    @property
    def time_s(self) -> float:
        """Predicted step time: compute plus exposed communication."""
        return self.compute_s + self.exposed_s

    @property
    def label(self) -> str:
        comm = f"/{self.communication}" if self.communication not in (None, self.strategy) else ""
        return f"{self.strategy}{comm} {self.layout} U{self.ulysses}×R{self.ring}"


class Cost(NamedTuple):
    """What one option costs per rank of one call: compute seconds, bytes sent, link seconds, exposed seconds (the
    part of the link seconds not hidden behind compute)."""

    compute_s: float
    sent_bytes: float
    comm_s: float
    exposed_s: float


def branches(p: Problem) -> list[tuple[int, int]]:
    """``(segment, rate)`` per branch over the global sequence (dense: ``(seq, 1)``), segments clamped."""
    if p.segment_lengths is None:
        return [(p.seq, 1)]
    return [(min(w, p.seq), r) for w, r in zip(p.segment_lengths, p.dilation_rates or (), strict=True)]


def pairs(p: Problem, segment: int, rate: int) -> float:
    """Query-key pairs per head and batch row of one branch."""
    if p.window is not None:
        w = min(p.window, p.seq)
        return p.seq * w - w * (w - 1) / 2
    kept = segment / rate
    pairs = (p.seq / segment) * kept * kept
    return pairs * (kept + 1) / (2 * kept) if p.causal else pairs


def flops(p: Problem, pairs: float) -> float:
    """FLOPs of ``pairs`` query-key pairs over every head and batch row, fwd (+bwd)."""
    per_pair = 2 * (p.head_dim + p.dv) * (1 + (BWD_FLOPS if p.backward else 0.0))
    return pairs * per_pair * p.heads * p.batch


def kv_heads_sent(p: Problem, degree: int) -> int:
    """K/V heads an all-to-all over ``degree`` ranks sends in all (replicated when they do not split),
    following :func:`ds_ring.strategies.ulysses.split_heads`."""
    if degree <= 1 or p.kv_heads % degree == 0:
        return p.kv_heads
    heads = p.heads // degree
    per_kv = p.heads // p.kv_heads
    return degree * (1 if per_kv % heads == 0 else heads)


def acc_itemsize(itemsize: int) -> int:
    """Bytes per element of the gradients' accumulation (fp32, or fp64 for fp64 inputs)."""
    return 8 if itemsize >= 8 else 4


def kv_ratio(p: Problem) -> float:
    """K+V bytes over q bytes of one rank's shard."""
    return p.kv_heads * (p.head_dim + p.dv) / (p.heads * p.head_dim)


def own_memory(p: Problem) -> float:
    """The output and gradients every strategy makes (``out``; dq, dk, dv with a backward), in q-shards."""
    return p.dv / p.head_dim + (1 + kv_ratio(p) if p.backward else 0.0)
