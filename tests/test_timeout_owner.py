"""Which bound a communication wait gets: the call's ``timeout_s``, else its topology's, else 300 s.

No process-wide default exists to be overwritten: two topologies with different timeouts in one
process keep theirs. Every wait is observed where it happens (``wait_all`` in the comm layer).
"""

from __future__ import annotations

import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import ds_ring
import ds_ring.comm
from ds_ring import RingDilatedAttention, Topology, ring_dilated_attention, sequence_parallel_attention
from ds_ring.comm import DEFAULT_TIMEOUT_S, collectives
from ds_ring.comm import ring_comm as ring
from ds_ring.engine.checkpoint import load_checkpoint
from ds_ring.monitor import RingMonitor
from tests.dist import CaseLog, assert_no_failures, run_distributed


def _record_waits() -> dict[str, set[float]]:
    """Wrap the comm layer's one wait so every timeout it is given is recorded, by op."""
    seen: dict[str, set[float]] = defaultdict(set)
    original = ring.wait_all

    def recording(pending, *, timeout_s, **where):
        seen[where["op"]].add(timeout_s)
        return original(pending, timeout_s=timeout_s, **where)

    ring.wait_all = collectives.wait_all = recording
    return seen


def _bounds(rank: int, world_size: int, tmp: str) -> list[str]:
    seen, log = _record_waits(), CaseLog()
    slow, fast = Topology(ring=world_size, timeout_s=7), Topology(ulysses=world_size, timeout_s=4)
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def waits(run) -> set[float]:
        seen.clear()
        run()
        return set().union(*seen.values())

    def fwd_bwd(**kwargs):
        return lambda: sequence_parallel_attention(q, k, v, causal=True, **kwargs).sum().backward()

    with log.case("ring over a topology: its timeout, forward and backward, agreement included"):
        assert waits(fwd_bwd(topology=slow)) == {7.0}
        assert {"agree:sequence_parallel_attention", "ring_kv", "ring_dkv"} <= set(seen), sorted(seen)
    with log.case("the other topology in the same process keeps its own"):
        assert waits(fwd_bwd(topology=fast, strategy="ulysses")) == {4.0}
        assert waits(fwd_bwd(topology=slow, strategy="allgather")) == {7.0}
    with log.case("a call's own timeout wins"):
        assert waits(fwd_bwd(topology=slow, timeout_s=9)) == {9.0}
    with log.case("a module over a topology"):
        module = RingDilatedAttention(causal=True, topology=fast, strategy="hybrid")
        assert waits(lambda: module(q, k, v).sum().backward()) == {4.0}
    with log.case("the loss and gather_sequence given the topology: its timeout"):
        logits, labels = torch.randn(1, 8, 5, dtype=torch.float64), torch.zeros(1, 8, dtype=torch.long)
        assert waits(lambda: ds_ring.sequence_parallel_cross_entropy(logits, labels, slow)) == {7.0}
        assert waits(lambda: ds_ring.gather_sequence(q.detach(), slow)) == {7.0}
    with log.case("a plain group: 300 s"):
        assert waits(lambda: ring_dilated_attention(q, k, v, causal=True).sum().backward()) == {DEFAULT_TIMEOUT_S}
    with log.case("the monitor's collectives: the section's"):
        monitor = RingMonitor(numerics_guard="skip_step", watchdog=False, timeout_s=5)
        monitor.begin_step(0)
        assert waits(monitor.skip_step) == {5.0}
        monitor.close()
    with log.case("checkpoint agreement: the engine's topology's"):
        assert waits(lambda: load_checkpoint(types.SimpleNamespace(mpu=slow), tmp)) == {7.0}
    return log.failures


@pytest.mark.timeout(120)
def test_a_wait_is_bounded_by_the_call_or_its_topology(tmp_path: Path) -> None:
    assert_no_failures(run_distributed(_bounds, 2, timeout=90, tmp=str(tmp_path)))


def test_no_process_wide_default_to_overwrite() -> None:
    assert DEFAULT_TIMEOUT_S == 300.0
    assert not hasattr(ds_ring.comm, "set_default_timeout")


def test_a_bad_topology_timeout_is_refused_before_any_communication() -> None:
    # No process group exists in this process: the argument is checked before torch.distributed is asked.
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0, got 0"):
        Topology(timeout_s=0)
