"""Dilated attention over sequence shards: one autograd Function, pluggable K/V exchanges.

The Function computes the shard-local branches itself and hands every spanning branch to an
*exchange* — how K/V blocks move among the members of a span (``ring``: passed rank to rank;
``allgather``: gathered at once). It saves only local tensors (``q, k, v, out, lse``, all
O(seq/p)); the backward asks the exchange again, so the gradient of every visiting block goes home.

A new exchange is one module defining an :class:`Exchange` subclass plus one ``register_exchange`` line.

Each call emits ``"attention"`` events (:mod:`ds_ring.hooks`) when hooks listen: a start and an
end event around the forward and around the backward (``extra["direction"]``), the end events
timed and carrying the peak memory; the forward's end event also carries the local output and
LSE (``extra["out"]``, ``extra["lse"]``: read them, never modify them). The backward runs under
the labels (layer, ...) that were set when its forward ran.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.group_ranks import group_rank
from ds_ring.hooks import current_labels, emit_attention, hooks_active, labelled
from ds_ring.kernels.delta import OutputByDelta, row_delta
from ds_ring.kernels.dilated import Options, new_accumulators, regions_backward, regions_backward_, regions_forward_
from ds_ring.kernels.merge import accum_dtype
from ds_ring.kernels.sinks import add_sinks_, sinks_grad
from ds_ring.strategies.blocks import LazyGrads, Shard, add_home_grads_, backward_own_, head_chunks, unpack_block
from ds_ring.strategies.plan import ShardPlan, SpanPlan
from ds_ring.strategies.registry import PLUGINS

__all__ = [
    "Exchange",
    "CommSpec",
    "LazyGrads",
    "Options",
    "Shard",
    "register_exchange",
    "get_exchange",
    "exchanges",
    "sharded_attention",
    "sharded_forward",
    "sharded_backward",
]


@dataclass(frozen=True)
class CommSpec:
    """Where and how long to communicate: the sequence-parallel group and the wait bound in seconds."""

    group: ProcessGroup | None
    timeout_s: float | None


class Exchange(ABC):
    """How one spanning branch's K/V blocks reach the span's members, forward and backward.

    A subclass defines :meth:`forward` and :meth:`blocks_backward`; :meth:`backward` is the same for
    every exchange: the blocks' share first, then, with the exchange's buffers released, this member's block
    gradient, home, added into ``kv_grads()`` and the own runs after it.
    """

    @abstractmethod
    def forward(
        self, span: SpanPlan, shard: Shard, comm: CommSpec, opts: Options, overlap: Callable[[], None] | None
    ) -> None:
        """Merge attention over every member's block into ``shard.out``/``shard.lse``; call ``overlap()``
        once while the first transfer is in flight (local work to hide it behind)."""

    @abstractmethod
    def blocks_backward(
        self, span: SpanPlan, shard: Shard, dout: torch.Tensor, dq: LazyGrads, comm: CommSpec, opts: Options
    ) -> torch.Tensor | None:
        """The other members' blocks' share of the backward: accumulates into ``dq`` and returns this member's
        block gradient once home (flat, :func:`~ds_ring.strategies.blocks.pack_block` layout, accumulation
        dtype), or ``None`` when the branch moves no block (``span.hops == 0``)."""

    def backward(
        self,
        span: SpanPlan,
        shard: Shard,
        dout: torch.Tensor,
        dq: LazyGrads,
        kv_grads: LazyGrads,
        comm: CommSpec,
        opts: Options,
    ) -> None:
        """Accumulate into ``dq()`` (``dout``'s shape ``[B, L, H, D]``, accumulation dtype) and, once every
        member's contribution is home, into ``kv_grads()``."""
        home = self.blocks_backward(span, shard, dout, dq, comm, opts)
        dk, dv = kv_grads()
        if home is not None:  # added first, so its buffer is gone before the own runs' pieces exist
            add_home_grads_(span, unpack_block(span, span.index, home, shard.batch, shard.dims), dk, dv)
            del home
        backward_own_(span, shard, dout, dq, dk, dv, opts)


def register_exchange(name: str, exchange: Exchange) -> None:
    """Make ``exchange`` selectable as ``communication=name`` (in the one registry of plug-ins)."""
    PLUGINS.exchanges.register(name, exchange)


def exchanges() -> tuple[str, ...]:
    """Names of the registered exchanges."""
    return PLUGINS.exchanges.names()


def get_exchange(name: str) -> Exchange:
    """The exchange registered as ``name``; ``ValueError`` listing the choices otherwise."""
    return PLUGINS.exchanges.get(name)


def _exchange_name(exchange: Exchange) -> str:
    return PLUGINS.exchanges.name_of(exchange, type(exchange).__name__)


def _attention_event(exchange: Exchange, direction: str, phase: str, started: float = 0.0, **extra) -> None:
    emit_attention(_exchange_name(exchange), direction, phase, group_rank(None), started, **extra)


def sharded_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    plan: ShardPlan,
    exchange: Exchange,
    comm: CommSpec,
    opts: Options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of :func:`sharded_attention` (no autograd): ``out [B, L, H, Dv]`` in ``q``'s dtype and ``lse [B, L,
    H]``, with its attention events."""
    started = time.perf_counter()
    if hooks_active("start"):
        _attention_event(exchange, "forward", "start")
    out, lse = new_accumulators(q, v)

    def local_regions() -> None:
        regions_forward_(q, k, v, plan.local, out, lse, opts)

    overlap: Callable[[], None] | None = local_regions
    shard = Shard(q, k, v, out, lse)
    for span in plan.spans:
        for chunk, h, kv in head_chunks(span, shard):
            exchange.forward(chunk, shard.heads(h, kv), comm, opts, overlap)
            overlap = None
    if overlap is not None:
        overlap()
    if sinks is not None:
        add_sinks_(out, lse, sinks)
    out = out.to(q.dtype)
    if hooks_active():
        _attention_event(exchange, "forward", "end", started, out=out, lse=lse)
    return out, lse


def sharded_backward(
    saved: tuple[torch.Tensor, ...],
    sinks: torch.Tensor | None,
    plan: ShardPlan,
    exchange: Exchange,
    comm: CommSpec,
    opts: Options,
    sinks_wanted: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward of :func:`sharded_attention` (no autograd) from ``saved = (dout, q, k, v, out, lse)``: ``(dq, dk,
    dv, dsinks)`` in the inputs' dtypes (``dsinks``: ``None`` unless ``sinks_wanted``), with its attention events.
    ``out`` enters only through ``Delta = rowsum(dout ∘ out)``: it may be an
    :class:`~ds_ring.kernels.delta.OutputByDelta`, each call's stand-in then written where it is used."""
    started = time.perf_counter()
    dout, q, k, v, out, lse = saved
    if hooks_active("start"):
        _attention_event(exchange, "backward", "start")
    dout = dout.to(q.dtype)
    # Shard-local work first when one kernel call covers the shard: its dQ/dK/dV become the gradients.
    local = regions_backward((dout, q, k, v, out, lse), plan.local, opts)
    # Else zeroed only when a first piece is added (after the kernel call that made it).
    dq_grads = LazyGrads((q,), None if local is None else local[:1])
    kv_grads = LazyGrads((k, v), None if local is None else local[1:])
    shard = Shard(q, k, v, out, lse)
    for span in plan.spans:
        for chunk, h, kv in head_chunks(span, shard):
            exchange.backward(chunk, shard.heads(h, kv), dout[:, :, h], dq_grads.heads(h), kv_grads.heads(kv), comm,
                              opts)  # fmt: skip
    ((dq,), (dk, dv)) = dq_grads(), kv_grads()
    if local is None:
        regions_backward_((dout, q, k, v, out, lse), plan.local, (dq, dk, dv), opts)
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and sinks_wanted else None
    if hooks_active():
        _attention_event(exchange, "backward", "end", started)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


class _ShardedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: ShardPlan, exchange: Exchange, comm: CommSpec, opts: Options):
        out, lse = sharded_forward(q, k, v, sinks, plan, exchange, comm, opts)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (plan, exchange, comm, opts)
        ctx.labels = current_labels()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.to(q.dtype)
        # Only Delta = rowsum(dout ∘ out) is read: with saved tensors offloaded, the output's memory goes here.
        out = OutputByDelta(dout, row_delta(dout, out, accum_dtype(q.dtype)))
        with labelled(**ctx.labels):
            grads = sharded_backward((dout, q, k, v, out, lse), sinks, *ctx.args, ctx.needs_input_grad[3])
        return *grads, None, None, None, None


def sharded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ShardPlan,
    exchange: Exchange,
    comm: CommSpec,
    opts: Options,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention of local shards ``q [B, L, H, D]``, ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]``
    (with ``sinks [H]``: one sink logit per head, differentiable); returns ``(out [B, L, H, Dv], lse [B, L, H])``."""
    return _ShardedAttention.apply(q, k, v, sinks, plan, exchange, comm, opts)
