"""The nn.Modules: sharded MultiheadRingDilatedAttention equals the same module on the full sequence."""

import pytest
import torch
import torch.distributed as dist

import ds_ring
from tests.dist import CaseLog, assert_no_failures, run_distributed

E, H, HKV, SEQ = 32, 4, 2, 24


def _module(**attention) -> ds_ring.MultiheadRingDilatedAttention:
    torch.manual_seed(0)
    return ds_ring.MultiheadRingDilatedAttention(E, H, HKV, dtype=torch.float64, **attention)


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    for comm in ("ring", "allgather"):
        for segs, rates in ((None, None), ([SEQ // world // 2, SEQ], [1, 2])):
            with log.case(f"{comm} {segs} {rates}"):
                x = torch.randn(2, SEQ, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
                single = _module(segment_lengths=segs, dilation_rates=rates, causal=True, group=None)
                sharded = _module(segment_lengths=segs, dilation_rates=rates, causal=True, communication=comm)
                full_x, local_x = x.clone().requires_grad_(), ds_ring.shard_sequence(x).requires_grad_()
                # The single-process module sees a world of one: run it on its own group.
                single.attention.configure(group=dist.new_group([rank], use_local_synchronization=True))
                want, _ = single(full_x)
                got, _ = sharded(local_x)
                torch.testing.assert_close(got, ds_ring.shard_sequence(want), rtol=0, atol=1e-12)
                want.square().sum().backward()
                got.square().sum().backward()
                torch.testing.assert_close(local_x.grad, ds_ring.shard_sequence(full_x.grad), rtol=0, atol=1e-11)
                for (name, p_single), p_sharded in zip(single.named_parameters(), sharded.parameters(), strict=True):
                    grad = p_sharded.grad.clone()
                    dist.all_reduce(grad)  # each rank holds its tokens' share of a parameter's gradient
                    torch.testing.assert_close(grad, p_single.grad, rtol=0, atol=1e-10, msg=name)
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_module_equals_full_module(world):
    assert_no_failures(run_distributed(_rank, world, timeout=90))


def test_module_call_convention_and_errors():
    mha = ds_ring.MultiheadRingDilatedAttention(16, 4, causal=True, segment_lengths=[4], dilation_rates=[1])
    x = torch.randn(2, 8, 16)
    out, weights = mha(x)
    assert out.shape == x.shape and weights is None
    seq_first = ds_ring.MultiheadRingDilatedAttention(16, 4, batch_first=False, causal=True)
    seq_first.load_state_dict(ds_ring.MultiheadRingDilatedAttention(16, 4, causal=True).state_dict())
    assert seq_first(x.transpose(0, 1))[0].shape == (8, 2, 16)
    with pytest.raises(ValueError, match="need_weights"):
        mha(x, need_weights=True)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ds_ring.MultiheadRingDilatedAttention(16, 4, 3)
    with pytest.raises(ValueError, match="dilation_rates"):
        ds_ring.RingDilatedAttention([4, 8], [1])
    with pytest.raises(ValueError, match="unknown setting"):
        mha.attention.configure(segment=3)


def test_modules_drop_into_a_transformer_encoder_layer():
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dropout=0.0)
    layer.self_attn = ds_ring.MultiheadRingDilatedAttention(16, 4, causal=True)
    out = layer(torch.randn(2, 8, 16), is_causal=True, src_mask=None)
    assert out.shape == (2, 8, 16)
