"""The oracle itself: dense equals SDPA; each branch keeps exactly the positions LongNet defines."""

import pytest
import torch
import torch.nn.functional as F

from ds_ring.reference import dilated_attention_reference, dilated_mask


@pytest.mark.parametrize("causal", [False, True])
def test_dense_reference_equals_sdpa(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 19, 3, 8, dtype=torch.float64) for _ in range(3))
    out, lse = dilated_attention_reference(q, k, v, causal=causal)
    sdpa = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal).transpose(1, 2)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=1e-12)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(19, 19, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=1e-12)


def test_mask_by_hand():
    """seq 8, one branch w=4 r=2: head 0 keeps positions {0,2} of each segment, head 1 {1,3}."""
    mask = dilated_mask(8, 2, [4], [2])
    kept = {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
    for head, positions in kept.items():
        expected = torch.zeros(8, 8, dtype=torch.bool)
        for i in positions:
            for j in positions:
                expected[i, j] = i // 4 == j // 4
        assert torch.equal(mask[0, head], expected)
    # head_offset shifts which head takes which offset
    assert torch.equal(dilated_mask(8, 2, [4], [2], head_offset=1)[0, 0], mask[0, 1])


def test_segment_longer_than_sequence_is_clamped_and_last_segment_shorter():
    assert torch.equal(dilated_mask(10, 1, [64], [1]), dilated_mask(10, 1, [10], [1]))
    mask = dilated_mask(10, 1, [4], [1])[0, 0]
    assert mask[8, 9] and not mask[7, 8]  # last segment is positions 8..9


def test_uncovered_rows_are_zero_with_minus_inf_lse():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 1, 4, dtype=torch.float64) for _ in range(3))
    out, lse = dilated_attention_reference(q, k, v, [4], [2])  # head 0 keeps even positions only
    assert torch.equal(out[0, 1::2], torch.zeros(4, 1, 4, dtype=torch.float64))
    assert torch.isneginf(lse[0, 0, 1::2]).all() and torch.isfinite(lse[0, 0, ::2]).all()


def test_branches_merge_by_lse():
    """Two branches = one softmax over both branches' keys (a key in both counts twice)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1, 4, dtype=torch.float64) for _ in range(3))
    out, lse = dilated_attention_reference(q, k, v, [4, 4], [1, 1])
    dense_out, dense_lse = dilated_attention_reference(q, k, v)
    torch.testing.assert_close(out, dense_out)
    torch.testing.assert_close(lse, dense_lse + torch.log(torch.tensor(2.0, dtype=torch.float64)))
