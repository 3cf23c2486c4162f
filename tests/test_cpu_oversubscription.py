"""CPU ranks that share cores: the Topology records where every rank computes (``ds_ring.comm.cores``), and
``strategy="auto"`` prices a causal contiguous ring's idle steps by it (an idle rank's core runs another rank).

- :func:`oversubscription`: compute threads per core on the busiest machine under a group, every rank of the job
  on that machine counted (another replica's too), cores the union of their affinities; 1 when unknown;
- a Topology built on 2 and 4 gloo ranks records every rank's place: the same numbers on every rank;
- the model: at oversubscription 1 a contiguous causal ring over 4 ranks costs ``2n/(n+1)`` of the balanced
  compute on its spanning work; at 2 (4 ranks on 2 cores) it costs what Ulysses' balanced compute does, and on an
  accelerator the oversubscription is ignored (``auto`` asks for it only on CPU ranks).
"""

from __future__ import annotations

import pytest

from ds_ring.auto.model import Link, Problem, format_table, plan_options
from ds_ring.comm import cores
from ds_ring.comm.cores import CpuPlace, oversubscription
from ds_ring.comm.job import job
from tests.dist import assert_no_failures, run_distributed


@pytest.fixture
def places(monkeypatch):
    """Sets this process's job's places (what a Topology records) for the test."""
    return lambda recorded: monkeypatch.setattr(job(), "places", tuple(recorded))


def test_place_travels_as_text() -> None:
    place = CpuPlace("boot-1", frozenset({0, 3, 5}), 2)
    assert CpuPlace.from_text(place.to_text()) == place
    many = CpuPlace("boot-2", frozenset([*range(0, 64), *range(128, 192), 200]), 64)
    assert many.to_text() == "boot-2|64|0-63,128-191,200"
    assert CpuPlace.from_text(many.to_text()) == many
    here = cores.this_place()
    assert here.threads >= 1 and here.cores and CpuPlace.from_text(here.to_text()) == here


def test_threads_per_core_on_the_busiest_machine(places) -> None:
    assert oversubscription([0, 1]) == 1.0  # nothing recorded
    two_cores = frozenset({0, 1})
    a = [CpuPlace("a", two_cores, 1)] * 4  # ranks 0-3: 4 threads on 2 cores
    b = [CpuPlace("b", frozenset(range(8)), 2)] * 2  # ranks 4-5: 4 threads on 8 cores
    places([*a, *b])
    assert oversubscription([0, 1]) == 2.0  # ranks 2 and 3 (another group) share those cores too
    assert oversubscription([4, 5]) == 1.0  # spare cores: never below 1
    assert oversubscription([3, 4]) == 2.0  # the busiest machine of the group
    pinned = [CpuPlace("c", frozenset({i}), 1) for i in range(4)]  # one core each, disjoint: their union
    places(pinned)
    assert oversubscription(range(4)) == 1.0
    places([CpuPlace("c", frozenset({0}), 3), CpuPlace("c", frozenset({0, 1}), 1)])
    assert oversubscription([0]) == 2.0
    assert oversubscription([0, 9]) == 1.0  # a rank outside the record: unknown
    assert oversubscription([0, 1], [*a, *b]) == 2.0  # places given: the job's are not read


def _recorded(rank: int, world: int) -> tuple[float, str]:
    import ds_ring

    topology = ds_ring.Topology(ring=world)
    mine = cores.this_place()
    expected = max(1.0, world * mine.threads / len(mine.cores))  # every rank here is alike
    assert oversubscription(range(world), topology.places) == oversubscription(range(world))
    return oversubscription(range(world)), f"{expected}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 4])
def test_topology_records_every_rank(world: int) -> None:
    results = run_distributed(_recorded, world, timeout=60)
    values = {value for value, _ in results}
    assert len(values) == 1, results  # every rank read the same record
    assert_no_failures([[] if f"{value}" == expected else [f"{value} != {expected}"] for value, expected in results])


def test_idle_ring_steps_cost_nothing_on_shared_cores() -> None:
    link = Link(latency_s=1e-9, bandwidth=1e15, flops=1e11)

    def compute(oversubscribed: float, strategy: str) -> float:
        p = Problem(seq=8192, heads=8, kv_heads=8, head_dim=64, world=4, layouts=("contiguous",), degrees=((1, 4),),
                    oversubscription=oversubscribed)  # fmt: skip
        return next(o.compute_s for o in plan_options(p, link) if o.strategy == strategy)

    balanced, n = compute(1.0, "ulysses"), 4
    assert compute(1.0, "ring") == pytest.approx(balanced * 2 * n / (n + 1))  # dense causal: all of it spans
    assert compute(1.25, "ring") == pytest.approx(balanced * 2 * n / (n + 1) / 1.25)
    assert compute(2.0, "ring") == pytest.approx(balanced)
    assert compute(4.0, "ring") == pytest.approx(balanced)  # never below the balanced share
    shared = Problem(seq=8192, heads=8, kv_heads=8, head_dim=64, world=4, oversubscription=2.0)
    assert "CPU oversubscription 2" in format_table(shared, plan_options(shared, link), link)


def test_accelerator_ranks_ignore_the_cpu_record(places) -> None:
    import torch

    from ds_ring.auto.strategy import _oversubscription

    places([CpuPlace("a", frozenset({0}), 8)])
    assert _oversubscription(None, torch.device("cuda")) == 1.0
