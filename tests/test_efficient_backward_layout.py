"""The memory-efficient kernel's backward gets ``out`` (and ``dout``) in its own ``[b, s, h, d]`` memory layout:
computing ``Delta`` itself (fp16/bf16) it reads ``out`` with a row stride of ``h·d`` whatever strides it is
given, so a ``[b, h, s, d]``-contiguous ``out`` gave wrong dQ/dK for heads > 1 (issue 33, defect 1). The
wrapper is called on meta tensors with a spy on the aten op's arguments."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_ring.kernels import fused

BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


class ArgumentSpy(TorchDispatchMode):
    """Records the arguments of every call of ``op``, and runs it."""

    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.calls = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def _token_major_strides(b: int, h: int, s: int, d: int) -> tuple[int, int, int, int]:
    return (s * h * d, d, h * d, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("shape", "causal"), [((2, 3, 40, 20, 40), True), ((1, 4, 33, 64, 70), False)])
def test_efficient_backward_gets_out_in_token_major_layout(dtype, shape, causal):
    batch, heads, m, d, n = shape
    padded = -(-d // 8) * 8
    q = torch.empty(batch, heads, m, d, dtype=dtype, device="meta")
    k, v = (torch.empty(batch, heads, n, d, dtype=dtype, device="meta") for _ in range(2))
    out, lse = fused.CUDA_EFFICIENT.forward(q, k, v, causal, 0.125)
    for given in (out, out.contiguous(), torch.empty(batch, heads, m, d, dtype=torch.float32, device="meta")):
        spy = ArgumentSpy(BACKWARD)
        with spy:
            grads = fused.CUDA_EFFICIENT.backward(given, q, k, v, given, lse, causal, 0.125)
        (args,) = spy.calls
        dout_arg, out_arg = args[0], args[5]
        for name, arg in (("dout", dout_arg), ("out", out_arg)):
            assert arg.shape == (batch, heads, m, padded), name
            assert arg.dtype == dtype, name
            assert arg.stride() == _token_major_strides(batch, heads, m, padded), (name, arg.stride())
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
