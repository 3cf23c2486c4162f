"""Hybrid: Ulysses inside each ulysses group, ring dilated attention across the ring group.

Sequence-parallel rank ``r·U + u`` holds shard ``r·U + u`` of ``L`` rows. The all-to-all inside a
ulysses group (``U`` consecutive shards) gives rank ``(r, u)`` the ``U·L`` consecutive rows of
block ``r`` for heads ``[u·H/U, (u+1)·H/U)``; the ring group (same ``u``, ``r = 0..R-1``) then
holds consecutive blocks in order, so the ring dimension is :func:`sharded_attention` over the
ring group on shards of ``U·L`` rows with ``head_offset + u·H/U``, and a ring exchange
(``communication``) moves the K/V between blocks. Forward and backward compose through autograd:
all-to-all, sharded attention (its own backward ring), all-to-all back.

With ``zigzag`` shards of the sequence-parallel group, the rows a rank gathers are chunks ``r``
and ``2R-1-r`` of ``2R``: the ring group's own zigzag layout, so dense causal work stays balanced.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.groups import group_rank, group_size
from ds_ring.kernels.dilation import Branch, check_cu_seqlens, make_branches
from ds_ring.strategies.call import AttentionCall, Output
from ds_ring.strategies.plan import plan_shards
from ds_ring.strategies.sharded import CommSpec, get_exchange, sharded_attention
from ds_ring.strategies.ulysses import attend_local_heads, check_layout, heads_to_sequence, split_heads, to_heads

__all__ = ["hybrid_attention_call"]


def hybrid_attention_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    ulysses_group: ProcessGroup | None,
    ring_group: ProcessGroup | None,
) -> Output:
    """Dilated (or dense) attention over a sequence sharded across ``ulysses × ring`` ranks.

    Args:
        q: local shard ``[batch, seq/p, heads, head_dim]`` with ``heads % U == 0``;
            k, v: ``[batch, seq/p, kv_heads, head_dim]`` (fewer K/V heads than ``U`` are replicated).
        call: the other arguments (see :func:`ds_ring.ring_dilated_attention`); ``communication`` moves
            K/V along the ring dimension; ``layout="zigzag"`` with ``R > 1`` is for dense attention only.
        ulysses_group: the ``U`` ranks of this all-to-all, holding consecutive shards in rank order.
        ring_group: the ``R`` ranks with this ulysses index, in sequence order.

    Returns:
        The local output shard ``[batch, seq/p, heads, head_dim]`` (and, with ``call.return_lse``, the LSE).

    Raises:
        ValueError: bad shapes (on this rank, before any communication); ranks whose calls differ
            (on every rank of ``ulysses × ring``, naming the field and each rank's value); heads not
            divisible by ``U``, an unknown communication, or a branch / layout the ring dimension
            cannot shard — all before any data moves.
    """
    call.check("hybrid_attention", (ulysses_group, ring_group), q, k, v)
    exchange = get_exchange(call.communication)
    degree, ring_size = group_size(ulysses_group), group_size(ring_group)
    split = split_heads(q.shape[2], k.shape[2], degree, q.device)
    check_layout(call.layout, q.shape[1])
    block = q.shape[1] * degree
    offset = call.head_offset + group_rank(ulysses_group) * split.heads
    segment_lengths, dilation_rates = call.segment_lengths, call.dilation_rates
    branches = make_branches(block * ring_size, segment_lengths, dilation_rates)
    documents = check_cu_seqlens(call.cu_seqlens, block * ring_size)
    plan = None
    if ring_size > 1:
        if call.layout == "zigzag" and any(b != Branch(block * ring_size, 1) for b in branches):
            raise ValueError(
                f"strategy 'hybrid' with a ring degree of {ring_size} supports layout='zigzag' for dense attention "
                f"only, got segment_lengths={segment_lengths} dilation_rates={dilation_rates}; use "
                f"layout='contiguous', or strategy 'ulysses', which supports zigzag with dilation"
            )
        plan = plan_shards(
            block, split.heads, split.kv_heads, group_rank(ring_group), ring_size, segment_lengths, dilation_rates,
            layout=call.layout, head_offset=offset, device=q.device, causal=call.causal, documents=documents,
        )  # fmt: skip
    qh, kh, vh = to_heads(q, k, v, split, ulysses_group, layout=call.layout, timeout_s=call.timeout_s)
    if plan is None:
        out, lse = attend_local_heads(qh, kh, vh, call, head_offset=offset, strategy="hybrid", documents=documents)
    else:
        out, lse = sharded_attention(
            qh, kh, vh, plan, exchange, CommSpec(ring_group, call.timeout_s),
            causal=call.causal, scale=call.scale, head_offset=offset,
        )  # fmt: skip
    return heads_to_sequence(out, lse, split, ulysses_group, call)
