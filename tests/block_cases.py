"""Block-kernel cases shared by the CPU and CUDA kernel tests: shapes, the fp64 oracle, one comparison."""

from __future__ import annotations

import torch

from ds_ring.kernels.base import BlockKernel

__all__ = ["SHAPES", "oracle", "check_against_oracle"]

# (batch, heads, m, head_dim, n), causal; causal blocks are square. Head dims and row counts that are not
# multiples of 8 / 32 exercise the CUDA wrappers' padding.
SHAPES = [
    ((2, 3, 17, 8, 17), False),
    ((2, 3, 17, 8, 17), True),
    ((1, 2, 5, 16, 9), False),
    ((1, 2, 9, 4, 30), False),
    ((1, 2, 70, 20, 70), True),
]


def oracle(q, k, v, dout, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """fp64 softmax attention with autograd, on the inputs' values: ``(out, lse, dq, dk, dv)``."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    return (out.detach(), torch.logsumexp(s, -1).detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def check_against_oracle(
    kernel: BlockKernel, dtype: torch.dtype, shape: tuple, causal: bool, device: str, tol: float
) -> None:
    """The kernel's out, LSE and dq/dk/dv equal the oracle's within ``tol`` (absolute and relative), in the
    input dtypes (LSE in float32, float64 for float64)."""
    batch, heads, m, d, n = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, m, d, generator=gen).to(device, dtype)
    k, v = (torch.randn(batch, heads, n, d, generator=gen).to(device, dtype) for _ in range(2))
    dout = torch.randn(batch, heads, m, d, generator=gen).to(device, dtype)
    out, lse = kernel.forward(q, k, v, causal, 0.3)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.3)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert [g.dtype for g in grads] == [dtype] * 3
    want = oracle(q, k, v, dout, causal, 0.3)
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want, strict=True):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
