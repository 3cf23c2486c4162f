"""A small GPT-style causal language model whose attention is ds_ring's (the main job's model)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

import ds_ring

__all__ = ["TinyGPT"]


class Block(nn.Module):
    """Pre-norm transformer block: ring dilated self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, **attention) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ds_ring.MultiheadRingDilatedAttention(dim, heads, kv_heads, **attention)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, a linear output head.

    ``forward(tokens [B, L], positions [L]) -> logits [B, L, vocab]`` on the local shard: positions
    are the shard's *global* positions (``ds_ring.shard_sequence(torch.arange(seq), dim=0)``).
    """

    def __init__(
        self,
        vocab: int,
        dim: int,
        heads: int,
        layers: int,
        max_seq: int,
        *,
        kv_heads: int | None = None,
        segment_lengths: Sequence[int] | None = None,
        dilation_rates: Sequence[int] | None = None,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_seq, dim)
        attention = dict(segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=causal)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads or heads, **attention) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        # Untied: under ZeRO-3 a weight read outside its own module's forward is not gathered.
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
