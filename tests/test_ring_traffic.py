"""What the ring actually moves, counted by a hook on the communicator (not read from the code).

- dense ring forward: each rank sends exactly p - 1 K/V blocks and never holds more than two
  remote blocks at once;
- dense ring backward: each rank sends exactly p - 1 dK/dV blocks (none of them an empty
  accumulator), the same bytes the previous rank sent as K/V in the forward, causal or not,
  contiguous or zigzag;
- a dilated branch with rate r sends 1/r of the dense ring's bytes; shard-local branches send
  nothing; a branch spanning s ranks makes s - 1 hops, not p - 1, and its gradients as many;
- a causal packed document crossing one boundary, and a sliding window no longer than a shard, move
  their rows one hop forward and their gradients one transfer back.
"""

import pytest
import torch

import ds_ring
from ds_ring.hooks import register_hook
from tests.dist import CaseLog, assert_no_failures, run_distributed

B, L, H, D = 1, 12, 4, 8


def _traffic(segs, rates, kv_heads: int = H, backward: bool = False, **options) -> dict:
    """Transfers of this rank per op (``kv``: K/V blocks, ``dkv``: gradient blocks): count and bytes, and the
    most remote K/V blocks alive at once."""
    rank = torch.distributed.get_rank()
    q = torch.randn(B, L, H, D, requires_grad=backward)
    k, v = (torch.randn(B, L, kv_heads, D, requires_grad=backward) for _ in range(2))
    events = []
    with register_hook(events.append):
        out = ds_ring.ring_dilated_attention(q, k, v, segs, rates, **options)
        if backward:
            out.sum().backward()
    counts = {}
    for name, op in (("kv", "ring_kv"), ("dkv", "ring_dkv")):  # a transfer: one step of a ring that sent bytes
        steps = [e for e in events if e.kind == "ring_step" and e.phase == "end" and e.op == op and e.rank == rank]
        counts[name] = sum(e.nbytes > 0 for e in steps)
        counts[f"{name}_bytes"] = sum(e.nbytes for e in steps)
    recvs = [e for e in events if e.kind == "recv" and e.op == "ring_kv"]
    counts["max_live"] = max((e.extra["live_remote_blocks"] for e in recvs), default=0)
    counts["all_bytes"] = sum(e.nbytes for e in events if e.kind == "send")
    return counts


def _everyone(world: int, value: int) -> list[int]:
    """``value`` of every rank, in rank order."""
    values = [None] * world
    torch.distributed.all_gather_object(values, value)
    return values


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    block_bytes = 2 * B * L * H * D * 4  # one rank's K and V, fp32
    with log.case("dense forward: p-1 blocks, <= 2 live"):
        t = _traffic(None, None)
        assert t["kv"] == world - 1, t
        assert t["kv_bytes"] == (world - 1) * block_bytes, t
        assert t["max_live"] <= 2, t
    for causal in (False, True):
        for layout in ("contiguous", "zigzag"):
            name = f"dense {'causal' if causal else 'full'} {layout} forward+backward"
            with log.case(f"{name}: the previous rank's forward K/V transfers back as dK/dV, <= 2 live blocks"):
                t = _traffic(None, None, backward=True, causal=causal, layout=layout)
                forward = _everyone(world, (t["kv"] // 2, t["kv_bytes"] // 2))  # K/V rotate twice: fwd and bwd
                assert (t["dkv"], t["dkv_bytes"]) == forward[(rank - 1) % world], (t, forward)
                if not (causal and layout == "contiguous"):  # there the last rank's block reaches no one
                    assert t["dkv"] == world - 1, t
                if not causal:
                    assert t["dkv_bytes"] == (world - 1) * block_bytes, t
                assert t["max_live"] <= 2, t
    with log.case("GQA: K/V travel with their own (fewer) heads"):
        t = _traffic(None, None, kv_heads=H // 2)
        assert t["kv_bytes"] == (world - 1) * block_bytes // 2, t
    for rate in (2, 4):
        with log.case(f"dilated rate {rate}: 1/{rate} of the dense bytes"):
            t = _traffic([world * L], [rate])
            assert t["kv_bytes"] == (world - 1) * block_bytes // rate, t
    with log.case("local-only branches send nothing"):
        t = _traffic([L // 2, L], [1, 2], backward=True)
        assert t["all_bytes"] == 0, t
    if world == 4:
        with log.case("a branch spanning 2 of 4 ranks makes 1 hop, and its gradient 1 transfer"):
            t = _traffic([2 * L], [1], backward=True)
            assert t["kv"] == 2 and t["kv_bytes"] == 2 * block_bytes, t  # forward and backward
            assert t["dkv"] == 1 and t["dkv_bytes"] == block_bytes, t
        last, first = rank == world - 1, rank == 0
        with log.case("a causal packed document crossing one boundary: one K/V hop, one gradient transfer"):
            seq = world * L
            crossing = [0, L // 2, *range(L + L // 2, seq, L), seq]  # every document crosses one boundary
            t = _traffic(None, None, backward=True, causal=True, cu_seqlens=crossing)
            rows = 2 * B * (L // 2) * H * D * 4  # K/V rows of the document's part on the earlier rank
            assert (t["kv"], t["kv_bytes"]) == ((0, 0) if last else (2, 2 * rows)), t
            assert (t["dkv"], t["dkv_bytes"]) == ((0, 0) if first else (1, rows)), t
        window = L // 2
        with log.case(f"window {window} <= shard: the last {window - 1} rows go once to the next rank and back"):
            t = _traffic(None, None, backward=True, causal=True, window=window)
            rows = 2 * B * (window - 1) * H * D * 4
            assert (t["kv"], t["kv_bytes"]) == ((0, 0) if last else (2, 2 * rows)), t
            assert (t["dkv"], t["dkv_bytes"]) == ((0, 0) if first else (1, rows)), t
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_traffic(world):
    assert_no_failures(run_distributed(_rank, world, timeout=90))
