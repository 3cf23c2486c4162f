"""The ring receives into buffers allocated once per call, counted through the comm layer's events.

Every ``recv`` event of a ring says whether ``send_recv`` allocated the receive tensor and which
storage it landed in: a ring that reuses its buffers allocates none and uses a fixed number of
storages however many steps it makes (two for K/V blocks, one for the travelling dK/dV).
"""

import pytest
import torch

import ds_ring
from ds_ring.hooks import register_hook
from tests.dist import CaseLog, run_distributed

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
            assert ("backward", "ring_dkv") in events
    return log.failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_receives_into_reused_buffers(world):
    failures = [f for per_rank in run_distributed(_rank, world, timeout=90) for f in per_rank]
    assert not failures, "\n".join(failures[:3])
