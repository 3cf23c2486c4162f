"""Every strategy emits start/end attention events with its output and LSE (what the monitor and
the numerics guard read), and the events do not change the result."""

import pytest
import torch

import ds_ring
from tests.dist import CaseLog, assert_no_failures, run_distributed


def _rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    topology = ds_ring.Topology(ulysses=2) if world == 2 else None
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4, 8) for _ in range(3))
    for strategy in ("ring", "allgather", "ulysses", "hybrid"):
        with log.case(strategy):
            plain = ds_ring.sequence_parallel_attention(q, k, v, causal=True, topology=topology, strategy=strategy)
            events = []
            with ds_ring.register_hook(events.append, phases=("start", "end")):
                observed = ds_ring.sequence_parallel_attention(
                    q, k, v, causal=True, topology=topology, strategy=strategy
                )
            assert torch.equal(plain, observed)
            forward = [e for e in events if e.kind == "attention" and e.extra.get("direction") == "forward"]
            assert [e.phase for e in forward] == ["start", "end"], forward
            end = forward[-1]
            assert end.rank == rank and end.seconds > 0 and end.strategy
            assert torch.isfinite(end.extra["out"]).all() and not torch.isnan(end.extra["lse"]).any()
    return log.failures


@pytest.mark.timeout(60)
def test_every_strategy_emits_attention_events():
    assert_no_failures(run_distributed(_rank, 2, timeout=45))
