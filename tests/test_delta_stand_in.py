"""The stand-in output the Ulysses backward gives the kernels: its row sums with dout are Delta."""

import pytest
import torch

from ds_ring.kernels.delta import stand_in_output


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_row_sums_are_delta(dtype, tol, scale):
    g = torch.Generator().manual_seed(0)
    dout = (torch.randn(2, 5, 3, 16, generator=g, dtype=torch.float64) * scale).to(dtype)
    dout[0, 1, 2] = 0  # a row with no gradient: its stand-in is 0
    delta = torch.randn(2, 5, 3, generator=g, dtype=torch.float64).to(torch.float64 if dtype == torch.float64 else
                                                                      torch.float32)  # fmt: skip
    delta[0, 1, 2] = 0
    into = torch.empty_like(dout)
    out = stand_in_output(dout, delta, into)
    assert out is into and torch.isfinite(out).all()
    sums = (dout.double() * out.double()).sum(-1)
    torch.testing.assert_close(sums, delta.double(), rtol=tol, atol=tol * delta.abs().max().item())
    assert out[0, 1, 2].abs().sum() == 0
