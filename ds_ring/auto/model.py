"""The cost and memory model behind ``strategy="auto"``: pure arithmetic on numbers every rank knows.

For one attention call (fwd+bwd) over ``p`` sequence-parallel ranks, every *option* — strategy
(``ring``, ``allgather``, ``ulysses``, ``hybrid``), layout (``contiguous``/``zigzag``), degrees
(``ulysses × ring``) and the rows of one ring block (the *chunk*) — gets:

- **compute** ``t_c``: attention FLOPs per rank over the agreed FLOP rate. FLOPs are counted per
  branch: a LongNet branch ``(w, r)`` has ``S·w/r²`` query-key pairs per head (``S²`` dense; halved when
  causal; ``S·window`` with a sliding window), ``2·(D + Dv)`` FLOPs per pair forward and 2.5× that
  again backward. A causal ring over contiguous shards idles: each step waits for the rank with the
  full block, so its spanning work costs ``2n/(n+1)`` times the balanced share (``n``: ring degree);
  zigzag and Ulysses are balanced. CPU ranks that share cores (``oversubscription`` threads per core) lend an
  idle rank's core to the others, dividing that imbalance by the oversubscription (never below 1).
- **bytes per link** per rank: a ring step moves one K/V block (``U·L`` rows of the ring group's K/V
  heads; only the kept rows ``1/r`` of spanning branches, over ``min(n, w/block) - 1`` hops), the
  backward moves K/V again plus dK/dV in the accumulation dtype; an all-to-all moves ``(u-1)/u`` of
  q, k, v (K/V heads replicated when they do not split), of out, of dout and of dq, dk, dv.
- **exposed communication**: the bytes over the link's bandwidth plus one latency per message. A
  ring overlaps its transfers with the compute of all but the last block; all-gathers and
  all-to-alls are exposed whole.
- **memory per rank**, extra over ``q, k, v, dout`` (what :mod:`benchmarks.memory` measures), in
  q-shards (bytes of this rank's ``q``): the output and gradients every strategy makes (``out``, dq,
  dk, dv) plus the strategy's buffers, with coefficients calibrated on measured runs
  (:data:`BUFFERS`).

Step time = ``t_c`` + exposed communication. The choice is the fastest valid option (validity is the
strategies' own :meth:`~ds_ring.strategies.Strategy.check`, so ``auto`` never picks what a strategy
refuses), ties within :data:`TIE` broken by less memory, then by the fixed order of
:data:`STRATEGIES`: a pure function of its inputs, so every rank given the same inputs decides alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ds_ring.kernels.overwrite import BLOCK_ROWS

__all__ = ["Link", "Problem", "Option", "plan_options", "choose", "BUFFERS", "STRATEGIES", "TIE", "format_table"]

STRATEGIES = ("ring", "allgather", "ulysses", "hybrid")
"""Candidates, in tie-break order."""

TIE = 0.03
"""Options within 3 % of the fastest step time count as equally fast (then the least memory wins)."""

BWD_FLOPS = 2.5
"""Backward FLOPs over forward FLOPs of one attention block (recompute S, then dV, dP, dQ, dK)."""

BUFFERS = {
    "ring": 0.75,
    "ring_dilated": 0.9,
    "allgather": 0.45,
    "ulysses": 0.0,
    "hybrid_ring": 1.0,
}
"""Memory coefficients beyond the output and gradients, per unit of K/V bytes over q bytes (``kv``):
``ring``: in-flight K/V blocks and dK/dV (calibrated: dense causal ring, 4 ranks, 5.5 q-shards);
``ring_dilated``: the same with dilation (5.8 q-shards); ``allgather``: per gathered remote shard (one K/V head
gathered at a time: 6.6 q-shards at 4 ranks). Ulysses and hybrid peak in one head group's backward
(:func:`_head_group_peak`); ``ulysses``: what they hold beyond that; ``hybrid_ring``: the ring's K/V block of the
group in its backward, per unit of that group's K/V bytes (with its pieces, ``dout`` and stand-in output in
:func:`_head_group_peak`). Calibrated at 4 ranks, 8 heads × 64, dense causal, 4K–8K rows per rank, in fresh
processes with every block over 64 KiB mmap'ed: Ulysses 5.0, hybrid 2 × 2 5.7, ring 5.5, all-gather 6.6 q-shards
(docs/auto.md)."""

HEAD_GROUPS = 4
"""Most head groups a rank attends to in turn (``ds_ring.strategies.ulysses.HEAD_GROUPS``)."""

BLOCKED_GROUP = 3.0
"""The group in such a backward, in units of its ``dout``: ``dout`` itself, the ``dq`` of unfinished query blocks,
one key block's dK/dV and one call's pieces (census at 4K rows per rank: 3.3; RSS slope: less)."""

EXCHANGE_BACK = 1.5
"""The gradients' way back to sequence shards, in q-shards over the head shards: the tensor's result (1) and one of
``EXCHANGE_PARTS`` (4) parts in flight both ways (``ds_ring.strategies.ulysses``)."""


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

    @classmethod
    def default(cls, device_type: str) -> Link:
        """Rough rates when nothing is measured: a CPU rank over loopback, or a GPU over NVLink."""
        if device_type == "cpu":
            return cls(latency_s=100e-6, bandwidth=2e9, flops=20e9, source="default cpu")
        return cls(latency_s=20e-6, bandwidth=100e9, flops=300e12, source=f"default {device_type}")

    def within_host(self) -> float:
        """Bytes/s between ranks of one host."""
        return self.bandwidth if self.intra_bandwidth is None else self.intra_bandwidth


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


def _branches(p: Problem) -> list[tuple[int, int]]:
    """``(segment, rate)`` per branch over the global sequence (dense: ``(seq, 1)``), segments clamped."""
    if p.segment_lengths is None:
        return [(p.seq, 1)]
    return [(min(w, p.seq), r) for w, r in zip(p.segment_lengths, p.dilation_rates or (), strict=True)]


def _pairs(p: Problem, segment: int, rate: int) -> float:
    """Query-key pairs per head and batch row of one branch."""
    if p.window is not None:
        w = min(p.window, p.seq)
        return p.seq * w - w * (w - 1) / 2
    kept = segment / rate
    pairs = (p.seq / segment) * kept * kept
    return pairs * (kept + 1) / (2 * kept) if p.causal else pairs


def _flops(p: Problem, pairs: float) -> float:
    """FLOPs of ``pairs`` query-key pairs over every head and batch row, fwd (+bwd)."""
    per_pair = 2 * (p.head_dim + p.dv) * (1 + (BWD_FLOPS if p.backward else 0.0))
    return pairs * per_pair * p.heads * p.batch


def _kv_heads_sent(p: Problem, degree: int) -> int:
    """K/V heads an all-to-all over ``degree`` ranks sends in all (replicated when they do not split),
    following :func:`ds_ring.strategies.ulysses.split_heads`."""
    if degree <= 1 or p.kv_heads % degree == 0:
        return p.kv_heads
    heads = p.heads // degree
    per_kv = p.heads // p.kv_heads
    return degree * (1 if per_kv % heads == 0 else heads)


def _acc(itemsize: int) -> int:
    return 8 if itemsize >= 8 else 4


def _ring_part(p: Problem, o: Option, link: Link, bandwidth: float) -> tuple[float, float, float, float]:
    """Ring dimension of ``o`` (degree ``o.ring`` on blocks of ``o.chunk`` rows): compute seconds, bytes
    sent, link seconds, exposed seconds."""
    n, block = o.ring, o.chunk
    heads_q = p.heads // o.ulysses
    kv_heads = _kv_heads_sent(p, o.ulysses) // o.ulysses
    block_kv = p.batch * block * kv_heads * (p.head_dim + p.dv) * p.itemsize
    balanced, spanning_work, sent, steps = 0.0, 0.0, 0.0, 0
    for segment, rate in _branches(p):
        work = _flops(p, _pairs(p, segment, rate)) * heads_q / p.heads / (p.world // o.ulysses)
        balanced += work
        if n == 1:
            continue
        if p.window is not None:  # a window reaches back min(window, block·hops) rows: the rows it needs travel
            hops, fraction = min(n - 1, math.ceil(p.window / block)), min(1.0, p.window / block)
        elif segment > block:
            hops, fraction = min(n, math.ceil(segment / block)) - 1, 1.0 / rate
            spanning_work += work
        else:
            continue
        sent += block_kv * fraction * hops * (1 + ((1 + _acc(p.itemsize) / p.itemsize) if p.backward else 0))
        steps = max(steps, hops)
    imbalance = 2 * n / (n + 1) if p.causal and o.layout == "contiguous" and n > 1 else 1.0
    imbalance = max(1.0, imbalance / p.oversubscription)  # an idle rank's core runs another rank's work
    compute = (balanced + spanning_work * (imbalance - 1)) / link.flops
    messages = steps * (3 if p.backward else 1)
    comm = sent / bandwidth + messages * link.latency_s
    if o.communication == "allgather":
        exposed = comm
    else:  # each step's transfer overlaps the compute of one block; the last block has nothing to hide
        exposed = max(comm - compute * steps / (steps + 1), messages * link.latency_s)
    return compute, sent, comm, exposed


def _a2a_part(p: Problem, degree: int, bandwidth: float, link: Link) -> tuple[float, float]:
    """All-to-all of q, k, v and back (``degree`` ranks): bytes sent, seconds (all exposed)."""
    if degree <= 1:
        return 0.0, 0.0
    rows = p.batch * p.local
    q = rows * p.heads * p.head_dim
    kv = rows * _kv_heads_sent(p, degree) * (p.head_dim + p.dv)
    out = rows * p.heads * p.dv
    elements = (q + kv + out) * (2 if p.backward else 1)
    sent = elements * p.itemsize * (degree - 1) / degree
    messages = (8 if p.backward else 4) * (degree - 1)  # one exchange per tensor: q, k, v, out (and back)
    return sent, sent / bandwidth + messages * link.latency_s


def _head_groups(kv_heads: int) -> int:
    """Head groups of a rank with ``kv_heads`` K/V heads (``ds_ring.strategies.ulysses.head_chunks``)."""
    return max(c for c in range(1, min(HEAD_GROUPS, kv_heads) + 1) if kv_heads % c == 0)


def _head_group_peak(heads_kv: float, out: float, groups: int, backward: bool, blocked: bool) -> float:
    """Ulysses' head shards at the peak, in q-shards: the saved q, k, v (``1 + heads_kv``; in the backward the
    groups already done hold their gradients instead) and the group in its backward. ``blocked`` (dense attention
    over more than ``BLOCK_ROWS`` rows, written over the head shards): its ``dout``, the ``dq`` of unfinished blocks
    and one call's pieces (``BLOCKED_GROUP·out/groups``) or the gradients' way back (:data:`EXCHANGE_BACK`),
    whichever is larger; else one call's dq, dk, dv, the group's ``dout`` and the call's stand-in output, each a
    ``1/groups`` share. Forward only: the q, k, v and one group's output."""
    if not backward:
        return 1 + heads_kv + out / groups
    if blocked:
        return 1 + heads_kv + max(BLOCKED_GROUP * out / groups, EXCHANGE_BACK)
    return (1 + heads_kv) * (1 + 1 / groups) + 2 * out / groups


def memory_q_shards(p: Problem, o: Option) -> float:
    """Predicted extra memory per rank of one fwd+bwd (over q, k, v, dout), in q-shards."""
    kv = p.kv_heads * (p.head_dim + p.dv) / (p.heads * p.head_dim)  # K+V bytes over q bytes
    out = p.dv / p.head_dim
    own = out + (1 + kv if p.backward else 0.0)  # out, dq, dk, dv
    dilated = p.segment_lengths is not None
    if o.strategy in ("ulysses", "hybrid"):
        u = p.world if o.strategy == "ulysses" else o.ulysses
        heads_kv = _kv_heads_sent(p, u) * (p.head_dim + p.dv) / (p.heads * p.head_dim)
        groups = _head_groups(_kv_heads_sent(p, u) // u)
        rows = p.seq if o.strategy == "ulysses" else p.local * o.ulysses
        blocked = not dilated and p.window is None and p.documents is None and rows > BLOCK_ROWS and o.ring == 1
        peak = out + _head_group_peak(heads_kv, out, groups, p.backward, blocked) + BUFFERS["ulysses"]
        return peak + (BUFFERS["hybrid_ring"] * heads_kv / groups if o.strategy == "hybrid" and o.ring > 1 else 0.0)
    if o.communication == "allgather":
        return own + BUFFERS["allgather"] * kv * (o.ring - 1)
    return own + BUFFERS["ring_dilated" if dilated else "ring"] * kv


def _candidates(p: Problem) -> list[Option]:
    pairs = p.degrees or tuple((u, p.world // u) for u in range(1, p.world + 1) if p.world % u == 0)
    options = []
    for layout in p.layouts:
        for u, r in pairs:
            if u == 1:
                if p.communication in (None, "ring"):
                    options.append(Option("ring", "ring", layout, 1, r, p.local))
                elif p.communication != "allgather":
                    options.append(Option("ring", p.communication, layout, 1, r, p.local))
                if p.communication in (None, "allgather"):
                    options.append(Option("allgather", "allgather", layout, 1, r, p.local))
            elif r > 1:
                options.append(Option("hybrid", p.communication or "ring", layout, u, r, u * p.local))
        if p.communication is None:
            options.append(Option("ulysses", None, layout, p.world, 1, p.seq))
    seen, unique = set(), []
    for o in options:  # a run's topology (U×R) admits ring/allgather/ulysses over the whole group too
        key = (o.strategy, o.communication, o.layout, o.ulysses if o.strategy == "hybrid" else 0)
        if key not in seen:
            seen.add(key)
            unique.append(replace(o, ulysses=1, ring=p.world) if o.strategy in ("ring", "allgather") else o)
    return unique


def _check(p: Problem, o: Option) -> str | None:
    """The strategy's own refusal of ``o`` (``None``: it accepts), via :meth:`Strategy.check`."""
    from ds_ring.strategies.base import AttentionCall, Degrees, Shape, get_strategy

    if p.seq % (p.world * (2 if o.layout == "zigzag" else 1)):
        return f"sequence {p.seq} does not split into {p.world} {o.layout} shards"
    call = AttentionCall(
        segment_lengths=p.segment_lengths, dilation_rates=p.dilation_rates, causal=p.causal,
        communication=o.communication, layout=o.layout, window=p.window, cu_seqlens=p.documents,
    )  # fmt: skip
    shape = Shape(p.batch, p.local, p.heads, p.kv_heads, p.head_dim)
    degrees = Degrees(p.world, 1) if o.strategy == "ulysses" else Degrees(o.ulysses, o.ring)
    try:
        get_strategy(o.strategy).check(call, shape, degrees)
    except ValueError as err:
        return str(err)
    return None


def evaluate(p: Problem, o: Option, link: Link) -> Option:
    """``o`` with its predicted seconds, bytes and memory filled in (and ``error`` when invalid)."""
    error = _check(p, o)
    if error is not None:
        return replace(o, error=error)
    rph = p.ranks_per_host or p.world
    inter = link.bandwidth
    if o.strategy == "ulysses":
        compute = sum(_flops(p, _pairs(p, w, r)) for w, r in _branches(p)) / p.world / link.flops
        sent, comm = _a2a_part(p, p.world, inter if rph < p.world else link.within_host(), link)
        exposed = comm
    else:
        a2a_bw = link.within_host() if o.ulysses <= rph else inter
        ring_bw = link.within_host() if rph >= p.world else inter
        a_sent, a_comm = _a2a_part(p, o.ulysses, a2a_bw, link) if o.strategy == "hybrid" else (0.0, 0.0)
        compute, r_sent, r_comm, r_exposed = _ring_part(p, o, link, ring_bw)
        sent, comm, exposed = a_sent + r_sent, a_comm + r_comm, a_comm + r_exposed
    q_shards = memory_q_shards(p, o)
    return replace(
        o, compute_s=compute, comm_s=comm, exposed_s=exposed, sent_bytes=int(sent),
        memory_q_shards=q_shards, memory_bytes=int(q_shards * p.q_shard_bytes), error=error, link=link,
        oversubscription=p.oversubscription,
    )  # fmt: skip


def _rank(p: Problem, options: Sequence[Option]) -> list[Option]:
    """Valid options best first: fastest (ties within :data:`TIE` → less memory → :data:`STRATEGIES` order)."""
    valid = [o for o in options if o.error is None]
    fits = [o for o in valid if p.memory_limit is None or o.memory_bytes <= p.memory_limit]
    pool = fits or sorted(valid, key=lambda o: o.memory_bytes)[:1]
    order = {name: i for i, name in enumerate(STRATEGIES)}

    def key(o: Option) -> tuple:
        return (o.strategy not in order, order.get(o.strategy, 0), o.layout, o.ulysses, o.communication or "")

    by_time = sorted(pool, key=lambda o: (o.time_s, *key(o)))
    if not by_time:
        return []
    best = by_time[0].time_s
    close = sorted((o for o in by_time if o.time_s <= best * (1 + TIE)), key=lambda o: (o.memory_bytes, *key(o)))
    rest = [o for o in by_time if o not in close]
    return close + rest + [o for o in valid if o not in pool]


def plan_options(p: Problem, link: Link) -> list[Option]:
    """Every candidate option with its predictions: the valid ones best first, then the refused ones."""
    options = [evaluate(p, o, link) for o in _candidates(p)]
    return _rank(p, options) + [o for o in options if o.error is not None]


def choose(p: Problem, link: Link) -> Option:
    """The option ``auto`` runs; ``ValueError`` naming every strategy's refusal when none is valid."""
    options = plan_options(p, link)
    if not options or options[0].error is not None:
        reasons = "; ".join(f"{o.label}: {o.error}" for o in options)
        raise ValueError(f"strategy 'auto' found no valid strategy for this call: {reasons}")
    return options[0]


def format_table(p: Problem, options: Sequence[Option], link: Link) -> str:
    """The options as a fixed-width table (the chosen one first, marked ``*``)."""
    mib = 2**20
    lines = [
        f"seq {p.seq} × {p.heads} heads ({p.kv_heads} K/V) × {p.head_dim}, {p.world} ranks, {p.itemsize}-byte "
        f"elements, causal={p.causal}, q-shard {p.q_shard_bytes / mib:.2f} MiB"
        + (f", CPU oversubscription {p.oversubscription:g}" if p.oversubscription != 1 else ""),
        f"link: latency {link.latency_s * 1e6:.1f} µs, bandwidth {link.bandwidth / 1e9:.2f} GB/s, "
        f"compute {link.flops / 1e12:.3f} TFLOP/s ({link.source})",
        f"  {'option':36s} {'step ms':>9s} {'compute':>9s} {'exposed':>9s} {'MiB sent':>9s} "
        f"{'mem MiB':>9s} {'q-shards':>8s}",
    ]
    for i, o in enumerate(options):
        mark = "*" if i == 0 and o.error is None else " "
        if o.error is not None:
            lines.append(f"{mark} {o.label:36s} refused: {o.error[:90]}")
            continue
        lines.append(
            f"{mark} {o.label:36s} {o.time_s * 1e3:9.2f} {o.compute_s * 1e3:9.2f} {o.exposed_s * 1e3:9.2f} "
            f"{o.sent_bytes / mib:9.1f} {o.memory_bytes / mib:9.1f} {o.memory_q_shards:8.2f}"
        )
    return "\n".join(lines)
