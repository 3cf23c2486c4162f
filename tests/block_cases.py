"""Block-kernel cases shared by the CPU and CUDA kernel tests: shapes, the fp64 oracle, one comparison."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_ring.kernels.base import BlockKernel

__all__ = ["SHAPES", "oracle", "check_against_oracle", "LargestOutput"]

# (batch, heads, m, head_dim, n), causal; causal blocks are square. Head dims and row counts that are not
# multiples of 8 / 32 exercise the CUDA wrappers' padding.
SHAPES = [
    ((2, 3, 17, 8, 17), False),
    ((2, 3, 17, 8, 17), True),
    ((1, 2, 5, 16, 9), False),
    ((1, 2, 9, 4, 30), False),
    ((1, 2, 70, 20, 70), True),
]


def oracle(q, k, v, dout, causal: bool, scale: float, softcap: float | None = None) -> tuple[torch.Tensor, ...]:
    """fp64 softmax attention with autograd, on the inputs' values (scores ``softcap·tanh(s / softcap)`` with a
    ``softcap``): ``(out, lse, dq, dk, dv)``."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    return (out.detach(), torch.logsumexp(s, -1).detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def check_against_oracle(
    kernel: BlockKernel,
    dtype: torch.dtype,
    shape: tuple,
    causal: bool,
    device: str,
    tol: float,
    *,
    v_head_dim: int | None = None,
    softcap: float | None = None,
    token_major: bool = False,
) -> None:
    """The kernel's out, LSE and dq/dk/dv equal the oracle's within ``tol`` (absolute and relative), in the
    input dtypes (LSE in float32, float64 for float64). ``v_head_dim``: ``v``'s own head dim (default ``d``);
    ``softcap``: passed to the kernel (which must take it) and the oracle; ``token_major``: every input a
    ``[b, h, s, d]`` view of ``[b, s, h, d]`` memory, as ds_ring's attention hands the kernels its shards."""
    batch, heads, m, d, n = shape
    dv = d if v_head_dim is None else v_head_dim
    gen = torch.Generator().manual_seed(0)

    def made(rows: int, dim: int) -> torch.Tensor:
        if token_major:
            return torch.randn(batch, rows, heads, dim, generator=gen).to(device, dtype).transpose(1, 2)
        return torch.randn(batch, heads, rows, dim, generator=gen).to(device, dtype)

    q, k, v, dout = made(m, d), made(n, d), made(n, dv), made(m, dv)
    capped = () if softcap is None else (softcap,)
    out, lse = kernel.forward(q, k, v, causal, 0.3, *capped)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.3, *capped)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert [g.dtype for g in grads] == [dtype] * 3
    want = oracle(q, k, v, dout, causal, 0.3, softcap)
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), want, strict=True):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


class LargestOutput(TorchDispatchMode):
    """The largest tensor any op produced, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for x in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(x, torch.Tensor):
                self.nbytes = max(self.nbytes, x.numel() * x.element_size())
        return result
