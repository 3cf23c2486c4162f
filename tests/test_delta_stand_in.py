"""The stand-in output the Ulysses and ring backwards give the kernels: its row sums with dout are Delta."""

import pytest
import torch

from ds_ring.kernels.delta import OutputByDelta, materialized, row_delta, stand_in_output


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


def test_output_by_delta_indexes_like_the_output_and_materializes_those_rows():
    """The ring backward's stand-in for ``out``: views of ``dout`` and ``Delta`` taken like ``out``'s, each call's
    stand-in written only for its rows."""
    g = torch.Generator().manual_seed(1)
    dout, out = (torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    lazy = OutputByDelta(dout, row_delta(dout, out, torch.float64))
    piece = lazy[:, 3:9].unflatten(1, (2, 3))[:, :, 1::2][:, :, :, torch.tensor([0, 2])]
    want = out[:, 3:9].unflatten(1, (2, 3))[:, :, 1::2][:, :, :, torch.tensor([0, 2])]
    assert piece.shape == want.shape
    stand_in = piece.materialize(torch.float64)
    assert stand_in.shape == want.shape
    torch.testing.assert_close((piece.dout * stand_in).sum(-1), (piece.dout * want).sum(-1), rtol=1e-12, atol=1e-12)
    assert materialized(out, torch.float64) is out
    with pytest.raises(IndexError, match="before the head dim"):
        lazy[:, :, :, 0]
    with pytest.raises(IndexError, match="before the head dim"):
        lazy.unflatten(3, (2, 4))
