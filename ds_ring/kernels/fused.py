"""PyTorch's fused attention kernels that return the LSE, as block kernels (:mod:`ds_ring.kernels.base`).

- ``cpu_flash``: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (fp64, fp32, bf16, fp16).
- ``cuda_flash``: FlashAttention-2, ``_scaled_dot_product_flash_attention`` (fp16, bf16; sm80+, head_dim up
  to 256, 192 on sm86-89 and sm120-121: :func:`ds_ring.kernels.block.kernel_for` decides).
- ``cuda_efficient``: the memory-efficient (CUTLASS) kernel, ``_scaled_dot_product_efficient_attention``
  (fp32, and fp16/bf16 where FlashAttention-2 cannot run).

None of them forms a score matrix. No attention bias, no dropout (so the random-state tensors the backward
takes are never read). The CUDA kernels get a head dim zero-padded to a multiple of 8 (zero columns change
no score and give zero output columns, cut off again; the scale is always passed explicitly); the
memory-efficient kernel's LSE comes back padded to a multiple of 32 rows: it is cut in the forward and
rebuilt for the backward with ``+inf`` rows, whose probabilities are 0. Its backward gets ``out`` and
``dout`` laid out ``[b, s, h, d]`` in memory (its forward's own layout): computing ``Delta`` itself (fp16,
bf16) it reads ``out`` with that row stride whatever strides it is given.

A value head dim ``Dv`` other than ``q``/``k``'s ``D`` (multi-head latent attention): ``cpu_flash`` and
``cuda_flash`` take one head dim, so the smaller side is zero-padded to ``max(D, Dv)`` (zero columns of
``v`` give zero output columns, cut off; zero columns of ``q``/``k`` change no score; their gradients are
cut likewise: exact, at the price of the padded copies of the block); ``cuda_efficient`` takes ``Dv``
as it is (each side padded to its own multiple of 8). No fused kernel caps scores (``softcap``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ds_ring.kernels.base import BlockKernel
from ds_ring.kernels.merge import accum_dtype

__all__ = ["CPU_FLASH", "CUDA_FLASH", "CUDA_EFFICIENT", "HEAD_DIM_MULTIPLE", "LSE_ROWS_MULTIPLE"]

HEAD_DIM_MULTIPLE = 8
"""The CUDA kernels see head dims padded to a multiple of this."""
LSE_ROWS_MULTIPLE = 32
"""The memory-efficient kernel's LSE has its rows padded to a multiple of this."""


def _round_up(dim: int, multiple: int) -> int:
    return -(-dim // multiple) * multiple


def _padded(x: Tensor, dim: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """``x`` in ``dtype``, its last dim zero-padded to ``dim`` (``None``: the next multiple of
    :data:`HEAD_DIM_MULTIPLE`) and unit-strided. A ``[b, h, s, d]`` view of ``[b, s, h, d]`` data is passed as it
    is, not copied: the kernels need only the head dim unit-strided (on an H200 the copies cost a dense forward +
    backward 7 q-shards of peak memory in bf16, 3 in fp32)."""
    x = x if dtype is None else x.to(dtype)
    pad = (_round_up(x.shape[-1], HEAD_DIM_MULTIPLE) if dim is None else dim) - x.shape[-1]
    if pad:
        return F.pad(x, (0, pad))
    return x if x.stride(-1) == 1 else x.contiguous()


def _token_major(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x [b, h, s, d]`` in ``dtype``, head dim padded as :func:`_padded` does, laid out ``[b, s, h, d]`` in
    memory (strides ``(s·h·d, d, h·d, 1)``): the row stride the memory-efficient backward assumes for ``out``
    when it computes ``Delta = rowsum(dout ∘ out)`` itself (fp16/bf16), whatever stride it is given."""
    return _padded(x.transpose(1, 2), dtype=dtype).contiguous().transpose(1, 2)


def _cut(grads, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` cut back to the head dims of ``q``, ``k``, ``v``."""
    return tuple(g[..., : x.shape[-1]] for g, x in zip(grads, (q, k, v), strict=True))


def _cpu_flash_forward(q, k, v, causal, scale):
    dim = max(q.shape[-1], v.shape[-1])  # the CPU kernel wants one head dim: the smaller side zero-padded
    if dim == q.shape[-1] == v.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _padded(q, dim), _padded(k, dim), _padded(v, dim), 0.0, causal, scale=scale
    )
    return out[..., : v.shape[-1]], lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    lse = lse.to(accum_dtype(q.dtype))
    dim = max(q.shape[-1], v.shape[-1])
    if dim == q.shape[-1] == v.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale
        )
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _padded(dout, dim, q.dtype), _padded(q, dim), _padded(k, dim), _padded(v, dim), _padded(out, dim, q.dtype),
        lse, 0.0, causal, scale=scale,
    )  # fmt: skip
    return _cut(grads, q, k, v)


def _no_random_state(device: torch.device) -> Tensor:
    """Stands in for the seed/offset tensors of a backward without dropout (never read)."""
    return torch.empty((), dtype=torch.int64, device=device)


def _flash_dim(q: Tensor, v: Tensor) -> int:
    """The one head dim FlashAttention-2 sees: ``q``'s and ``v``'s, the larger, rounded up."""
    return _round_up(max(q.shape[-1], v.shape[-1]), HEAD_DIM_MULTIPLE)


def _cuda_flash_forward(q, k, v, causal, scale):
    dim = _flash_dim(q, v)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        _padded(q, dim), _padded(k, dim), _padded(v, dim), 0.0, causal, False, scale=scale
    )
    return out[..., : v.shape[-1]], lse


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    none, dim = _no_random_state(q.device), _flash_dim(q, v)
    # cum_seq_q/k: None (not empty tensors) marks a dense batch rather than a varlen one.
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _padded(dout, dim, q.dtype), _padded(q, dim), _padded(k, dim), _padded(v, dim), _padded(out, dim, q.dtype),
        lse.float().contiguous(), None, None, q.shape[-2], k.shape[-2], 0.0, causal, none, none, scale=scale,
    )  # fmt: skip
    return _cut(grads, q, k, v)


def _cuda_efficient_forward(q, k, v, causal, scale):
    # q/k and v each padded to their own multiple of 8: this kernel takes a value head dim of its own.
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        _padded(q), _padded(k), _padded(v), None, True, 0.0, causal, scale=scale
    )
    return out[..., : v.shape[-1]], lse[..., : q.shape[-2]]


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale):
    rows = q.shape[-2]
    padded_lse = torch.full(
        (*lse.shape[:-1], -(-rows // LSE_ROWS_MULTIPLE) * LSE_ROWS_MULTIPLE), float("inf"),
        dtype=torch.float32, device=lse.device,
    )  # fmt: skip
    padded_lse[..., :rows] = lse
    none = _no_random_state(q.device)
    # out (and dout) in the kernel's own [b, s, h, d] memory layout: the kernel reads out with a row stride of
    # h·d (a [b, h, s, d]-contiguous out gives wrong dQ/dK for heads > 1 and reads past its end).
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _token_major(dout, q.dtype), _padded(q), _padded(k), _padded(v), None, _token_major(out, q.dtype),
        padded_lse, none, none, 0.0, [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return _cut((dq, dk, dv), q, k, v)


CPU_FLASH = BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)
CUDA_FLASH = BlockKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
CUDA_EFFICIENT = BlockKernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward)
