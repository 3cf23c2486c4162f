"""The LSE merge: pieces of a key set merge to attention over the whole set."""

import math

import pytest
import torch

from ds_ring.kernels.merge import merge, merge_


def _attend(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_two_pieces_equal_whole(cut):
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 7, 16, dtype=torch.float64) for _ in range(3))
    o1, l1 = _attend(q, k[:, :cut], v[:, :cut])
    o2, l2 = _attend(q, k[:, cut:], v[:, cut:])
    out, lse = merge(o1, l1, o2, l2)
    ref_out, ref_lse = _attend(q, k, v)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-13)


def test_empty_piece_has_no_weight_and_empty_rows_stay_zero():
    out = torch.randn(4, 8, dtype=torch.float64)
    lse = torch.tensor([0.5, -math.inf, 2.0, -math.inf], dtype=torch.float64)
    piece = torch.randn(4, 8, dtype=torch.float64)
    piece_lse = torch.tensor([-math.inf, 1.0, -math.inf, -math.inf], dtype=torch.float64)
    merged, merged_lse = merge(out, lse, piece, piece_lse)
    torch.testing.assert_close(merged[0], out[0])
    torch.testing.assert_close(merged[1], piece[1])
    torch.testing.assert_close(merged[2], out[2])
    assert torch.equal(merged[3], torch.zeros(8, dtype=torch.float64))
    assert torch.isneginf(merged_lse[3]) and not torch.isnan(merged).any()


def test_stable_for_large_logits():
    """No overflow where exp(lse) would be inf: the merge never forms unnormalised sums."""
    f64 = dict(dtype=torch.float64)
    out, piece = torch.ones(2, 4, **f64), torch.full((2, 4), 3.0, **f64)
    lse, piece_lse = torch.tensor([1e4, -1e4], **f64), torch.tensor([1e4, -1e4 + math.log(3.0)], **f64)
    merged, merged_lse = merge(out, lse, piece, piece_lse)
    torch.testing.assert_close(merged, torch.tensor([[2.0] * 4, [2.5] * 4], **f64))
    torch.testing.assert_close(merged_lse, torch.tensor([1e4 + math.log(2.0), -1e4 + math.log(4.0)], **f64))


def test_in_place_merge_into_strided_view():
    acc = torch.zeros(6, 5, 4)
    acc_lse = torch.full((6, 5), -math.inf)
    piece, piece_lse = torch.randn(3, 5, 4), torch.randn(3, 5)
    merge_(acc[::2], acc_lse[::2], piece, piece_lse)
    torch.testing.assert_close(acc[::2], piece)
    torch.testing.assert_close(acc_lse[::2], piece_lse)
    assert torch.equal(acc[1::2], torch.zeros(3, 5, 4))


def test_order_does_not_matter():
    torch.manual_seed(1)
    parts = [(torch.randn(5, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)) for _ in range(4)]
    forward = parts[0]
    for p in parts[1:]:
        forward = merge(*forward, *p)
    backward = parts[-1]
    for p in reversed(parts[:-1]):
        backward = merge(*backward, *p)
    torch.testing.assert_close(forward[0], backward[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(forward[1], backward[1], rtol=0, atol=1e-14)
