"""``nn.Module``\\ s a model calls with its local sequence shard.

``RingDilatedAttention`` is attention over local ``q/k/v`` shards (the "local attention" a
DeepSpeed ``DistributedAttention`` can wrap); ``MultiheadRingDilatedAttention`` adds the input and
output projections and is a drop-in attention for a transformer block (``batch_first``, the call
convention of ``nn.MultiheadAttention``).

``RingDilatedAttention`` holds *how* to attend as one :class:`ds_ring.strategies.AttentionCall` plus
where (group or topology, strategy), so a trainer can install a strategy into every module of a
model after building it (:meth:`RingDilatedAttention.configure`); every forward goes through the
entry layer (:func:`ds_ring.calls.attend`), prepared once per key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ds_ring.calls import attend, group_placement, topology_placement
from ds_ring.comm.group_ranks import group_size
from ds_ring.compiler.attention_op import compiled_module_call, module_handle
from ds_ring.engine.gradient_scale import require_marked
from ds_ring.parallel.topology import Topology
from ds_ring.strategies import DEFAULT_STRATEGY, AttentionCall

__all__ = ["RingDilatedAttention", "MultiheadRingDilatedAttention"]


class RingDilatedAttention(nn.Module):
    """Dilated attention over the local shard of a sequence sharded across ``group``.

    Args:
        segment_lengths, dilation_rates: LongNet branches over the *global* sequence (``None``: dense).
        causal: causal mask by global position.
        communication: ``"ring"`` or ``"allgather"`` (``None``: the strategy's default, see
            :func:`ds_ring.sequence_parallel_attention`).
        layout: ``"contiguous"`` or ``"zigzag"`` (how the sequence was sharded).
        group: sequence-parallel process group (``None``: the default group, or a single process
            when ``torch.distributed`` is not initialised). Ignored when ``topology`` is given.
        topology: a :class:`ds_ring.Topology`; attention then runs over its sequence-parallel group
            with ``strategy``.
        strategy: ``"ring"``, ``"allgather"``, ``"ulysses"``, ``"hybrid"`` (with ``topology``).
        scale: softmax scale (default ``1/sqrt(head_dim)``).
        head_offset: global index of local head 0.
        timeout_s: bound in seconds on every communication wait (``None``: the topology's; 300 s on a group).
        window: causal sliding window (dense, ``causal=True``): query ``i`` sees keys ``[i - window + 1, i]``.
        softcap: attention logit soft-cap (Gemma 2): scores ``s`` become ``softcap·tanh(s / softcap)``.

    Shapes: ``forward(q [B, L, H, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv], *, cu_seqlens=None, sinks=None,
    bidirectional_spans=None, prefix_lengths=None) -> [B, L, H, Dv]`` (``Dv``: ``v``'s head dim, which may differ from
    ``D``: multi-head latent attention); ``cu_seqlens``: document boundaries of a packed sequence over the global
    sequence (see :func:`ds_ring.ring_dilated_attention`); ``sinks [H]``: attention-sink logits;
    ``bidirectional_spans`` / ``prefix_lengths``: spans of this batch that see themselves fully inside the causal
    sequence (image tokens, prefix-LM; see :func:`ds_ring.sequence_parallel_attention`).
    """

    def __init__(
        self,
        segment_lengths: Sequence[int] | None = None,
        dilation_rates: Sequence[int] | None = None,
        *,
        causal: bool = False,
        communication: str | None = None,
        layout: str = "contiguous",
        group: ProcessGroup | None = None,
        topology: Topology | None = None,
        strategy: str = DEFAULT_STRATEGY,
        scale: float | None = None,
        head_offset: int = 0,
        timeout_s: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.call = _validated(AttentionCall.of(locals()))
        self.group = group
        self.topology = topology
        self.strategy = strategy
        self._compile_handle = module_handle(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._compile_handle = module_handle(self)  # a copy's own (copy.deepcopy, pickle)

    _PLACEMENT = frozenset({"group", "topology", "strategy"})
    _SETTINGS = _PLACEMENT | {"communication", "layout", "timeout_s", "causal", "head_offset", "segment_lengths",
                              "dilation_rates", "window", "softcap"}  # fmt: skip

    def configure(self, **settings: Any) -> None:
        """Change how this module computes and communicates (any constructor argument but ``scale``)."""
        unknown = set(settings) - self._SETTINGS
        if unknown:
            raise ValueError(f"RingDilatedAttention.configure() got unknown setting(s) {sorted(unknown)}")
        fields = {name: value for name, value in settings.items() if name not in self._PLACEMENT}
        self.call = _validated(dataclasses.replace(self.call, **fields))
        for name in self._PLACEMENT & set(settings):
            setattr(self, name, settings[name])

    segment_lengths = property(lambda self: self.call.segment_lengths, doc="LongNet segment lengths (``None``: dense).")
    dilation_rates = property(lambda self: self.call.dilation_rates, doc="Dilation rate per segment (``None``: dense).")
    causal = property(lambda self: self.call.causal, doc="Causal mask by global position.")
    scale = property(lambda self: self.call.scale, doc="Softmax scale (``None``: ``1/sqrt(head_dim)``).")
    head_offset = property(lambda self: self.call.head_offset, doc="Global index of local head 0.")
    communication = property(lambda self: self.call.communication, doc="How K/V move along the ring.")
    layout = property(lambda self: self.call.layout, doc="How the sequence was sharded.")
    timeout_s = property(lambda self: self.call.timeout_s, doc="Bound on every communication wait, in seconds.")
    window = property(lambda self: self.call.window, doc="Causal sliding window (``None``: none).")
    softcap = property(lambda self: self.call.softcap, doc="Attention logit soft-cap (``None``: uncapped).")

    @property
    def parallel_size(self) -> int:
        """Ranks the sequence is sharded over (the topology's sequence-parallel group, or ``group``)."""
        return self.topology.get_sequence_parallel_world_size() if self.topology is not None else group_size(self.group)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        bidirectional_spans: torch.Tensor | Sequence | None = None,
        prefix_lengths: int | Sequence[int] | None = None,
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one custom op the compiler holds whole (ds_ring/compiler/attention_op.py)
            return compiled_module_call(
                self._compile_handle, q, k, v, cu_seqlens=cu_seqlens, sinks=sinks,
                bidirectional_spans=bidirectional_spans, prefix_lengths=prefix_lengths,
            )  # fmt: skip
        return self.eager_forward(
            q, k, v, cu_seqlens=cu_seqlens, sinks=sinks, bidirectional_spans=bidirectional_spans,
            prefix_lengths=prefix_lengths,
        )  # fmt: skip

    def eager_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        sinks: torch.Tensor | None = None,
        bidirectional_spans: torch.Tensor | Sequence | None = None,
        prefix_lengths: int | Sequence[int] | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` as eager mode runs it (inside ``ds_ring::attention`` when compiled); ``return_lse``:
        also ``lse [B, H, L]``."""
        call = self.call
        if cu_seqlens is not None or sinks is not None or bidirectional_spans is not None or prefix_lengths is not None:
            call = dataclasses.replace(
                call, cu_seqlens=cu_seqlens, sinks=sinks, bidirectional_spans=bidirectional_spans,
                prefix_lengths=prefix_lengths,
            )  # fmt: skip
        if return_lse:
            call = dataclasses.replace(call, return_lse=True)
        if self.topology is not None:
            return attend(q, k, v, call, topology_placement(self.topology), self.strategy)
        return attend(q, k, v, call, group_placement(self.group), DEFAULT_STRATEGY, op="ring_dilated_attention")

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, causal={self.causal}, "
            f"strategy={self.strategy!r}, communication={self.communication!r}, layout={self.layout!r}"
        )


def _validated(call: AttentionCall) -> AttentionCall:
    """``call`` with its branch lists validated and its other options checked (at build time, so a typo fails
    before the first forward)."""
    call = call.validated()
    call.check_options()
    return call


class MultiheadRingDilatedAttention(nn.Module):
    """Multi-head (grouped-query) ring dilated attention with input and output projections.

    Args:
        embed_dim: model width ``E``; ``num_heads`` must divide it.
        num_heads: query heads ``H``; num_kv_heads: key/value heads (default ``H``; must divide ``H``).
        bias: biases on the projections. batch_first: ``[B, L, E]`` inputs (``False``: ``[L, B, E]``).
        sinks: a learned attention-sink logit per head (GPT-OSS; ``self.sinks [H]``, initialised to 0).
        device, dtype: for the parameters.
        **attention: passed to :class:`RingDilatedAttention` (segments, rates, causal, group, ...).

    ``forward(query, key=None, value=None, *, cu_seqlens=None, bidirectional_spans=None, prefix_lengths=None)`` takes
    the local shard ``[B, L, E]`` (self-attention when ``key``/``value`` are omitted; ``cu_seqlens``: packed documents
    over the global sequence; the spans as :class:`RingDilatedAttention`) and returns ``(output [B, L, E], None)`` like
    ``nn.MultiheadAttention`` with ``need_weights=False``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        bias: bool = True,
        batch_first: bool = True,
        sinks: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **attention: Any,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.batch_first = batch_first
        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None
        self.attention = RingDilatedAttention(**attention)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        bidirectional_spans: torch.Tensor | Sequence | None = None,
        prefix_lengths: int | Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, None]:
        if need_weights or attn_mask is not None or key_padding_mask is not None:
            raise ValueError(
                "MultiheadRingDilatedAttention never forms attention weights and takes no masks: pass "
                "need_weights=False, attn_mask=None, key_padding_mask=None (use causal=True for causal attention)"
            )
        if is_causal and not self.attention.causal:
            raise ValueError("is_causal=True but this module was built with causal=False; build it with causal=True")
        require_marked(self.q_proj.weight, self.attention.parallel_size, where=type(self).__name__)
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        batch, seq = query.shape[:2]
        q = self.q_proj(query).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(batch, seq, self.num_kv_heads, self.head_dim)
        out = self.attention(
            q, k, v, cu_seqlens=cu_seqlens, sinks=self.sinks, bidirectional_spans=bidirectional_spans,
            prefix_lengths=prefix_lengths,
        ).reshape(batch, seq, self.embed_dim)  # fmt: skip
        out = self.out_proj(out)
        return (out if self.batch_first else out.transpose(0, 1)), None
