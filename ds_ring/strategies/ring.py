"""Strategies ``ring`` and ``allgather``: K/V move between the sequence shards themselves.

Every rank of the sequence-parallel group keeps all heads of its shard; each branch's segments are
local or span ranks (:mod:`ds_ring.strategies.plan`), and the K/V rows of spanning segments move by an
*exchange*: passed rank to rank (``communication="ring"``, O(seq/p) memory) or gathered at once
(``"allgather"``). Strategy ``allgather`` is the same with the exchange fixed to all-gather.
"""

from __future__ import annotations

from ds_ring.kernels.dilated import Options
from ds_ring.strategies.base import AttentionCall, Bound, Degrees, Shape, Strategy, Target
from ds_ring.strategies.plan import plan_shards
from ds_ring.strategies.sharded import CommSpec, get_exchange, sharded_attention

__all__ = ["SequenceShards"]


class SequenceShards(Strategy):
    """K/V blocks move between sequence shards by ``communication`` (``exchange``: the one it must be, if fixed)."""

    def __init__(self, name: str, exchange: str | None = None) -> None:
        self.name = name
        self.exchange = exchange

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
