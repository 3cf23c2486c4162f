"""One entry point for sequence-parallel attention: a strategy chosen by name, over a Topology.

A *strategy* is a function ``(q, k, v, topology, call) -> out | (out, lse)`` registered under a
name. The strategy modules (``ds_ring/strategies``) take plain process groups; registering one
binds it to the topology's groups. A new strategy is one module there plus one
:func:`register_strategy` call.

Built-in strategies, all on shards made by ``ds_ring.shard_sequence(x, group=topology.sequence_parallel_group)``
and all returning the output shard for the same positions:

- ``ring`` / ``allgather``: :func:`ds_ring.ring_dilated_attention` over the sequence-parallel
  group with that communication;
- ``ulysses``: all-to-all over the whole sequence-parallel group (``heads % (ulysses × ring) == 0``);
- ``hybrid``: all-to-all inside the ulysses group, ring dilated attention across the ring group
  (``heads % ulysses == 0``); ``communication`` chooses how the ring dimension moves K/V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ds_ring.functional import ring_attention_call
from ds_ring.registry import Registry
from ds_ring.strategies import get_exchange
from ds_ring.strategies.call import AttentionCall, Output
from ds_ring.strategies.hybrid import hybrid_attention_call
from ds_ring.strategies.ulysses import ulysses_attention_call
from ds_ring.topology import Topology

__all__ = [
    "AttentionCall",
    "Strategy",
    "register_strategy",
    "get_strategy",
    "strategy_names",
    "sequence_parallel_attention",
    "sequence_parallel_call",
]

Strategy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Topology, AttentionCall], Output]

_STRATEGIES: Registry[Strategy] = Registry("strategy")


def register_strategy(name: str, strategy: Strategy) -> None:
    """Make ``strategy`` selectable as ``strategy=name``.

    It must raise ``ValueError`` for anything it cannot do before it communicates.
    """
    _STRATEGIES.register(name, strategy)


def strategy_names() -> tuple[str, ...]:
    """Names of the registered strategies."""
    return _STRATEGIES.names()


def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``; ``ValueError`` listing the choices otherwise."""
    return _STRATEGIES.get(name)


def sequence_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    topology: Topology,
    strategy: str = "ring",
    communication: str = "ring",
    layout: str = "contiguous",
    head_offset: int = 0,
    return_lse: bool = False,
    timeout_s: float | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> Output:
    """Dilated (or dense) attention over a sequence sharded across ``topology.sequence_parallel_group``.

    Args:
        q: local shard ``[batch, seq/p, heads, head_dim]``; k, v: ``[batch, seq/p, kv_heads, head_dim]``,
            made by ``ds_ring.shard_sequence(x, group=topology.sequence_parallel_group, layout=layout)``.
        segment_lengths, dilation_rates: LongNet branches over the global sequence; ``None``: dense.
        causal: causal mask by global position.
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        topology: the process groups (:class:`ds_ring.Topology`).
        strategy: ``"ring"``, ``"allgather"``, ``"ulysses"``, ``"hybrid"`` or any registered one.
        communication: how the ring dimension moves K/V (``"ring"`` or ``"allgather"``) for ``ring`` and
            ``hybrid``; ``allgather`` always all-gathers and ``ulysses`` has no ring dimension.
        layout: ``"contiguous"`` or ``"zigzag"``; zigzag with dilation works for ``ulysses`` (and ``hybrid``
            with ring degree 1), the ring dimension of the others supports it for dense attention only.
        head_offset: global index of local head 0 (dilation offsets use global head indices).
        return_lse: also return ``lse [batch, heads, seq/p]`` (float32; float64 for float64 inputs).
        timeout_s: bound on every communication wait (``None``: ``topology.timeout_s``).
        cu_seqlens: document boundaries ``[0, e1, ..., seq]`` of a packed sequence over the *global*
            sequence (1-D integers, the same on every rank and batch row): each document is attended as
            if alone, on every strategy and layout. ``None``: one document.

    Returns:
        The local output shard ``[batch, seq/p, heads, head_dim]`` in the input dtype (and the LSE).

    Raises:
        ValueError: bad shapes (on this rank, before any communication); ranks whose calls differ in
            anything (on every rank, naming the field and each rank's value, after one small exchange
            on a plan's first call); an unknown strategy or communication, or anything the strategy
            cannot do (heads not divisible by the all-to-all degree, unsupported branches or layout)
            — all before any data moves.
    """
    call = AttentionCall(
        segment_lengths, dilation_rates, causal, scale, communication, layout, head_offset, return_lse, timeout_s,
        cu_seqlens,
    )  # fmt: skip
    return sequence_parallel_call(q, k, v, call, topology, strategy)


def sequence_parallel_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, topology: Topology, strategy: str = "ring"
) -> Output:
    """:func:`sequence_parallel_attention` with its arguments as one :class:`AttentionCall` (same shapes,
    same checks); a call naming no timeout is bounded by ``topology.timeout_s``."""
    if call.timeout_s is None:
        call = dataclasses.replace(call, timeout_s=topology.timeout_s)
    call.check(
        "sequence_parallel_attention", topology.sequence_parallel_group, q, k, v,
        strategy=strategy, communication=call.communication,
    )  # fmt: skip
    run = get_strategy(strategy)
    get_exchange(call.communication)
    return run(q, k, v, topology, call)


def _sequence_ring(communication: str | None) -> Strategy:
    """K/V move between the sequence shards: by ``communication`` (``None``: the call's choice)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology: Topology, call: AttentionCall) -> Output:
        if communication is not None:
            call = dataclasses.replace(call, communication=communication)
        return ring_attention_call(q, k, v, call, topology.sequence_parallel_group)

    return run


def _ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology: Topology, call: AttentionCall) -> Output:
    sp = topology.layout.sequence_parallel
    if q.dim() == 4 and q.shape[2] % sp:
        raise ValueError(
            f"strategy 'ulysses' splits the {q.shape[2]} heads over the whole sequence-parallel group (ulysses "
            f"{topology.ulysses} × ring {topology.ring} = {sp} ranks), so heads must be a multiple of {sp}; use "
            f"strategy 'hybrid' (heads must be a multiple of the ulysses degree only) or 'ring'"
        )
    return ulysses_attention_call(q, k, v, call, topology.sequence_parallel_group)


def _hybrid(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topology: Topology, call: AttentionCall) -> Output:
    return hybrid_attention_call(q, k, v, call, topology.ulysses_group, topology.ring_group)


register_strategy("ring", _sequence_ring(None))
register_strategy("allgather", _sequence_ring("allgather"))
register_strategy("ulysses", _ulysses)
register_strategy("hybrid", _hybrid)
