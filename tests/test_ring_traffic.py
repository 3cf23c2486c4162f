"""What the ring actually moves, counted by a hook on the communicator (not read from the code).

- dense ring forward: each rank sends exactly p - 1 K/V blocks and never holds more than two
  remote blocks at once;
- a dilated branch with rate r sends 1/r of the dense ring's bytes; shard-local branches send
  nothing; a branch spanning s ranks makes s - 1 hops, not p - 1.
"""

import pytest
import torch

import ds_ring
from ds_ring.hooks import register_hook
from tests.dist import CaseLog, assert_no_failures, run_distributed

B, L, H, D = 1, 12, 4, 8


def _traffic(world: int, segs, rates, kv_heads: int = H, backward: bool = False) -> dict:
    rank = torch.distributed.get_rank()
    q = torch.randn(B, L, H, D, requires_grad=backward)
    k, v = (torch.randn(B, L, kv_heads, D, requires_grad=backward) for _ in range(2))
    events = []
    with register_hook(events.append):
        out = ds_ring.ring_dilated_attention(q, k, v, segs, rates)
        if backward:
            out.sum().backward()
    sends = [e for e in events if e.kind == "send" and e.op == "ring_kv" and e.rank == rank]
    recvs = [e for e in events if e.kind == "recv" and e.op == "ring_kv"]
    return dict(
        sends=len(sends),
        bytes=sum(e.nbytes for e in sends),
        max_live=max((e.extra["live_remote_blocks"] for e in recvs), default=0),
        all_bytes=sum(e.nbytes for e in events if e.kind == "send"),
    )


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    block_bytes = 2 * B * L * H * D * 4  # one rank's K and V, fp32
    with log.case("dense forward: p-1 blocks, <= 2 live"):
        t = _traffic(world, None, None)
        assert t["sends"] == world - 1, t
        assert t["bytes"] == (world - 1) * block_bytes, t
        assert t["max_live"] <= 2, t
    with log.case("dense forward+backward: still <= 2 live K/V blocks"):
        t = _traffic(world, None, None, backward=True)
        assert t["sends"] == 2 * (world - 1), t  # K/V rotate once forward and once backward
        assert t["max_live"] <= 2, t
    with log.case("GQA: K/V travel with their own (fewer) heads"):
        t = _traffic(world, None, None, kv_heads=H // 2)
        assert t["bytes"] == (world - 1) * block_bytes // 2, t
    for rate in (2, 4):
        with log.case(f"dilated rate {rate}: 1/{rate} of the dense bytes"):
            t = _traffic(world, [world * L], [rate])
            assert t["bytes"] == (world - 1) * block_bytes // rate, t
    with log.case("local-only branches send nothing"):
        t = _traffic(world, [L // 2, L], [1, 2], backward=True)
        assert t["all_bytes"] == 0, t
    if world == 4:
        with log.case("a branch spanning 2 of 4 ranks makes 1 hop"):
            t = _traffic(world, [2 * L], [1])
            assert t["sends"] == 1 and t["bytes"] == block_bytes, t
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_traffic(world):
    assert_no_failures(run_distributed(_rank, world, timeout=90))
