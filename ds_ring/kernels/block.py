"""Block attention kernels that return the log-sum-exp, chosen once per (device type, dtype).

Every strategy computes attention as a set of *blocks*: one query block against one key block,
either unmasked or causal with both blocks starting at the same position (the diagonal block of a
ring or of a dilated segment). A block kernel returns ``(out, lse)`` so blocks can be LSE-merged,
and its backward takes the *final* (merged) ``out`` and ``lse``: with those, the flash-style
backward of each block gives that block's exact share of the gradient (DESIGN.md §2).

Layout inside this module: ``[batch, heads, rows, head_dim]`` (strided views are fine); ``k``/``v``
have the same number of heads as ``q`` (callers expand GQA heads). ``lse`` is ``[batch, heads, rows]``
in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ds_ring.kernels.merge import accum_dtype

__all__ = ["BlockKernel", "select_kernel", "block_forward", "block_backward"]


BlockForward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
"""``(q, k, v, causal, scale) -> (out, lse)``, in this module's layout."""
BlockBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]
"""``(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` given the final merged ``out``/``lse``."""


@dataclass(frozen=True)
class BlockKernel:
    """A named forward/backward pair; ``name`` is reported by benchmarks and the monitor."""

    name: str
    forward: BlockForward
    backward: BlockBackward


# --- CPU: PyTorch's fused flash kernel (fp32 / fp64 / bf16 / fp16), which returns the LSE. -------


def _cpu_flash_forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(accum_dtype(q.dtype)), 0.0, causal, scale=scale
    )


# --- CUDA: PyTorch's fused FlashAttention-2 (fp16 / bf16). Not exercised on the CPU-only CI. --------


def _cuda_flash_forward(q, k, v, causal, scale):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    empty = torch.empty(0, device=q.device, dtype=torch.int64)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.float().contiguous(),
        empty, empty, q.shape[-2], k.shape[-2], 0.0, causal, empty, empty, scale=scale,
    )  # fmt: skip


# --- Pure torch: any device and dtype; materialises one block's score matrix. --------------------


def _scores(q, k, causal, scale):
    acc = accum_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        m, n = s.shape[-2:]
        mask = torch.ones(m, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _torch_forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.to(p.dtype)).to(q.dtype), lse


def _torch_backward(dout, q, k, v, out, lse, causal, scale):
    acc = accum_dtype(q.dtype)
    dout, out = dout.to(acc), out.to(acc)
    p = torch.exp(_scores(q, k, causal, scale) - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.to(acc).transpose(-1, -2))
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, k.to(acc))
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


TORCH = BlockKernel("torch", _torch_forward, _torch_backward)
CPU_FLASH = BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)
CUDA_FLASH = BlockKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)


def select_kernel(device_type: str, dtype: torch.dtype) -> BlockKernel:
    """The fastest available kernel that returns the LSE, chosen once per (device type, dtype).

    The environment variable ``DS_RING_KERNEL=torch`` forces the pure-torch fallback (tests use it
    to check both paths agree). It is read on every call, before the cached choice, so setting or
    clearing it takes effect at the next block.
    """
    return TORCH if os.environ.get("DS_RING_KERNEL") == "torch" else _fastest_kernel(device_type, dtype)


@functools.cache
def _fastest_kernel(device_type: str, dtype: torch.dtype) -> BlockKernel:
    if device_type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return CPU_FLASH
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return CUDA_FLASH
    return TORCH


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block.

    Args:
        q: ``[batch, heads, m, head_dim]``; k, v: ``[batch, heads, n, head_dim]``.
        causal: mask key ``j > i`` (blocks aligned at their first row; used with ``m == n``).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
    Returns:
        ``out [batch, heads, m, head_dim]`` in ``q.dtype`` and ``lse [batch, heads, m]`` (fp32/fp64).
    """
    kernel = select_kernel(q.device.type, q.dtype)
    return kernel.forward(q, k, v, causal, _scale(q, scale))


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* merged ``out``/``lse`` rows of its queries.

    Shapes as in :func:`block_forward`; ``dout``/``out`` are ``[batch, heads, m, head_dim]``,
    ``lse`` is ``[batch, heads, m]``. Returns ``(dq, dk, dv)`` in the input dtypes.
    """
    kernel = select_kernel(q.device.type, q.dtype)
    return kernel.backward(dout, q, k, v, out, lse, causal, _scale(q, scale))
