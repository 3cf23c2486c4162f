"""A sliding-window layer is a few batched ops, not a Python loop over band pieces (issue 33, defect 7): ops
dispatched (what a GPU launches, roughly) for one layer's forward + backward, one process, counted by a
TorchDispatchMode. The shapes are the issue's (16,384 tokens, 8 heads × 64, GPT-OSS's window 128), run on
meta tensors: op count without the arithmetic."""

from __future__ import annotations

import pytest
import torch

import ds_ring
from ds_ring.kernels import window as window_kernel
from tests.op_count import OpCount

SEQ, HEADS, DIM, WINDOW = 16384, 8, 64, 128


def _layer_ops(window: int | None, seq: int = SEQ, device: str = "meta") -> int:
    q, k, v = (torch.randn(1, seq, HEADS, DIM, device=device, requires_grad=True) for _ in range(3))
    window_kernel._hidden.cache_clear()  # count the band masks too (made once per geometry)
    window_kernel._additive.cache_clear()
    with OpCount() as ops:
        out = ds_ring.dilated_attention(q, k, v, causal=True, window=window)
        out.backward(torch.ones_like(out))
    return ops.total


@pytest.mark.parametrize("fused", [True, False], ids=["cpu_fused", "batched"])
def test_windowed_layer_is_a_few_hundred_ops(fused, monkeypatch):
    """Both band paths: the fused CPU flash kernel (CPU and meta tensors) and the masked batched matmuls (other
    devices)."""
    if not fused:
        monkeypatch.setattr(window_kernel, "_fused", lambda *args: False)
    assert _layer_ops(WINDOW) <= 300  # was 33,881 (a loop over ~4,800 band pieces)


def test_window_ops_grow_with_byte_budget_groups_not_tokens():
    """4× the tokens: two groups of blocks instead of one (BAND_BYTES), not 4× the ops."""
    assert _layer_ops(WINDOW, seq=SEQ // 4) == _layer_ops(WINDOW, seq=SEQ)
    assert _layer_ops(WINDOW, seq=4 * SEQ) < 2 * _layer_ops(WINDOW, seq=SEQ)


def test_dense_causal_layer_stays_small(monkeypatch):
    monkeypatch.setenv("DS_RING_KERNEL", "cpu_flash")  # what a CPU runs (meta tensors get the tiled kernel)
    assert _layer_ops(None) <= 150


@pytest.mark.parametrize("window", [1, 3, 128, 300])
def test_ops_per_layer_do_not_depend_on_the_window(window):
    assert _layer_ops(window, seq=2048) <= 300


def test_blocks_go_in_groups_within_the_byte_budget(monkeypatch):
    """A longer run than the budget holds takes more groups (each a few ops), never a score tensor beyond it
    (the batched path's groups; the fused CPU kernel holds no score tensor)."""
    monkeypatch.setattr(window_kernel, "_fused", lambda *args: False)
    geo = window_kernel._bands(SEQ, SEQ, 0, WINDOW)
    per_block = HEADS * geo.block * geo.band * 4
    monkeypatch.setattr(window_kernel, "BAND_BYTES", 8 * per_block)
    assert window_kernel._group_size(geo, HEADS, torch.float32) == 8
    assert _layer_ops(WINDOW, seq=2048) > _layer_ops(WINDOW, seq=512)
