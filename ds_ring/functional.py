"""The functional API: attention on local sequence shards, with plain ``torch.distributed`` groups."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.groups import group_rank, group_size
from ds_ring.kernels.dilation import check_cu_seqlens
from ds_ring.strategies import CommSpec, get_exchange, plan_shards, sharded_attention
from ds_ring.strategies.call import AttentionCall, Output

__all__ = ["ring_dilated_attention", "ring_attention_call"]


def ring_dilated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    group: ProcessGroup | None = None,
    communication: str = "ring",
    layout: str = "contiguous",
    head_offset: int = 0,
    return_lse: bool = False,
    timeout_s: float | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> Output:
    """Dilated (or dense) attention over a sequence sharded across ``group``.

    Every rank passes its shard, made by :func:`ds_ring.shard_sequence` with the same ``layout``.

    Args:
        q: local shard ``[batch, seq/p, heads, head_dim]``; k, v: ``[batch, seq/p, kv_heads, head_dim]``.
        segment_lengths, dilation_rates: LongNet branches over the *global* sequence; ``None`` = dense.
            Segments may cross shard boundaries anywhere; only the kept rows of those that do travel.
        causal: causal mask by global position.
        group: the sequence-parallel process group (``None``: the default group).
        communication: ``"ring"`` (K/V passed rank to rank, O(seq/p) memory) or ``"allgather"``.
        layout: ``"contiguous"`` or ``"zigzag"`` (dense only; balances causal work).
        head_offset: global index of local head 0 (dilation offsets use global head indices).
        return_lse: also return ``lse [batch, heads, seq/p]`` (float32; float64 for float64 inputs).
        timeout_s: bound on every communication wait (``None``: 300 s, :data:`ds_ring.comm.DEFAULT_TIMEOUT_S`).
        cu_seqlens: document boundaries ``[0, e1, ..., seq]`` over the *global* sequence (1-D integers, the
            same on every rank): each document is attended as if alone; K/V of other documents are neither
            computed on nor sent. ``None``: one document.

    Returns:
        The local output shard ``[batch, seq/p, heads, head_dim]`` (and the LSE).

    Raises:
        ValueError: bad shapes (on this rank, before any communication); ranks whose calls differ
            (on every rank, after one small exchange on a plan's first call); an unsupported layout /
            segment / shard combination — all before any data moves.
    """
    call = AttentionCall(
        segment_lengths, dilation_rates, causal, scale, communication, layout, head_offset, return_lse, timeout_s,
        cu_seqlens,
    )  # fmt: skip
    return ring_attention_call(q, k, v, call, group)


def ring_attention_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall, group: ProcessGroup | None
) -> Output:
    """:func:`ring_dilated_attention` with its arguments as one :class:`AttentionCall` (same shapes, same checks)."""
    call.check("ring_dilated_attention", group, q, k, v)
    exchange = get_exchange(call.communication)
    world = group_size(group)
    plan = plan_shards(
        q.shape[1], q.shape[2], k.shape[2], group_rank(group), world, call.segment_lengths, call.dilation_rates,
        layout=call.layout, head_offset=call.head_offset, device=q.device, causal=call.causal,
        documents=check_cu_seqlens(call.cu_seqlens, q.shape[1] * world),
    )  # fmt: skip
    out, lse = sharded_attention(
        q, k, v, plan, exchange, CommSpec(group, call.timeout_s),
        causal=call.causal, scale=call.scale, head_offset=call.head_offset,
    )  # fmt: skip
    return (out, lse.transpose(1, 2)) if call.return_lse else out
