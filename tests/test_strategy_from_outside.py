"""A strategy is one module plus one registration: a toy strategy defined and registered here, outside the package,
is selected from a ds_config (with its own degree rule and checks) and by ``strategy="auto"`` (its own cost and
memory model), and the run ``auto`` makes with it equals the float64 oracle."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from ds_ring.strategies import AttentionCall, Bound, Degrees, Shape, Strategy, Target, get_strategy, register_strategy
from ds_ring.strategies.cost import Cost, Link, Option, Problem
from ds_ring.strategies.registry import PLUGINS
from tests.dist import run_distributed
from tests.sharded_cases import run_cases


class Toy(Strategy):
    """Runs like the ring, refuses odd ring degrees in a ds_config, and predicts itself free."""

    name = "toy"

    def check_degrees(self, ulysses_degree: int | None, ring_degree: int | None) -> None:
        if ring_degree is not None and ring_degree % 2:
            raise ValueError(f"ring_degree is {ring_degree} but strategy 'toy' needs an even one; use 2 or 4")

    def check(self, call: AttentionCall, shape: Shape | None, degrees: Degrees | None) -> None:
        get_strategy("ring").check(call, shape, degrees)

    def prepare(self, call: AttentionCall, target: Target) -> Bound:
        return get_strategy("ring").prepare(call, target)

    def options(self, problem: Problem) -> list[Option]:
        comm = problem.communication or "ring"
        return [Option(self.name, comm, layout, 1, problem.world, problem.local) for layout in problem.layouts]

    def cost(self, problem: Problem, option: Option, link: Link) -> Cost:
        return Cost(1e-9, 0.0, 0.0, 0.0)

    def memory_q_shards(self, problem: Problem, option: Option, buffers: dict[str, float] | None = None) -> float:
        return 1.0


def _register() -> None:
    register_strategy(Toy())


@pytest.fixture
def toy() -> Iterator[None]:
    _register()
    yield
    PLUGINS.strategies.entries.pop(Toy.name)


def test_a_ds_config_selects_it_with_its_own_rules(toy: None) -> None:
    from ds_ring.config import load_config

    section = load_config({"ring_attention": {"strategy": "toy", "ring_degree": 2}})
    assert section.strategy == "toy"
    section.check(world_size=2, num_heads=4, seq_len=64)
    with pytest.raises(ValueError, match=r"ring_attention\.ring_degree is 3 but strategy 'toy' needs an even one"):
        load_config({"ring_attention": {"strategy": "toy", "ring_degree": 3}})
    with pytest.raises(ValueError, match="layout='zigzag' supports dense attention only"):  # the ring's refusal
        load_config({"ring_attention": {"strategy": "toy", "layout": "zigzag", "segment_lengths": [8],
                                        "dilation_rates": [2]}})  # fmt: skip


def test_auto_ranks_it_by_its_own_model(toy: None) -> None:
    from ds_ring.auto.model import choose, plan_options

    problem = Problem(seq=4096, heads=8, kv_heads=8, head_dim=64, world=4, layouts=("contiguous",))
    best = choose(problem, Link())
    assert (best.strategy, best.memory_q_shards, best.time_s) == ("toy", 1.0, 1e-9)
    assert {o.strategy for o in plan_options(problem, Link())} >= {"ring", "allgather", "ulysses", "hybrid", "toy"}


def test_auto_is_unchanged_without_it() -> None:
    from ds_ring.auto.model import choose

    problem = Problem(seq=4096, heads=8, kv_heads=8, head_dim=64, world=4, layouts=("contiguous",))
    assert choose(problem, Link()).strategy != "toy"


def _rank(rank: int, world: int) -> tuple[list[str], list[str]]:
    import ds_ring
    from ds_ring.auto import strategy

    _register()
    seq = 8 * world
    case = dict(batch=1, seq=seq, heads=4, kv_heads=2, head_dim=4, dtype="float64", head_offset=0, causal=True,
                layout="contiguous", communication=None, segments=None, rates=None, seed=3)  # fmt: skip
    dilated = dict(case, segments=[4, seq], rates=[1, 2], causal=False, seed=4)
    attention = functools.partial(ds_ring.ring_dilated_attention, strategy="auto")
    failures = run_cases([case, dilated], attention)
    return failures, [o.strategy for o in strategy.decisions()]


@pytest.mark.timeout(120)
def test_auto_runs_it_and_matches_the_reference() -> None:
    for failures, picks in run_distributed(_rank, 2, timeout=100):
        assert failures == []
        assert picks == ["toy", "toy"]
