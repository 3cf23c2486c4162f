"""Hybrid: Ulysses inside each ulysses group, ring dilated attention across the ring group.

Sequence-parallel rank ``r·U + u`` holds shard ``r·U + u`` of ``L`` rows. The all-to-all inside a
ulysses group (``U`` consecutive shards) gives rank ``(r, u)`` the ``U·L`` consecutive rows of
block ``r`` for heads ``[u·H/U, (u+1)·H/U)``; the ring group (same ``u``, ``r = 0..R-1``) then
holds consecutive blocks in order, so the ring dimension is sharded attention over the ring group on
shards of ``U·L`` rows with ``head_offset + u·H/U``, and a ring exchange (``communication``) moves the K/V
between blocks. Each head group runs :func:`~ds_ring.strategies.sharded.sharded_forward` and
:func:`~ds_ring.strategies.sharded.sharded_backward` (its own backward ring) inside Ulysses' group Function
(:func:`~ds_ring.strategies.ulysses.attend_head_groups`): all-to-all, the group's ring, all-to-all back.

With ``zigzag`` shards of the sequence-parallel group, the rows a rank gathers are chunks ``r``
and ``2R-1-r`` of ``2R``: the ring group's own zigzag layout, so dense causal work stays balanced.
"""

from __future__ import annotations

import functools

import torch

from ds_ring.kernels.dilation import make_branches
from ds_ring.strategies.base import AttentionCall, Bound, Degrees, Shape, Strategy, Target
from ds_ring.strategies.blocks import Options
from ds_ring.strategies.cost import Cost, Link, Option, Problem, kv_heads_sent
from ds_ring.strategies.plan import plan_shards
from ds_ring.strategies.ring import ring_dimension
from ds_ring.strategies.sharded import CommSpec, get_exchange, sharded_backward, sharded_forward
from ds_ring.strategies.ulysses import (
    Ulysses,
    all_to_all_cost,
    attend_head_groups,
    check_layout,
    dilated_jobs,
    group_job,
    group_sinks,
    head_chunks,
    head_groups_of,
    head_sharded_memory,
    split_heads,
    to_heads,
)

__all__ = ["Hybrid"]


class Hybrid(Strategy):
    """``strategy="hybrid"``: all-to-all inside the ulysses group (``heads % U == 0``; fewer K/V heads than ``U``
    are replicated), then ``communication`` moves K/V across the ring group on blocks of ``U·L`` rows."""

    name = "hybrid"
    buffers = {"hybrid_ring": 1.0}
    """Memory of the ring's K/V block of the head group in its backward, per unit of that group's K/V bytes over q
    bytes (on top of Ulysses' model, :func:`~ds_ring.strategies.ulysses.head_sharded_memory`)."""

    def check_degrees(self, ulysses_degree: int | None, ring_degree: int | None) -> None:
        if ulysses_degree is None:
            raise ValueError("strategy 'hybrid' needs ulysses_degree (the Ulysses ranks inside each ring step)")

    def options(self, problem: Problem) -> list[Option]:
        """Every layout on every factorisation ``U × R`` with both degrees above 1, on the call's exchange (``ring``
        when it names none); the ring block is ``U·L`` rows."""
        communication = problem.communication or self.default_communication()
        return [
            Option(self.name, communication, layout, u, r, u * problem.local)
            for layout in problem.layouts
            for u, r in problem.factorisations()
            if u > 1 and r > 1
        ]

    def cost(self, problem: Problem, option: Option, link: Link) -> Cost:
        per_host = problem.ranks_per_host or problem.world
        a2a_bandwidth = link.within_host() if option.ulysses <= per_host else link.bandwidth
        ring_bandwidth = link.within_host() if per_host >= problem.world else link.bandwidth
        a_sent, a_comm = all_to_all_cost(problem, option.ulysses, a2a_bandwidth, link)
        ring = ring_dimension(problem, option, link, ring_bandwidth)
        return Cost(ring.compute_s, a_sent + ring.sent_bytes, a_comm + ring.comm_s, a_comm + ring.exposed_s)

    def memory_q_shards(self, problem: Problem, option: Option, buffers: dict[str, float] | None = None) -> float:
        b = {**Ulysses.buffers, **self.buffers, **(buffers or {})}
        rows = problem.local * option.ulysses
        peak = head_sharded_memory(problem, option.ulysses, rows, option.ring, b)
        if option.ring == 1:
            return peak
        kv_heads = kv_heads_sent(problem, option.ulysses)
        heads_kv = kv_heads * (problem.head_dim + problem.dv) / (problem.heads * problem.head_dim)
        return peak + b["hybrid_ring"] * heads_kv / head_groups_of(kv_heads // option.ulysses)

    def check(self, call: AttentionCall, shape: Shape | None, degrees: Degrees | None) -> None:
        get_exchange(call.communication)
        call.check_options(None if shape is None else shape.rows)
        if shape is None or degrees is None:
            return
        split_heads(shape.heads, shape.kv_heads, degrees.ulysses)  # heads % ulysses
        check_layout(call.layout, shape.rows)
        if degrees.ring == 1:
            return
        block = shape.rows * degrees.ulysses
        dense = [(block * degrees.ring, 1)]
        branches = [(b.segment, b.rate) for b in make_branches(block * degrees.ring, call.segment_lengths,
                                                               call.dilation_rates)]  # fmt: skip
        if call.layout == "zigzag" and branches != dense:
            raise ValueError(
                f"strategy 'hybrid' with a ring degree of {degrees.ring} supports layout='zigzag' for dense attention "
                f"only, got segment_lengths={call.segment_lengths} dilation_rates={call.dilation_rates}; use "
                f"layout='contiguous', or strategy 'ulysses', which supports zigzag with dilation"
            )
        plan_shards(
            block, shape.heads // degrees.ulysses, max(1, shape.kv_heads // degrees.ulysses), 0, degrees.ring,
            call.segment_lengths, call.dilation_rates, layout=call.layout, causal=call.causal,
        )  # fmt: skip

    def prepare(self, call: AttentionCall, target: Target) -> Bound:
        shape, placement, device, documents = target
        degrees, timeout_s = placement.degrees, call.timeout_s
        split = split_heads(shape.heads, shape.kv_heads, degrees.ulysses, device)
        u, r = degrees.rank % degrees.ulysses, degrees.rank // degrees.ulysses
        offset, heads = call.head_offset + u * split.heads, slice(u * split.heads, (u + 1) * split.heads)
        chunks = head_chunks(split)
        width = split.heads // chunks
        if degrees.ring == 1:

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None):
                qs, ks, vs = to_heads(q, k, v, split, placement.ulysses, layout=call.layout, timeout_s=timeout_s,
                                      chunks=chunks)  # fmt: skip
                local = group_sinks(None if sinks is None else sinks[heads], [width] * chunks)
                jobs = dilated_jobs(qs, ks, vs, local, call, split, placement.ulysses, head_offset=offset,
                                    documents=documents)  # fmt: skip
                return attend_head_groups(qs, ks, vs, local, jobs, return_lse=call.return_lse, strategy=self.name)

            return run
        plans = [
            plan_shards(
                shape.rows * degrees.ulysses,
                width,
                split.kv_heads // chunks,
                r,
                degrees.ring,
                call.segment_lengths,
                call.dilation_rates,
                layout=call.layout,
                head_offset=offset + i * width,
                device=device,
                causal=call.causal,
                documents=documents,
                window=call.window,
                spans=call.bidirectional_spans,
            )
            for i in range(chunks)
        ]
        exchange, comm = get_exchange(call.communication), CommSpec(placement.ring, timeout_s)
        spans = call.bidirectional_spans
        jobs = [
            group_job(
                functools.partial(sharded_forward, plan=plan, exchange=exchange, comm=comm, opts=opts),
                functools.partial(sharded_backward, plan=plan, exchange=exchange, comm=comm, opts=opts),
                slice(i * width, (i + 1) * width),
                split,
                placement.ulysses,
                call,
            )
            for i, plan in enumerate(plans)
            for opts in [Options(call.causal, call.scale, offset + i * width, call.window, call.softcap, spans)]
        ]

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None):
            qs, ks, vs = to_heads(q, k, v, split, placement.ulysses, layout=call.layout, timeout_s=timeout_s,
                                  chunks=chunks)  # fmt: skip
            local = group_sinks(None if sinks is None else sinks[heads], [width] * chunks)
            return attend_head_groups(qs, ks, vs, local, jobs, return_lse=call.return_lse, strategy=None)

        return run
