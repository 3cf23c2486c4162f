"""Strategies ``ring`` and ``allgather``: K/V move between the sequence shards themselves.

Every rank of the sequence-parallel group keeps all heads of its shard; each branch's segments are
local or span ranks (:mod:`ds_ring.strategies.plan`), and the K/V rows of spanning segments move by an
*exchange*: passed rank to rank (``communication="ring"``, O(seq/p) memory) or gathered at once
(``"allgather"``). Strategy ``allgather`` is the same with the exchange fixed to all-gather.

The cost model of a ring dimension (:func:`ring_dimension`, also the hybrid's across its ring groups): a ring step
moves one K/V block (only the kept ``1/r`` rows of branches that span blocks, over ``min(n, w/block) - 1`` hops); the
backward moves K/V again plus dK/dV in the accumulation dtype. A ring hides each step's transfer behind the compute
of one block (the last has nothing to hide); an all-gather is exposed whole. A causal ring over contiguous shards
idles: each step waits for the rank with the full block, so its spanning work costs ``2n/(n+1)`` times the balanced
share; on CPU ranks that share cores the idle rank's core runs another rank's work, dividing that by the
oversubscription (never below 1).
"""

from __future__ import annotations

import math

from ds_ring.kernels.dilated import Options
from ds_ring.strategies.base import AttentionCall, Bound, Degrees, Shape, Strategy, Target, check_missing_dimension
from ds_ring.strategies.cost import (
    Cost,
    Link,
    Option,
    Problem,
    acc_itemsize,
    branches,
    flops,
    kv_heads_sent,
    kv_ratio,
    own_memory,
    pairs,
)
from ds_ring.strategies.plan import plan_shards
from ds_ring.strategies.sharded import CommSpec, get_exchange, sharded_attention

__all__ = ["SequenceShards", "ring_dimension"]


def ring_dimension(p: Problem, o: Option, link: Link, bandwidth: float) -> Cost:
    """The ring dimension of ``o`` (degree ``o.ring`` on blocks of ``o.chunk`` rows, ``o.ulysses`` ranks sharing the
    heads) over a link of ``bandwidth`` bytes/s: compute seconds, bytes sent, link seconds, exposed seconds."""
    n, block = o.ring, o.chunk
    heads_q = p.heads // o.ulysses
    kv_heads = kv_heads_sent(p, o.ulysses) // o.ulysses
    block_kv = p.batch * block * kv_heads * (p.head_dim + p.dv) * p.itemsize
    balanced, spanning_work, sent, steps = 0.0, 0.0, 0.0, 0
    for segment, rate in branches(p):
        work = flops(p, pairs(p, segment, rate)) * heads_q / p.heads / (p.world // o.ulysses)
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
        sent += block_kv * fraction * hops * (1 + ((1 + acc_itemsize(p.itemsize) / p.itemsize) if p.backward else 0))
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
    return Cost(compute, sent, comm, exposed)


class SequenceShards(Strategy):
    """K/V blocks move between sequence shards by ``communication`` (``exchange``: the one it must be, if fixed)."""

    buffers = {"ring": 0.75, "ring_dilated": 0.9, "allgather": 0.45}
    """Memory beyond the output and gradients, per unit of K/V bytes over q bytes: ``ring``, the in-flight K/V blocks
    and dK/dV of a ring exchange (``ring_dilated``: with dilation); ``allgather``, per gathered remote shard (one K/V
    head gathered at a time)."""

    def __init__(self, name: str, exchange: str | None = None) -> None:
        self.name = name
        self.exchange = exchange

    def check_degrees(self, ulysses_degree: int | None, ring_degree: int | None) -> None:
        check_missing_dimension(self.name, "Ulysses", "ulysses_degree", ulysses_degree)

    def options(self, problem: Problem) -> list[Option]:
        """Every layout over the whole group (``1 × p``), on this strategy's exchange: the fixed one, else the call's
        (``ring`` when it names none; the all-gather is strategy ``allgather``'s)."""
        communication = problem.communication or self.default_communication()
        if all(u != 1 for u, _ in problem.factorisations()):
            return []
        if self.exchange is not None and communication != self.exchange:
            return []
        if self.exchange is None and communication == "allgather":
            return []
        return [Option(self.name, communication, layout, 1, problem.world, problem.local) for layout in problem.layouts]

    def cost(self, problem: Problem, option: Option, link: Link) -> Cost:
        one_host = (problem.ranks_per_host or problem.world) >= problem.world
        return ring_dimension(problem, option, link, link.within_host() if one_host else link.bandwidth)

    def memory_q_shards(self, problem: Problem, option: Option, buffers: dict[str, float] | None = None) -> float:
        b = {**self.buffers, **(buffers or {})}
        if option.communication == "allgather":
            return own_memory(problem) + b["allgather"] * kv_ratio(problem) * (option.ring - 1)
        dilated = problem.segment_lengths is not None
        return own_memory(problem) + b["ring_dilated" if dilated else "ring"] * kv_ratio(problem)

    def default_communication(self) -> str:
        return self.exchange or "ring"

    def check(self, call: AttentionCall, shape: Shape | None, degrees: Degrees | None) -> None:
        if self.exchange is not None and call.communication != self.exchange:
            raise ValueError(
                f"strategy {self.name!r} moves K/V by {self.exchange}, but communication is {call.communication!r}; "
                f"remove communication, or use strategy 'ring' with communication={call.communication!r}"
            )
        get_exchange(call.communication)
        call.check_options(None if shape is None else shape.rows)
        if shape is not None and degrees is not None:
            # The arguments prepare plans with (but the device): on the CPU its plan is this one, from the cache.
            plan_shards(
                shape.rows, shape.heads, shape.kv_heads, degrees.rank, degrees.sequence, call.segment_lengths,
                call.dilation_rates, layout=call.layout, head_offset=call.head_offset, causal=call.causal,
                documents=call.cu_seqlens, window=call.window,
            )  # fmt: skip
        elif call.layout == "zigzag" and call.segment_lengths is not None:
            raise ValueError(
                f"layout='zigzag' supports dense attention only with strategy {self.name!r}, got segment_lengths="
                f"{list(call.segment_lengths)}; use layout='contiguous' (or strategy 'ulysses') for dilated attention"
            )

    def prepare(self, call: AttentionCall, target: Target) -> Bound:
        shape, placement, device, documents = target
        degrees = placement.degrees
        plan = plan_shards(
            shape.rows, shape.heads, shape.kv_heads, degrees.rank, degrees.sequence, call.segment_lengths,
            call.dilation_rates, layout=call.layout, head_offset=call.head_offset, device=device,
            causal=call.causal, documents=documents, window=call.window, spans=call.bidirectional_spans,
        )  # fmt: skip
        exchange, comm = get_exchange(call.communication), CommSpec(placement.sequence, call.timeout_s)
        spans = call.bidirectional_spans
        options = Options(call.causal, call.scale, call.head_offset, call.window, call.softcap, spans)
        return lambda q, k, v, sinks: sharded_attention(q, k, v, plan, exchange, comm, options, sinks)
