"""Bad arguments raise ValueError naming the argument, before any work."""

import pytest
import torch

import ds_ring


def _qkv(seq=8, heads=4, kv_heads=4, dim=8):
    return torch.randn(1, seq, heads, dim), torch.randn(1, seq, kv_heads, dim), torch.randn(1, seq, kv_heads, dim)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(segment_lengths=[4, 8], dilation_rates=[1]), "same length"),
        (dict(segment_lengths=[0], dilation_rates=[1]), "segment_lengths"),
        (dict(segment_lengths=[4], dilation_rates=[0]), "dilation_rates"),
        (dict(segment_lengths=[4], dilation_rates=[-2]), "dilation_rates"),
        (dict(segment_lengths=[4.0], dilation_rates=[1]), "segment_lengths"),
        (dict(segment_lengths=[4], dilation_rates=None), "dilation_rates"),
        (dict(segment_lengths=[], dilation_rates=[]), "segment_lengths"),
        (dict(head_offset=-1), "head_offset"),
    ],
)
def test_bad_branch_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ds_ring.dilated_attention(*_qkv(), **kwargs)


def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k/v heads \(3\)"):
        ds_ring.dilated_attention(*_qkv(kv_heads=3))


def test_shapes_that_disagree():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"k \(1, 8, 4, 8\) and v \(1, 4, 4, 8\) must agree in batch, seq and kv"):
        ds_ring.dilated_attention(q, k, v[:, :4])
    with pytest.raises(ValueError, match="agree in batch, seq and head_dim"):
        ds_ring.dilated_attention(q[:, :4], k, v)
    with pytest.raises(ValueError, match=r"q must be \[batch, seq, heads, head_dim\]"):
        ds_ring.dilated_attention(q[0], k, v)
    with pytest.raises(ValueError, match="dtype"):
        ds_ring.dilated_attention(q.double(), k, v)
