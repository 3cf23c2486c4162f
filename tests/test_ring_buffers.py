"""The ring receives into buffers allocated once per call, counted through the comm layer's events.

Every ``recv`` event of a ring says whether ``send_recv`` allocated the receive tensor and which
storage it landed in: a ring that reuses its buffers allocates none and uses a fixed number of
storages however many steps it makes (two for K/V blocks, one for the travelling dK/dV).

Large dense blocks travel one K/V head at a time (:func:`ds_ring.strategies.blocks.head_chunks`);
with the size threshold at 0 every dense case here is chunked, and must still equal the oracle.
"""

import itertools

import pytest
import torch

import ds_ring
from ds_ring.hooks import register_hook
from ds_ring.strategies import blocks
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.sharded_cases import ring_rank

B, L, H, D = 1, 16, 4, 8


def _receives(segs, rates, layout: str, kv_heads: int = H) -> dict[tuple[str, str], list]:
    """Receive events of this rank per (direction, op)."""
    rank = torch.distributed.get_rank()
    q = torch.randn(B, L, H, D, requires_grad=True)
    k, v = (torch.randn(B, L, kv_heads, D, requires_grad=True) for _ in range(2))
    events: dict[tuple[str, str], list] = {}
    direction = "forward"

    def record(event) -> None:
        if event.kind == "recv" and event.rank == rank:
            events.setdefault((direction, event.op), []).append(event)

    with register_hook(record):
        out = ds_ring.ring_dilated_attention(q, k, v, segs, rates, causal=True, layout=layout)
        direction = "backward"
        out.sum().backward()
    return events


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    cases = {
        "dense": (None, None, "contiguous", H),
        "dense zigzag": (None, None, "zigzag", H),
        "dense GQA": (None, None, "contiguous", H // 2),
        "dilated": ([L, world * L], [1, 2], "contiguous", H),
    }
    for name, (segs, rates, layout, kv_heads) in cases.items():
        with log.case(f"{name}: no receive allocated, fixed buffers"):
            events = _receives(segs, rates, layout, kv_heads)
            assert events, "the ring made no transfer"
            for (direction, op), recvs in events.items():
                allocated = [e.step for e in recvs if e.extra["recv_allocated"]]
                assert not allocated, f"{direction} {op} allocated a receive at steps {allocated}"
                storages = {e.extra["recv_storage"] for e in recvs}
                assert len(storages) <= (2 if op == "ring_kv" else 1), (direction, op, len(recvs), len(storages))
            if layout == "zigzag" or rank < world - 1:  # causal contiguous: the last rank's block reaches no one
                assert ("backward", "ring_dkv") in events
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_receives_into_reused_buffers(world):
    assert_no_failures(run_distributed(_rank, world, timeout=90))


def _chunked_rank(rank: int, world: int, cases: list[dict]) -> list[str]:
    blocks.CHUNK_BYTES = {**blocks.CHUNK_BYTES, "cpu": 0}  # chunk every dense span (this rank only)
    return ring_rank(rank, world, cases)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_dense_blocks_travelling_one_kv_head_at_a_time_match_reference(world):
    cases = [
        dict(communication=comm, causal=causal, layout=layout, heads=heads, kv_heads=kv_heads, dtype="float64",
             batch=2, seq=world * 6, head_dim=8, seed=i)
        for i, (comm, causal, layout, (heads, kv_heads)) in enumerate(
            itertools.product(["ring", "allgather"], [False, True], ["contiguous", "zigzag"], [(4, 4), (4, 2), (3, 1)])
        )
    ]  # fmt: skip
    assert_no_failures(run_distributed(_chunked_rank, world, timeout=150, cases=cases))
