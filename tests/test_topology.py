"""Topology: the rank layout (pure), degree checks, the spawned groups and the mpu DeepSpeed reads."""

import copy
import types

import pytest

from ds_ring.parallel.layout import ROLES, RankLayout, rank_layout
from ds_ring.parallel.topology import Topology
from tests.dist import CaseLog, assert_no_failures, run_distributed

# 8 ranks as 2 data × 2 ring × 2 ulysses: rank = d·4 + r·2 + u.
EXPECTED_8 = {
    "sequence_parallel": ((0, 1, 2, 3), (4, 5, 6, 7)),
    "ulysses": ((0, 1), (2, 3), (4, 5), (6, 7)),
    "ring": ((0, 2), (1, 3), (4, 6), (5, 7)),
    "data_parallel": ((0, 4), (1, 5), (2, 6), (3, 7)),
    "sequence_data_parallel": (tuple(range(8)),),
    "model_parallel": tuple((r,) for r in range(8)),
}


def test_layout_of_8_ranks_as_2_data_2_ulysses_2_ring():
    layout = rank_layout(8, data_parallel=2, ulysses=2, ring=2)
    assert {role: layout.groups(role) for role in ROLES} == EXPECTED_8
    assert [layout.coords(r) for r in range(8)] == [(d, r, u) for d in (0, 1) for r in (0, 1) for u in (0, 1)]
    assert [layout.sequence_parallel_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert layout.group_of("ring", 5) == (5, 7) and layout.group_of("ulysses", 5) == (4, 5)


@pytest.mark.parametrize(("d", "u", "r"), [(1, 1, 6), (1, 6, 1), (2, 3, 1), (3, 2, 2), (2, 2, 3)])
def test_every_role_partitions_the_ranks(d, u, r):
    layout = RankLayout(d, u, r)
    for role in ROLES:
        groups = layout.groups(role)
        assert sorted(rank for g in groups for rank in g) == list(range(layout.world_size)), role
        assert all(list(g) == sorted(g) for g in groups), role
    for rank in range(layout.world_size):  # ulysses innermost, then ring: the SP group is consecutive
        dd, rr, uu = layout.coords(rank)
        assert layout.rank(dd, rr, uu) == rank and layout.sequence_parallel_rank(rank) == rr * u + uu
        assert layout.group_of("ring", rank) == tuple(range(dd * u * r + uu, (dd + 1) * u * r, u))


def test_degree_product_error_names_every_factor():
    with pytest.raises(ValueError, match=r"data_parallel 2 × ulysses 2 × ring 3 = 12 ≠ world size 8") as err:
        rank_layout(8, data_parallel=2, ulysses=2, ring=3)
    assert "ulysses × ring = 6 must divide the world size" in str(err.value)
    with pytest.raises(ValueError, match=r"= 4 ≠ world size 8.*use data_parallel 2"):
        rank_layout(8, data_parallel=1, ulysses=2, ring=2)


@pytest.mark.parametrize(("name", "value"), [("ulysses", 0), ("ring", -1), ("data_parallel", 1.5), ("ring", True)])
def test_degree_must_be_a_positive_integer(name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {value!r}"):
        rank_layout(8, **{name: value})


@pytest.mark.parametrize(
    ("section", "world", "degrees"),
    [
        ({"ulysses_degree": 2, "ring_degree": 2}, 8, (2, 2, 2)),
        ({"ulysses_degree": 2, "ring_degree": 2, "sequence_parallel_size": 4}, 4, (1, 2, 2)),
        ({"sequence_parallel_size": 4}, 8, (2, 1, 4)),
        ({"sequence_parallel_size": 4, "ulysses_degree": 4}, 4, (1, 4, 1)),
        ({"sequence_parallel_size": 4, "ring_degree": 2}, 4, (1, 2, 2)),
        ({"ulysses_degree": 2}, 8, (1, 2, 4)),  # no size given: the whole world shares one sequence
        ({}, 4, (1, 1, 4)),
        (types.SimpleNamespace(ulysses_degree=2, ring_degree=1, sequence_parallel_size=None), 4, (2, 2, 1)),
    ],
)
def test_layout_from_config(section, world, degrees):
    layout = RankLayout.from_config(section, world)
    assert (layout.data_parallel, layout.ulysses, layout.ring) == degrees


@pytest.mark.parametrize(
    ("section", "world", "message"),
    [
        ({"ulysses_degree": 2, "ring_degree": 3}, 8, r"ulysses_degree 2 × ring_degree 3 = 6 does not divide the world"),
        ({"ulysses_degree": 2, "ring_degree": 2, "sequence_parallel_size": 8}, 8, r"2 × ring_degree 2 = 4 ≠ seq"),
        ({"sequence_parallel_size": 6, "ulysses_degree": 4}, 12, r"sequence_parallel_size 6 is not a multiple of"),
        ({"ring_degree": 0}, 4, r"ring_degree must be an integer >= 1, got 0"),
    ],
)
def test_layout_from_config_errors(section, world, message):
    with pytest.raises(ValueError, match=message):
        RankLayout.from_config(section, world)


def _start_deepspeed_comm(rank: int) -> None:
    """deepspeed.comm over the already initialised gloo group (as a launcher would leave it)."""
    import os

    import deepspeed

    # The CPU accelerator JIT-compiles a shared-memory all-reduce kernel when DeepSpeed's comm
    # backend starts (about a minute on 2 cores, once per machine); nothing here needs it.
    deepspeed.comm.torch.build_shm_op = lambda: None
    os.environ["LOCAL_RANK"] = str(rank)
    deepspeed.init_distributed(dist_backend="gloo")


def _deepspeed_view(topology: Topology) -> dict:
    """What DeepSpeed 0.19 reads from an mpu (utils/groups.py, utils/bwc.py), with this topology as mpu."""
    import torch.distributed as dist
    from deepspeed.utils import bwc, groups

    groups.mpu = topology
    try:
        return dict(
            sp=groups._get_sequence_parallel_world_size(),
            sp_rank=groups._get_sequence_parallel_rank(),
            sp_group=dist.get_process_group_ranks(groups._get_sequence_parallel_group()),
            sdp=groups._get_sequence_data_parallel_world_size(),
            sdp_rank=groups._get_sequence_data_parallel_rank(),
            sdp_group=dist.get_process_group_ranks(groups._get_sequence_data_parallel_group()),
            dp=groups._get_data_parallel_world_size(),
            dp_group=dist.get_process_group_ranks(groups._get_data_parallel_group()),
            mp=groups._get_model_parallel_world_size(),
            tp_rank=bwc.bwc_tensor_model_parallel_rank(topology),
            tp=bwc.bwc_tensor_model_parallel_world_size(topology),
            pp=bwc.bwc_pipeline_parallel_world_size(topology),
        )
    finally:
        groups.mpu = None


def _groups_rank(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    _start_deepspeed_comm(rank)
    log = CaseLog()
    for d, u, r in [(1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 4, 1)]:
        topology = Topology(data_parallel=d, ulysses=u, ring=r)
        layout = topology.layout
        with log.case(f"groups d{d} u{u} r{r}"):
            for role in ROLES:
                group = getattr(topology, f"{role}_group")
                want = layout.group_of(role, rank)
                assert dist.get_process_group_ranks(group) == list(want), role
                total = torch.tensor([float(rank)])
                dist.all_reduce(total, group=group)  # the group really connects those ranks
                assert total.item() == sum(want), role
        with log.case(f"mpu d{d} u{u} r{r}"):
            t = topology
            assert (t.get_ulysses_rank(), t.get_ring_rank(), t.get_data_parallel_rank()) == (
                dist.get_rank(t.ulysses_group), dist.get_rank(t.ring_group), dist.get_rank(t.data_parallel_group)
            )  # fmt: skip
            assert t.get_sequence_parallel_rank() == dist.get_rank(t.sequence_parallel_group)
            assert t.get_sequence_data_parallel_rank() == dist.get_rank(t.sequence_data_parallel_group)
            assert t.get_data_parallel_group_ranks() == list(layout.group_of("data_parallel", rank))
            assert not hasattr(t, "initialize_sequence_parallel")  # DeepSpeed would ignore our dp group
            assert copy.deepcopy(t) is t  # process groups cannot be copied; models holding t can
            view = _deepspeed_view(t)
            assert view == dict(
                sp=u * r, sp_rank=rank % (u * r), sp_group=list(layout.group_of("sequence_parallel", rank)),
                sdp=world, sdp_rank=rank, sdp_group=list(range(world)),
                dp=d, dp_group=list(range(world)),  # the group ZeRO-3 partitions over: every rank
                mp=1, tp_rank=0, tp=1, pp=1,
            ), view  # fmt: skip
            # ZeRO divides the gradients summed over the sequence-data-parallel group by this:
            assert view["sdp"] / view["sp"] == d
    return log.failures


@pytest.mark.timeout(90)
def test_spawned_topology_groups_and_mpu():
    assert_no_failures(run_distributed(_groups_rank, 4, timeout=80))


def _zero_step_rank(rank: int, world: int, stage: int) -> tuple[list[float], float]:
    import deepspeed
    import torch

    topology = Topology(data_parallel=2, ulysses=1, ring=2)
    _start_deepspeed_comm(rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    before = model.weight.detach().clone()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=topology, model_parameters=model.parameters())
    try:
        assert (engine.dp_world_size, engine.seq_dp_world_size, engine.sequence_parallel_size) == (2, 4, 2)
        assert engine.mp_world_size == 1 and engine.train_batch_size() == 2  # micro batch × data parallel
        # Rank r's "sequence shard" contributes gradient (r + 1) to every weight.
        engine.backward(engine(torch.full((1, 4), float(rank + 1))).sum())
        engine.step()
        return (before - engine.module.weight.detach()).flatten().tolist(), float(engine.get_global_grad_norm())
    finally:
        deepspeed.utils.groups.mpu = None


@pytest.mark.timeout(90)
def test_deepspeed_zero_sums_over_sequence_and_averages_over_data_parallel():
    results = run_distributed(_zero_step_rank, 4, timeout=80, stage=2)
    # Each data-parallel replica's gradient is the sum over its 2 sequence shards; the step averages
    # the 2 replicas: (1 + 2 + 3 + 4) / 2 = 5 per weight, global norm sqrt(4 · 25) = 10.
    for step, norm in results:
        assert step == pytest.approx([5.0] * 4)
        assert norm == pytest.approx(10.0)


def _bad_topology_rank(rank: int, world: int) -> list[str]:
    log = CaseLog()
    for kwargs, message in [
        (dict(data_parallel=3), r"data_parallel 3 × ulysses 1 × ring 1 = 3 ≠ world size 4"),
        (dict(ulysses=2, ring=3), r"data_parallel 1 × ulysses 2 × ring 3 = 6 ≠ world size 4"),
        (dict(ulysses=0, ring=4), r"ulysses must be an integer >= 1, got 0"),
    ]:
        with log.case(str(kwargs)), pytest.raises(ValueError, match=message):
            Topology(**kwargs, timeout_s=10)
    if rank == 0:  # alone: checked before the ranks agree on the degrees
        with log.case("from_config"), pytest.raises(ValueError, match="world_size 8 was given but"):
            Topology.from_config({"ring_degree": 2}, 8)
    return log.failures


@pytest.mark.timeout(60)
def test_bad_degrees_raise_on_every_rank_before_any_group_is_made():
    assert_no_failures(run_distributed(_bad_topology_rank, 4, timeout=50))


def _disagreeing_topology_rank(rank: int, world: int) -> list[str]:
    """Rank 1 builds other degrees (once valid, once not): every rank raises, naming each rank's values."""
    log = CaseLog()
    cases = [
        (dict(ring=2, ulysses=1) if rank == 1 else dict(ring=1, ulysses=2),
         ["ulysses: ranks 0, 2, 3 have 2, rank 1 has 1", "ring: ranks 0, 2, 3 have 1, rank 1 has 2", "same degrees"]),
        (dict(ring=3) if rank == 1 else dict(ring=4), ["ring: ranks 0, 2, 3 have 4, rank 1 has 3"]),
    ]  # fmt: skip
    for kwargs, needles in cases:
        with log.case(f"Topology {kwargs}"), pytest.raises(ValueError, match="disagree on Topology") as caught:
            Topology(**kwargs, timeout_s=10)
        for needle in needles:
            with log.case(f"Topology {kwargs} names {needle!r}"):
                assert needle in str(caught.value), str(caught.value)
    with log.case("from_config"), pytest.raises(ValueError, match="disagree on Topology.from_config") as caught:
        Topology.from_config({"ring_degree": 2 if rank == 1 else 4, "timeout_s": 10}, 4)
    with log.case("from_config names the field"):
        assert "ring_degree: ranks 0, 2, 3 have 4, rank 1 has 2" in str(caught.value), str(caught.value)
    with log.case("agreeing ranks then build it"):
        assert Topology(ring=4, timeout_s=10).ring == 4
    return log.failures


@pytest.mark.timeout(60)
def test_ranks_that_build_other_degrees_all_raise():
    assert_no_failures(run_distributed(_disagreeing_topology_rank, 4, timeout=50))


def test_topology_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        Topology(ring=2)
