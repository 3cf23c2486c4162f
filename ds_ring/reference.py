"""The oracle: dilated attention with explicit masks in float64. Obviously correct, O(seq²), slow.

It shares no code with the kernels on purpose. A dilated attention is a sparse attention whose
pieces are its branches, so the reference builds one boolean mask per branch
``[branch, heads, query, key]``, lays the branches side by side along the key axis and takes a
single masked softmax over all ``(branch, key)`` pairs. That is the LSE merge of docs/design.md §The LSE merge
written as one softmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["dilated_attention_reference", "dilated_mask"]


def dilated_mask(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    causal: bool = False,
    head_offset: int = 0,
    window: int | None = None,
    bidirectional_spans: Sequence[tuple[int, int]] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean ``[branches, heads, seq, seq]``: may query ``i`` of head ``h`` see key ``j`` in a branch
    (with ``window``: only keys ``j`` with ``i - window < j <= i``; with ``bidirectional_spans`` ``[(a, b), ...]``
    and ``causal``: also every key of the query's own span, ``(causal OR same span) AND window``)."""
    pos = torch.arange(seq_len, device=device)
    masks = []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        w = min(w, seq_len)
        segment, in_segment = pos // w, pos % w
        same_segment = segment[:, None] == segment[None, :]
        per_head = []
        for h in range(num_heads):
            kept = in_segment % r == (head_offset + h) % r
            per_head.append(same_segment & kept[:, None] & kept[None, :])
        masks.append(torch.stack(per_head))
    mask = torch.stack(masks)
    if causal:
        visible = pos[None, :] <= pos[:, None]
        for a, b in bidirectional_spans or ():
            inside = (pos >= a) & (pos < b)
            visible |= inside[:, None] & inside[None, :]
        mask &= visible
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    return mask


def dilated_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segment_lengths: Sequence[int] | None = None,
    dilation_rates: Sequence[int] | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    head_offset: int = 0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    bidirectional_spans: Sequence[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference dilated attention; differentiable with plain autograd.

    Args: as :func:`ds_ring.dilated_attention` (``q [B, S, H, D]``, ``k [B, S, Hkv, D]``, ``v [B, S, Hkv, Dv]``);
    ``sinks [H]``: one more key per head with that score and value 0 (its own column of the softmax, uncapped);
    ``softcap``: every score ``s`` becomes ``softcap·tanh(s / softcap)`` before the softmax;
    ``bidirectional_spans``: ``(start, stop)`` pairs whose tokens see each other fully in a causal sequence.

    Returns:
        ``out [B, S, H, Dv]`` and ``lse [B, H, S]``, both float64; rows no branch covers have
        ``out = 0`` and ``lse = -inf`` (the sink's score with ``sinks``).
    """
    batch, seq_len, num_heads, head_dim = q.shape
    if segment_lengths is None:
        segment_lengths, dilation_rates = [seq_len], [1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = num_heads // k.shape[2]
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64).repeat_interleave(group, dim=2)
    v64 = v.to(torch.float64).repeat_interleave(group, dim=2)

    mask = dilated_mask(
        seq_len, num_heads, segment_lengths, dilation_rates, causal=causal, head_offset=head_offset, window=window,
        bidirectional_spans=bidirectional_spans, device=q.device,
    )  # fmt: skip
    branches = mask.shape[0]
    scores = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    # [B, H, S, branches * S]: every branch's copy of the keys side by side.
    scores = scores.unsqueeze(3).expand(-1, -1, -1, branches, -1).reshape(batch, num_heads, seq_len, -1)
    mask = mask.permute(1, 2, 0, 3).reshape(num_heads, seq_len, -1).expand(batch, -1, -1, -1)
    values = v64.repeat(1, branches, 1, 1)  # [B, branches * S, H, Dv], branch-major like the keys
    if sinks is not None:  # one more column: score sinks[h], value 0, always visible
        sink = sinks.to(torch.float64).view(1, num_heads, 1, 1).expand(batch, -1, seq_len, 1)
        scores = torch.cat([scores, sink], dim=-1)
        mask = torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)
        values = torch.cat([values, torch.zeros_like(values[:, :1])], dim=1)
    has_key = mask.any(-1)

    # Rows with no key get finite dummy scores so autograd never sees -inf - -inf.
    safe = torch.where(mask, scores, torch.zeros_like(scores))
    safe = torch.where(has_key.unsqueeze(-1) & ~mask, torch.full_like(scores, -math.inf), safe)
    lse = torch.logsumexp(safe, dim=-1)
    probs = torch.where(mask, torch.exp(safe - lse.unsqueeze(-1)), torch.zeros_like(scores))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, values)
    lse = torch.where(has_key, lse, torch.full_like(lse, -math.inf))
    return out, lse
