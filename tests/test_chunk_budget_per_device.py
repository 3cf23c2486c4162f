"""A dense span splits into one ring per K/V head from a per-device byte budget (issue 33, defect 8): the CPU's
2 MiB, measured there, would make every dense span of a GPU run ``kv_heads`` sequential rings (32K tokens,
head dim 128, bf16: 16 MiB of K/V per head)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ds_ring.strategies import blocks

TOKENS, HEAD_DIM, KV_HEADS = 32768, 128, 8


def _span_and_shard(device: str):
    """A dense span (one head group, rate 1) whose largest block is 32K tokens of K and V for every K/V head."""
    k = SimpleNamespace(shape=(1, TOKENS, KV_HEADS, HEAD_DIM), device=torch.device(device), element_size=lambda: 2)
    span = SimpleNamespace(groups=(SimpleNamespace(rate=1),), members=(0, 1),
                           block_numel=lambda m, batch, *dims: 2 * TOKENS * KV_HEADS * HEAD_DIM)  # fmt: skip
    shard = SimpleNamespace(q=SimpleNamespace(shape=(1, TOKENS, 32, HEAD_DIM)), k=k, batch=1, dims=())
    return span, shard


def test_budget_is_per_device_type():
    assert blocks.chunk_bytes(torch.device("cpu")) == 2 * 2**20
    assert blocks.chunk_bytes(torch.device("cuda", 0)) == 256 * 2**20
    assert blocks.chunk_bytes(torch.device("xpu")) == blocks.CHUNK_BYTES["cuda"]


def test_gpu_keeps_a_32k_bf16_dense_span_whole():
    span, shard = _span_and_shard("cuda")
    assert blocks.head_chunks(span, shard) == [(span, slice(None), slice(None))]


def test_cpu_budget_still_splits_the_same_span():
    """On the CPU budget the same block is past 2 MiB per head: it would split (the split itself is checked
    against the reference in test_ring_buffers)."""
    span, shard = _span_and_shard("cpu")
    per_head = span.block_numel(0, 1) * 2 // KV_HEADS
    assert per_head == 16 * 2**20 and per_head >= blocks.chunk_bytes(torch.device("cpu"))
    assert per_head < blocks.chunk_bytes(torch.device("cuda"))
