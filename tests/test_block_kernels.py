"""Every block kernel agrees with the pure-torch fallback, forward and backward, with the LSE."""

import pytest
import torch

from ds_ring.kernels import block


def test_cpu_selects_fused_flash_kernel(monkeypatch):
    monkeypatch.delenv("DS_RING_KERNEL", raising=False)
    assert block.select_kernel("cpu", torch.float32) is block.CPU_FLASH


def test_kernel_override_is_read_at_every_call(monkeypatch):
    """DS_RING_KERNEL set or cleared after a choice was cached still decides the next call."""
    monkeypatch.delenv("DS_RING_KERNEL", raising=False)
    assert block.select_kernel("cpu", torch.float32) is block.CPU_FLASH
    monkeypatch.setenv("DS_RING_KERNEL", "torch")
    assert block.select_kernel("cpu", torch.float32) is block.TORCH
    monkeypatch.delenv("DS_RING_KERNEL")
    assert block.select_kernel("cpu", torch.float32) is block.CPU_FLASH


# Causal blocks are always square (diagonal blocks of a ring or a segment); unmasked ones may not be.
SHAPES = [((2, 3, 17, 8, 17), False), ((2, 3, 17, 8, 17), True), ((1, 2, 5, 16, 9), False)]


@pytest.mark.parametrize("kernel", [block.CPU_FLASH], ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "causal"), SHAPES)
def test_kernel_matches_fallback(kernel, dtype, shape, causal):
    batch, heads, m, d, n = shape
    torch.manual_seed(0)
    q = torch.randn(batch, heads, m, d, dtype=dtype)
    k, v = torch.randn(batch, heads, n, d, dtype=dtype), torch.randn(batch, heads, n, d, dtype=dtype)
    out, lse = kernel.forward(q, k, v, causal, 0.25)
    ref_out, ref_lse = block.TORCH.forward(q, k, v, causal, 0.25)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref_out, rtol=0, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=tol)
    dout = torch.randn_like(out)
    for got, want in zip(kernel.backward(dout, q, k, v, out, lse, causal, 0.25),
                         block.TORCH.backward(dout, q, k, v, out, lse, causal, 0.25), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=tol * 10)


def test_fallback_gradient_matches_autograd():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.softmax(scores, -1) @ v
    dout = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    out, lse = block.TORCH.forward(q.detach(), k.detach(), v.detach(), True, 0.5)
    got = block.TORCH.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, True, 0.5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
