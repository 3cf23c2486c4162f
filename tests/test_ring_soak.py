"""200 consecutive forward+backward calls at world size 4 with changing shapes finish, no hang."""

import random

import pytest
import torch

import ds_ring
from tests.dist import run_distributed


def _rank(rank: int, world: int, calls: int) -> int:
    chooser = random.Random(0)  # same sequence of shapes on every rank
    for call in range(calls):
        local = chooser.choice([2, 4, 6, 8])
        heads, kv_heads = chooser.choice([(2, 2), (4, 2), (4, 1)])
        comm = chooser.choice(["ring", "allgather"])
        causal = chooser.random() < 0.5
        layout = chooser.choice(["contiguous", "zigzag"])
        segs, rates = chooser.choice([(None, None), ([local, 2 * local], [1, 2]), ([world * local], [2])])
        if segs is not None:
            layout = "contiguous"
        torch.manual_seed(call)
        q = torch.randn(1, local, heads, 4, requires_grad=True)
        k, v = (torch.randn(1, local, kv_heads, 4, requires_grad=True) for _ in range(2))
        out = ds_ring.ring_dilated_attention(
            q, k, v, segs, rates, causal=causal, communication=comm, layout=layout, timeout_s=30
        )
        out.square().sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    return calls


@pytest.mark.timeout(240)
def test_soak_200_calls_world_4():
    assert run_distributed(_rank, 4, timeout=200, calls=200) == [200] * 4
