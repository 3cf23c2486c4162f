"""``strategy="auto"``: pick ``ring``, ``allgather``, ``ulysses`` or ``hybrid`` per call key by the cost model.

A run fixes the layout (the shards the caller made) and the degrees (the topology's ``ulysses × ring``;
a plain group is ``1 × p``), so at run time ``auto`` chooses among the strategies those admit —
``ring``, ``allgather`` and ``ulysses`` over the whole sequence-parallel group, and ``hybrid`` on the
topology's degrees when both are above 1 — and the exchange (``ring``/``allgather``) unless the call
names one. ``python -m ds_ring.auto`` searches layouts and degrees too, before the run.

The inputs are the call's key (agreed by every rank before :meth:`Auto.prepare`: shapes, dtype,
branches, window, documents, causal, degrees), the hosts of the group's ranks (gathered when the
topology was built) and the link probe (:func:`ds_ring.auto.probe.probe_link`: measured on the first
``auto`` call of a group, agreed, cached). Every rank computes the same choice from the same numbers;
it is logged (logger ``ds_ring.auto``, on group rank 0) with the alternatives and their predictions,
and kept in :func:`decisions`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import torch

from ds_ring.auto.model import Link, Option, Problem, format_table, plan_options
from ds_ring.auto.probe import probe_link
from ds_ring.comm import cores
from ds_ring.comm.group_ranks import group_rank
from ds_ring.comm.hosts import host_of
from ds_ring.comm.job import job
from ds_ring.comm.spans import group_members
from ds_ring.strategies.base import AttentionCall, Bound, Degrees, Shape, Strategy, Target, get_strategy
from ds_ring.strategies.sharded import get_exchange

__all__ = ["Auto", "decisions", "problem_of"]

logger = logging.getLogger("ds_ring.auto")


def decisions() -> list[Option]:
    """The options ``auto`` chose on this rank in this job, oldest first (the last 64; the job's
    :class:`~ds_ring.comm.job.Job` keeps them)."""
    owner = job()
    with owner.lock:
        return list(owner.decisions)


def _oversubscription(group, device: torch.device) -> float:
    """Compute threads per core under ``group``'s CPU ranks (1.0 on an accelerator: each rank its own)."""
    return cores.oversubscription(group_members(group)) if device.type == "cpu" else 1.0


def _ranks_per_host(group) -> int | None:
    """Fewest ranks of ``group`` on one host, when every member's host is known (``None``: unknown)."""
    hosts = [host_of(rank) for rank in group_members(group)]
    if any(host is None for host in hosts):
        return None
    return min(collections.Counter(hosts).values())


def problem_of(
    call: AttentionCall,
    shape: Shape,
    degrees: Degrees,
    *,
    itemsize: int = 2,
    v_head_dim: int | None = None,
    backward: bool = True,
    documents: tuple[int, ...] | None = None,
    ranks_per_host: int | None = None,
    oversubscription: float = 1.0,
) -> Problem:
    """The :class:`Problem` of one call on shards of ``shape`` over ``degrees`` (layout and degrees fixed)."""
    seg, rates = call.segment_lengths, call.dilation_rates
    return Problem(
        seq=shape.rows * degrees.sequence, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        world=degrees.sequence, v_head_dim=v_head_dim, batch=shape.batch, itemsize=itemsize, causal=call.causal,
        window=call.window, segment_lengths=None if seg is None else tuple(seg),
        dilation_rates=None if rates is None else tuple(rates), backward=backward, ranks_per_host=ranks_per_host,
        layouts=(call.layout,), degrees=tuple({(1, degrees.sequence), (degrees.ulysses, degrees.ring)}),
        communication=call.communication, documents=documents, oversubscription=oversubscription,
    )  # fmt: skip


class Auto(Strategy):
    """``strategy="auto"``: the fastest valid strategy for each call key by :mod:`ds_ring.auto.model`."""

    name = "auto"

    def default_communication(self) -> None:
        return None

    def check(self, call: AttentionCall, shape: Shape | None, degrees: Degrees | None) -> None:
        if call.communication is not None:
            get_exchange(call.communication)
        call.check_options(None if shape is None else shape.rows)
        if shape is None or degrees is None:
            return
        options = plan_options(problem_of(call, shape, degrees), Link())
        if not options or options[0].error is not None:
            reasons = "; ".join(f"{o.label}: {o.error}" for o in options) or "no candidate"
            raise ValueError(f"strategy 'auto' found no valid strategy for this call: {reasons}")

    def prepare(self, call: AttentionCall, target: Target) -> Bound:
        bound: list[Bound] = []

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None):
            if not bound:  # the key's first run: every rank of the placement runs it at the same point
                bound.append(self._bind(call, target, q, k, v))
            return bound[0](q, k, v, sinks)

        return run

    def _bind(self, call: AttentionCall, target: Target, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Bound:
        """Probe (first call of the group), choose, log, and prepare the chosen strategy."""
        shape, placement, device, documents = target
        link = probe_link(
            placement.sequence, device, control=placement.control(placement.sequence), timeout_s=call.timeout_s
        )
        backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        problem = problem_of(
            call, shape, placement.degrees, itemsize=q.element_size(), v_head_dim=v.shape[-1], backward=backward,
            documents=documents, ranks_per_host=_ranks_per_host(placement.sequence),
            oversubscription=_oversubscription(placement.sequence, device),
        )  # fmt: skip
        options = plan_options(problem, link)
        chosen = options[0]
        if chosen.error is not None:
            raise ValueError(f"strategy 'auto' found no valid strategy for this call: {chosen.error}")
        owner = job()
        with owner.lock:
            owner.decisions.append(chosen)
        if group_rank(placement.sequence) == 0 and logger.isEnabledFor(logging.INFO):
            logger.info("strategy 'auto' chose %s\n%s", chosen.label, format_table(problem, options, link))
        strategy = get_strategy(chosen.strategy)
        resolved = dataclasses.replace(call, communication=chosen.communication)
        strategy.check(resolved, shape, placement.degrees)
        return strategy.prepare(resolved, target)
