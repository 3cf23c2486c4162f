"""On a CUDA machine (``pytest -m cuda``; skipped without one): the block kernels a GPU runs, and their memory.

- every kernel this GPU can run (FlashAttention-2 where :func:`~ds_ring.kernels.block.kernel_for` allows it,
  the memory-efficient kernel, the tiled pure-torch kernel) in fp16 / bf16 / fp32 (pure torch also fp64)
  against the fp64 oracle: out, LSE and dq/dk/dv, causal and not, m != n, head dims and rows that need padding;
- dense causal attention at 64K tokens, one process, forward + backward on each kernel the GPU picks (bf16, fp32)
  and on ``DS_RING_KERNEL=torch``: ``torch.cuda.max_memory_allocated`` above q, k, v and dout grows by at most 8
  q-shards, and with a fused kernel by at most a quarter q-shard more than PyTorch's own SDPA on the same inputs.

First run on an NVIDIA H200 (torch 2.11, CUDA 13): docs/gpu.md, "What a GPU run found".
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ds_ring
from ds_ring.kernels import block, chunked, fused
from tests.block_cases import SHAPES, check_against_oracle

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with -m cuda on a GPU machine)"),
]

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TOLERANCE = {F64: 1e-12, F32: 1e-4, F16: 1e-2, BF16: 3e-2}


def _facts() -> block.GpuFacts:
    return block.gpu_facts(torch.cuda.current_device())


def _runnable() -> list[tuple[object, torch.dtype]]:
    """(kernel, dtype) pairs this GPU runs: those kernel_for would pick for some head dim, and pure torch."""
    if not torch.cuda.is_available():
        return []
    facts, pairs = _facts(), []
    for dtype in (F16, BF16, F32):
        if block.kernel_for("cuda", dtype, 64, facts) is fused.CUDA_FLASH:
            pairs.append((fused.CUDA_FLASH, dtype))
        if block.kernel_for("cuda", dtype, 512, facts) is fused.CUDA_EFFICIENT:  # beyond FlashAttention-2
            pairs.append((fused.CUDA_EFFICIENT, dtype))
    return pairs + [(chunked.CHUNKED, dtype) for dtype in (F16, BF16, F32, F64)]


@pytest.mark.parametrize(("kernel", "dtype"), _runnable(), ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize(("shape", "causal"), SHAPES)
def test_cuda_kernel_matches_oracle(kernel, dtype, shape, causal):
    check_against_oracle(kernel, dtype, shape, causal, "cuda", TOLERANCE[dtype])


@pytest.mark.parametrize(("kernel", "dtype"), _runnable(), ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize(("shape", "causal"), SHAPES)
def test_cuda_kernel_on_token_major_views_matches_oracle(kernel, dtype, shape, causal):
    """``[b, h, s, d]`` views of ``[b, s, h, d]`` shards go to the kernels uncopied (``fused._padded``)."""
    check_against_oracle(kernel, dtype, shape, causal, "cuda", TOLERANCE[dtype], token_major=True)


@pytest.mark.parametrize(("kernel", "dtype"), _runnable(), ids=lambda x: getattr(x, "name", str(x)))
@pytest.mark.parametrize("v_head_dim", [12, 36])
def test_cuda_kernel_with_value_head_dim_matches_oracle(kernel, dtype, v_head_dim):
    """Multi-head latent attention: ``v``'s head dim smaller / larger than q/k's 20 (flash: zero-padded)."""
    for shape, causal in (((1, 2, 40, 20, 40), True), ((2, 3, 17, 20, 33), False)):
        check_against_oracle(kernel, dtype, shape, causal, "cuda", TOLERANCE[dtype], v_head_dim=v_head_dim)


@pytest.mark.parametrize("dtype", [BF16, F32, F64], ids=str)
def test_cuda_softcap_runs_the_tiled_kernel(dtype):
    assert block.select_kernel(torch.device("cuda"), dtype, 64, softcap=True) is chunked.CHUNKED
    for shape, causal in SHAPES:
        check_against_oracle(chunked.CHUNKED, dtype, shape, causal, "cuda", TOLERANCE[dtype], softcap=1.5)


def _extra_q_shards(attend, q, k, v, dout) -> float:
    """Peak bytes allocated by one forward + backward above what q, k, v and dout hold, in q-shards."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attend(q, k, v).backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    q.grad = k.grad = v.grad = None
    return extra / (q.numel() * q.element_size())


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("dtype", "override"), [(BF16, None), (F32, None), (F32, "torch")], ids=str)
def test_dense_64k_forward_backward_memory(monkeypatch, dtype, override):
    if override is None:
        monkeypatch.delenv("DS_RING_KERNEL", raising=False)
    else:
        monkeypatch.setenv("DS_RING_KERNEL", override)
    seq, heads, head_dim = 65536, 8, 64
    q, k, v = (torch.randn(1, seq, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    extra = _extra_q_shards(lambda *qkv: ds_ring.dilated_attention(*qkv, causal=True), q, k, v, dout)
    kernel = block.select_kernel(q.device, dtype, head_dim).name
    assert extra <= 8, f"{kernel}: {extra:.2f} q-shards"
    if override is None:  # a fused kernel: what PyTorch's SDPA takes, give or take a quarter q-shard (the LSE)
        sdpa = _extra_q_shards(_sdpa, q, k, v, dout)
        assert extra <= sdpa + 0.25, f"{kernel}: {extra:.2f} q-shards, SDPA {sdpa:.2f}"
