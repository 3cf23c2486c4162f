"""The sequence-parallel loss equals the full-sequence mean, padding and uneven token counts included."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_ring
from tests.dist import CaseLog, assert_no_failures, run_distributed

SEQ, VOCAB = 12, 7


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, SEQ, VOCAB, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    padded = labels.clone()
    padded[0, SEQ // 2 :] = -100  # the second half of sequence 0 is padding: later ranks count fewer tokens
    padded[1, -2:] = -100
    for name, target in (
        ("no padding", labels),
        ("uneven padding", padded),
        ("all padding", torch.full_like(labels, -100)),
    ):
        with log.case(name):
            full = logits.clone().requires_grad_()
            want = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), reduction="sum") / max(
                1, int((target != -100).sum())
            )
            want.backward()
            local = ds_ring.shard_sequence(logits).requires_grad_()
            got = ds_ring.sequence_parallel_cross_entropy(local, ds_ring.shard_sequence(target))
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12)
            got.backward()
            grad = local.grad.clone()
            torch.testing.assert_close(grad, ds_ring.shard_sequence(full.grad), rtol=0, atol=1e-12)
            total = grad.sum()
            dist.all_reduce(total)  # the group's gradients add up to the full gradient
            torch.testing.assert_close(total, full.grad.sum(), rtol=0, atol=1e-12)
    return log.failures


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_loss_matches_full_sequence_mean(world):
    assert_no_failures(run_distributed(_rank, world, timeout=45))
