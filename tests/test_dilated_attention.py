"""Single-process dilated attention equals the float64 oracle, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds_ring
import ds_ring.kernels.dilated
from ds_ring.reference import dilated_attention_reference


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    branches = draw(st.integers(1, 3))
    return dict(
        batch=draw(st.integers(1, 2)),
        seq=draw(st.integers(1, 40)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([1, 3, 8, 16])),
        segments=[draw(st.integers(1, 48)) for _ in range(branches)],
        rates=[draw(st.integers(1, 5)) for _ in range(branches)],
        causal=draw(st.booleans()),
        head_offset=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**16)),
    )


def _inputs(c, dtype):
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["batch"], c["seq"], c["heads"], c["head_dim"], generator=g, dtype=dtype)
    k = torch.randn(c["batch"], c["seq"], c["kv_heads"], c["head_dim"], generator=g, dtype=dtype)
    v = torch.randn(c["batch"], c["seq"], c["kv_heads"], c["head_dim"], generator=g, dtype=dtype)
    dout = torch.randn(q.shape, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)], dout


def _compare(c, dtype, atol):
    (q, k, v), dout = _inputs(c, dtype)
    kwargs = dict(causal=c["causal"], head_offset=c["head_offset"])
    out, lse = ds_ring.dilated_attention(q, k, v, c["segments"], c["rates"], return_lse=True, **kwargs)
    ref_out, ref_lse = dilated_attention_reference(q, k, v, c["segments"], c["rates"], **kwargs)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.shape == (c["batch"], c["heads"], c["seq"])
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=0, atol=atol)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert got.dtype == dtype, name
        torch.testing.assert_close(
            got.double(), want.double(), rtol=0, atol=atol * 10, msg=lambda m, n=name: f"d{n}: {m}"
        )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_reference_float64(c):
    _compare(c, torch.float64, 1e-10)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_reference_float32(c):
    _compare(c, torch.float32, 2e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(1, 7))
def test_runs_cut_into_calls_match_reference(c, rows_per_call):
    """A run of many segments is cut into kernel calls of a few kept rows each: same results."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ds_ring.kernels.dilated, "ROWS_PER_CALL", rows_per_call)
        _compare(c, torch.float64, 1e-10)


def test_bfloat16_tiny():
    c = dict(batch=1, seq=12, heads=4, kv_heads=2, head_dim=8, segments=[4, 12], rates=[1, 2], causal=True,
             head_offset=1, seed=3)  # fmt: skip
    (q, k, v), dout = _inputs(c, torch.bfloat16)
    out = ds_ring.dilated_attention(q, k, v, c["segments"], c["rates"], causal=True, head_offset=1)
    ref, _ = dilated_attention_reference(q, k, v, c["segments"], c["rates"], causal=True, head_offset=1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=1e-1)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_equals_sdpa(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 32, requires_grad=True) for _ in range(3))
    out = ds_ring.dilated_attention(q, k, v, [300], [1], causal=causal)
    sdpa = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    grads, sdpa_grads = torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(sdpa, (q, k, v), dout)
    for got, want in zip(grads, sdpa_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # No segments at all also means dense.
    torch.testing.assert_close(ds_ring.dilated_attention(q, k, v, causal=causal), out)


def test_scale_is_honoured():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, dtype=torch.float64) for _ in range(3))
    out = ds_ring.dilated_attention(q, k, v, [8], [2], scale=0.3)
    ref, _ = dilated_attention_reference(q, k, v, [8], [2], scale=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
