"""Which block kernel runs a block, and the two calls every strategy makes: :func:`block_forward` and
:func:`block_backward`.

Every strategy computes attention as a set of *blocks*: one query block against one key block,
either unmasked or causal with both blocks starting at the same position (the diagonal block of a
ring or of a dilated segment). A block kernel (:mod:`ds_ring.kernels.base`) returns ``(out, lse)`` so
blocks can be LSE-merged, and its backward takes the *final* (merged) ``out`` and ``lse``: with those,
the flash-style backward of each block gives that block's exact share of the gradient (docs/design.md §The LSE merge).
No kernel forms a block's score matrix: the fused ones (:mod:`ds_ring.kernels.fused`) never do, the
pure-torch one (:mod:`ds_ring.kernels.chunked`) works in bounded tiles.

The choice is :func:`kernel_for`, a pure function of the device type, dtype, head dims, softcap and the
GPU's facts:

| device | dtype | kernel |
|---|---|---|
| any | any, with ``softcap`` | ``torch`` (no fused kernel caps scores) |
| CPU | any | ``cpu_flash`` |
| CUDA sm80-121, FlashAttention-2 built | fp16, bf16, max(D, Dv) <= 256 (192 on sm86-89, sm120-121) | ``cuda_flash`` |
| CUDA sm50+ | fp32, fp16 that FlashAttention-2 cannot run; bf16 too on sm80+ | ``cuda_efficient`` |
| CUDA below sm80 | bf16 (the memory-efficient kernel has no bf16 kernel there) | ``torch`` |
| ROCm, fused attention built (AOTriton) | fp16, bf16, max(D, Dv) <= 256 | ``cuda_flash`` |
| ROCm, fused attention built (AOTriton) | fp32; fp16/bf16 wider than 256 | ``cuda_efficient`` |
| CUDA, ROCm | fp64 | ``torch`` |
| ROCm without fused attention, other devices | any | ``torch`` |

On ROCm PyTorch's two fused ops run through AOTriton (``torch.backends.cuda.is_flash_attention_available()``
says whether this build has them); not yet run here (the one GPU run was on an NVIDIA H200).

A value head dim of its own (``v_head_dim != head_dim``, multi-head latent attention) keeps the same kernels:
``cpu_flash`` and ``cuda_flash`` see the smaller side zero-padded to the larger (exact; what Hugging Face does
for DeepSeek under FlashAttention-2, whose PyTorch entry point wants one head dim; on the CPU, measured at
q/k 192, v 128, 2048 rows, fp32, forward + backward: 2.2 s padded against 8.7 s for the ``torch`` kernel),
``cuda_efficient`` takes it natively.

``DS_RING_KERNEL=<name>`` overrides it (``torch``: the tiled pure-torch kernel; tests use it to check the
paths agree); it is read at every call, before the cached choice. Forcing a fused kernel for a call with
``softcap`` is a ``ValueError``.

Layout inside this module: ``[batch, heads, rows, head_dim]`` (see :mod:`ds_ring.kernels.base`).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from ds_ring.kernels.base import BlockKernel
from ds_ring.kernels.chunked import CHUNKED
from ds_ring.kernels.fused import CPU_FLASH, CUDA_EFFICIENT, CUDA_FLASH, HEAD_DIM_MULTIPLE

__all__ = [
    "BlockKernel",
    "GpuFacts",
    "KERNELS",
    "gpu_facts",
    "kernel_for",
    "select_kernel",
    "block_forward",
    "block_backward",
]

KERNELS = {kernel.name: kernel for kernel in (CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, CHUNKED)}
"""Every block kernel by name (the values ``DS_RING_KERNEL`` takes)."""


@dataclass(frozen=True)
class GpuFacts:
    """What the kernel choice needs to know about a CUDA device: compute capability ``(major, minor)``,
    whether this PyTorch build has FlashAttention-2 (``torch.backends.cuda.is_flash_attention_available()``),
    and whether it is a ROCm (HIP) build."""

    capability: tuple[int, int]
    flash_built: bool = True
    rocm: bool = False


def _flash_head_dim_limit(capability: tuple[int, int]) -> int:
    """The largest head dim FlashAttention-2 runs forward and backward on this capability."""
    return 192 if (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1) else 256


@functools.cache
def kernel_for(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    gpu: GpuFacts | None,
    override: str | None = None,
    *,
    v_head_dim: int | None = None,
    softcap: bool = False,
) -> BlockKernel:
    """The kernel for blocks of ``dtype``, q/k ``head_dim`` and ``v_head_dim`` (``None``: ``head_dim``) on
    ``device_type`` (``gpu``: the CUDA device's facts, ``None`` elsewhere), whose scores are capped when
    ``softcap``; ``override`` (``DS_RING_KERNEL``'s value) is taken first. Pure, and cached."""
    if override:
        if override not in KERNELS:
            raise ValueError(f"DS_RING_KERNEL={override!r} names no block kernel; choose one of {sorted(KERNELS)}")
        if softcap and not KERNELS[override].softcap:
            capped = sorted(name for name, kernel in KERNELS.items() if kernel.softcap)
            raise ValueError(
                f"DS_RING_KERNEL={override!r} cannot cap attention scores (softcap); unset DS_RING_KERNEL or choose "
                f"one of {capped}"
            )
        return KERNELS[override]
    if softcap:
        return CHUNKED
    if device_type == "cpu":
        return CPU_FLASH
    if device_type != "cuda" or gpu is None or dtype == torch.float64:
        return CHUNKED
    widest = head_dim if v_head_dim is None else max(head_dim, v_head_dim)
    padded = -(-widest // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE
    half = dtype in (torch.float16, torch.bfloat16)
    if gpu.rocm:
        if not gpu.flash_built:
            return CHUNKED
        return CUDA_FLASH if half and padded <= 256 else CUDA_EFFICIENT
    flash = gpu.flash_built and (8, 0) <= gpu.capability <= (12, 1) and padded <= _flash_head_dim_limit(gpu.capability)
    if half and flash:
        return CUDA_FLASH
    if dtype == torch.bfloat16 and gpu.capability < (8, 0):
        return CHUNKED
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and gpu.capability >= (5, 0):
        return CUDA_EFFICIENT
    return CHUNKED


@functools.cache
def gpu_facts(index: int) -> GpuFacts:
    """The facts of CUDA device ``index``, read once."""
    return GpuFacts(
        torch.cuda.get_device_capability(index),
        torch.backends.cuda.is_flash_attention_available(),
        torch.version.hip is not None,
    )


def select_kernel(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    v_head_dim: int | None = None,
    softcap: bool = False,
) -> BlockKernel:
    """The kernel :func:`kernel_for` picks for this device (its GPU facts read once per device), after
    ``DS_RING_KERNEL`` (read at every call, so setting or clearing it takes effect at the next block)."""
    gpu = None
    if device.type == "cuda":
        gpu = gpu_facts(device.index if device.index is not None else torch.cuda.current_device())
    v_head_dim = None if v_head_dim == head_dim else v_head_dim
    override = os.environ.get("DS_RING_KERNEL") or None
    return kernel_for(device.type, dtype, head_dim, gpu, override, v_head_dim=v_head_dim, softcap=softcap)


def _kernel(q: torch.Tensor, v: torch.Tensor, softcap: float | None) -> BlockKernel:
    return select_kernel(q.device, q.dtype, q.shape[-1], v_head_dim=v.shape[-1], softcap=softcap is not None)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block.

    Args:
        q: ``[batch, heads, m, head_dim]``; k: ``[batch, heads, n, head_dim]``; v: ``[batch, heads, n, v_head_dim]``.
        causal: mask key ``j > i`` (blocks aligned at their first row; used with ``m == n``).
        scale: softmax scale, default ``1/sqrt(head_dim)``.
        softcap: scores ``s`` become ``softcap·tanh(s / softcap)`` before the softmax (``None``: uncapped).
    Returns:
        ``out [batch, heads, m, v_head_dim]`` in ``q.dtype`` and ``lse [batch, heads, m]`` (fp32/fp64).
    """
    kernel = _kernel(q, v, softcap)
    capped = () if softcap is None else (softcap,)
    return kernel.forward(q, k, v, causal, _scale(q, scale), *capped)


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
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* merged ``out``/``lse`` rows of its queries.

    Shapes as in :func:`block_forward`; ``dout``/``out`` are ``[batch, heads, m, v_head_dim]``,
    ``lse`` is ``[batch, heads, m]``. Returns ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v`` in their dtypes.
    """
    kernel = _kernel(q, v, softcap)
    capped = () if softcap is None else (softcap,)
    return kernel.backward(dout, q, k, v, out, lse, causal, _scale(q, scale), *capped)
