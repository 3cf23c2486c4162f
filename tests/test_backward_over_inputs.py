"""Dense attention's backward written over its own inputs, block by block, equals the one-call backward."""

import pytest
import torch

import ds_ring.kernels.overwrite as overwrite
from ds_ring.kernels.delta import OutputByDelta, row_delta
from ds_ring.kernels.dilated import dilated_backward, dilated_forward, plan_dilated
from ds_ring.kernels.merge import accum_dtype


def _case(seq, heads, kv_heads, dtype, seed=0, dv=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, heads, 8, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, seq, kv_heads, 8, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, seq, kv_heads, dv, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(2, seq, heads, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _grads(q, k, v, dout, *, causal, overwrite_inputs, lazy=False, **call):
    regions, opts = plan_dilated(q, k, v, call.get("segments"), call.get("rates"), causal=causal, scale=None,
                                 head_offset=0, cu_seqlens=call.get("documents"), window=call.get("window"), sinks=None,
                                 softcap=None)  # fmt: skip
    out, lse = dilated_forward(q, k, v, None, regions, opts)
    if lazy:  # what Ulysses hands in: Delta taken before the exchange, no output
        out = OutputByDelta(dout, row_delta(dout, out, accum_dtype(q.dtype)))
    mine = [x.clone() for x in (q, k, v)]  # the backward may overwrite its inputs: give it its own
    backward = overwrite.dilated_backward_over_inputs if overwrite_inputs else dilated_backward
    grads = backward((dout, *mine, out, lse), None, regions, opts, False)
    return grads[:3], mine


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("seq", [16, 17, 29])
def test_blocks_equal_one_call_and_overwrite_the_inputs(monkeypatch, causal, heads, kv_heads, seq):
    monkeypatch.setattr(overwrite, "BLOCK_ROWS", 5)  # 4-7 blocks of uneven rows
    q, k, v, dout = _case(seq, heads, kv_heads, torch.float64, seed=seq + heads)
    want, _ = _grads(q, k, v, dout, causal=causal, overwrite_inputs=False)
    got, mine = _grads(q, k, v, dout, causal=causal, overwrite_inputs=True, lazy=True)
    for g, w, x in zip(got, want, mine, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        assert g.data_ptr() == x.data_ptr() and g.dtype == x.dtype  # written over the input itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_accumulates_before_rounding(monkeypatch, dtype):
    """Block pieces are summed in the accumulation dtype and rounded once, into the input's own dtype."""
    monkeypatch.setattr(overwrite, "BLOCK_ROWS", 8)
    q, k, v, dout = _case(40, 2, 2, dtype, seed=3, dv=16)
    want, _ = _grads(*(x.double() for x in (q, k, v, dout)), causal=True, overwrite_inputs=False)
    got, _ = _grads(q, k, v, dout, causal=True, overwrite_inputs=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "call",
    [dict(segments=[8, 32], rates=[1, 2]), dict(window=5), dict(documents=[0, 12, 32]), dict(segments=[16], rates=[1])],
    ids=["dilated", "window", "documents", "segments"],
)
def test_other_calls_are_left_to_the_regions(monkeypatch, call):
    """Only dense attention over the whole tensors is blocked; anything else returns None and is not touched."""
    monkeypatch.setattr(overwrite, "BLOCK_ROWS", 5)
    q, k, v, dout = _case(32, 2, 2, torch.float64)
    regions, opts = plan_dilated(q, k, v, call.get("segments"), call.get("rates"), causal=True, scale=None,
                                 head_offset=0, cu_seqlens=call.get("documents"), window=call.get("window"), sinks=None,
                                 softcap=None)  # fmt: skip
    out, lse = dilated_forward(q, k, v, None, regions, opts)
    before = [x.clone() for x in (q, k, v)]
    assert overwrite.backward_over_inputs((dout, q, k, v, out, lse), regions, opts) is None
    for x, b in zip((q, k, v), before, strict=True):
        assert torch.equal(x, b)


def test_short_sequences_run_as_one_call():
    q, k, v, dout = _case(overwrite.BLOCK_ROWS, 2, 2, torch.float32)
    regions, opts = plan_dilated(q, k, v, None, None, causal=True, scale=None, head_offset=0, cu_seqlens=None,
                                 window=None, sinks=None, softcap=None)  # fmt: skip
    out, lse = dilated_forward(q, k, v, None, regions, opts)
    assert overwrite.backward_over_inputs((dout, q, k, v, out, lse), regions, opts) is None


def test_sinks_and_softcap_keep_their_gradients(monkeypatch):
    """The sinks' gradient comes from Delta alone, and a soft-capped call runs its blocks through the torch kernel."""
    monkeypatch.setattr(overwrite, "BLOCK_ROWS", 7)
    q, k, v, dout = _case(30, 4, 2, torch.float64, seed=5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    regions, opts = plan_dilated(q, k, v, None, None, causal=True, scale=None, head_offset=0, cu_seqlens=None,
                                 window=None, sinks=sinks, softcap=3.0)  # fmt: skip
    out, lse = dilated_forward(q, k, v, sinks, regions, opts)
    lazy = OutputByDelta(dout, row_delta(dout, out, torch.float64))
    want = dilated_backward((dout, q, k, v, out, lse), sinks, regions, opts, True)
    mine = [x.clone() for x in (q, k, v)]
    got = overwrite.dilated_backward_over_inputs((dout, *mine, lazy, lse), sinks, regions, opts, True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert got[0].data_ptr() == mine[0].data_ptr()
