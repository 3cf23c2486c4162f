"""Every strategy of sequence_parallel_attention equals the oracle on the gathered tensors.

One spawn per topology (ulysses × ring, and data parallel × ...), many cases per spawn: forward,
LSE and q/k/v gradients against the float64 oracle, dense and dilated, causal and not, GQA with
fewer K/V heads than ranks, a caller head offset, both layouts. Head counts and rates are chosen
so that the dilation offsets of the head shards differ between ranks, which catches a strategy
that uses local instead of global head indices.
"""

import functools
import itertools

import pytest
import torch

import ds_ring.kernels.overwrite as overwrite
from ds_ring.calls import sequence_parallel_attention
from ds_ring.parallel.topology import Topology
from ds_ring.strategies import get_strategy, strategy_names
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.sharded_cases import run_cases

L = 8  # rows per rank
STRATEGIES = [("ring", "ring"), ("allgather", None), ("ulysses", None), ("hybrid", "ring"), ("hybrid", "allgather")]


def _branches(seq: int) -> list[tuple[list[int], list[int]] | tuple[None, None]]:
    # Segments shorter than, equal to, twice and all of a shard: valid for every strategy
    # (hybrid's ring shard is ulysses × L); rates 2-4 give ranks' head shards different offsets.
    return [(None, None), ([L // 2, 2 * L, seq], [1, 2, 4]), ([L, seq], [3, 2])]


def _heads(world: int) -> list[tuple[int, int, int]]:
    """(heads, kv_heads, head_offset): MHA, GQA with a caller offset, one K/V head (replicated)."""
    extra = [(6, 3, 0)] if world == 2 else [(8, 2, 0)]  # 3 K/V heads over 2 ranks / 2 over 4
    return [(4, 4, 0), (4, 2, 1), (4, 1, 0), *extra]


def _cases(world: int, ring: int) -> list[dict]:
    """Every strategy × branch list × head configuration; causal alternates (both for each pair)."""
    seq = world * L
    cases = []
    combos = itertools.product(STRATEGIES, _branches(seq), _heads(world))
    for i, ((strategy, comm), (segs, rates), (h, hkv, offset)) in enumerate(combos):
        cases.append(
            dict(strategy=strategy, communication=comm, segments=segs, rates=rates, causal=i % 2 == 1, heads=h,
                 kv_heads=hkv, head_offset=offset, layout="contiguous", batch=2, seq=seq, head_dim=4, seed=i,
                 dtype="float32" if i % 5 == 4 else "float64",
                 block_rows=None if i % 4 == 0 else 6)  # backward calls of ≤ 6 rows a side: uneven tiles, blocks
        )  # fmt: skip
    for strategy, comm in STRATEGIES:  # zigzag: dense causal everywhere, dilated where supported
        cases.append(dict(cases[0], strategy=strategy, communication=comm, layout="zigzag", causal=True, seed=100))
        if strategy == "ulysses" or (strategy == "hybrid" and ring == 1):
            segs, rates = _branches(seq)[1]
            cases.append(dict(cases[-1], segments=segs, rates=rates, heads=4, kv_heads=1, seed=101))
    return cases


def _rank(rank: int, world: int, data: int, ulysses: int, ring: int) -> list[str]:
    topology = Topology(data_parallel=data, ulysses=ulysses, ring=ring)
    failures = []
    for case in _cases(world // data, ring):
        attention = functools.partial(
            sequence_parallel_attention,
            topology=topology,
            strategy=case["strategy"],
            communication=case["communication"],
        )
        failures += run_cases([case], attention, group=topology.sequence_parallel_group)
    return failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("data", "ulysses", "ring"),
    [(1, 2, 1), (1, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4), (2, 2, 1)],
    ids=["u2", "r2", "u2xr2", "u4", "r4", "d2xu2"],
)
def test_every_strategy_matches_reference(data, ulysses, ring):
    world = data * ulysses * ring
    results = run_distributed(_rank, world, timeout=100, data=data, ulysses=ulysses, ring=ring)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures, first:\n" + "\n".join(failures[:2])


def _bad_call_rank(rank: int, world: int) -> list[str]:
    """Every rank makes the same bad call: every rank raises the same ValueError (the ranks first agree
    that their calls are alike, then the strategy refuses before any data moves)."""
    topology = Topology(ulysses=2, ring=2)
    log = CaseLog()
    zigzag_dilated = dict(layout="zigzag", segment_lengths=[L, 4 * L], dilation_rates=[1, 2])
    for heads, kv_heads, kwargs, message in [
        (4, 4, dict(strategy="tree"), r"strategy must be one of \['allgather', 'auto', 'hybrid', 'ring', 'ulysses'\]"),
        (4, 4, dict(strategy="hybrid", communication="bcast"), r"communication must be one of"),
        (4, 4, dict(strategy="ulysses", layout="striped"), r"layout must be one of"),
        (4, 4, dict(strategy="hybrid", layout="striped"), r"layout must be one of"),
        (3, 3, dict(strategy="hybrid"), r"3 query heads cannot be split over an all-to-all of 2 ranks"),
        (6, 2, dict(strategy="ulysses"), r"splits the 6 heads over .* \(ulysses 2 × ring 2 = 4 ranks\)"),
        (4, 3, dict(strategy="ulysses"), r"q heads \(4\) must be a multiple of k/v heads \(3\)"),
        (4, 4, dict(strategy="hybrid", **zigzag_dilated), r"'hybrid' with a ring degree of 2 .* strategy 'ulysses'"),
        (4, 4, dict(strategy="ring", **zigzag_dilated), r"layout='zigzag' supports dense attention only"),
        (4, 4, dict(strategy="ulysses", segment_lengths=[8, 16], dilation_rates=[1]), r"same length"),
        (4, 4, dict(strategy="hybrid", timeout_s=-1.0), r"timeout must be a finite number of seconds > 0"),
    ]:
        with log.case(f"{heads}/{kv_heads} {kwargs}"), pytest.raises(ValueError, match=message):
            q, k, v = torch.randn(1, L, heads, 4), torch.randn(1, L, kv_heads, 4), torch.randn(1, L, kv_heads, 4)
            sequence_parallel_attention(q, k, v, topology=topology, **{"timeout_s": 10.0, **kwargs})
    with log.case("zigzag odd shard"), pytest.raises(ValueError, match=r"local sequence length must be even"):
        q = torch.randn(1, L - 1, 4, 4)
        sequence_parallel_attention(q, q, q, topology=topology, strategy="ulysses", layout="zigzag", timeout_s=10.0)
    return log.failures


@pytest.mark.timeout(60)
def test_bad_calls_raise_value_error_on_every_rank_before_any_data_moves():
    assert_no_failures(run_distributed(_bad_call_rank, 4, timeout=50))


def test_strategy_registry():
    assert set(strategy_names()) >= {"ring", "allgather", "ulysses", "hybrid"}
    assert get_strategy("hybrid") is get_strategy("hybrid")
    with pytest.raises(ValueError, match=r"strategy must be one of .* got 'tree'"):
        get_strategy("tree")


def _modified_output_rank(rank: int, world: int) -> list[str]:
    """The backward reads the returned output (Delta on the sequence shards): changing it in place is refused."""
    log = CaseLog()
    topology = Topology(ulysses=2)
    for strategy in ("ulysses", "hybrid"):
        with log.case(strategy), pytest.raises(RuntimeError, match=r"modified in place after the call"):
            q, k, v = (torch.randn(1, L, 4, 4, requires_grad=True) for _ in range(3))
            out = sequence_parallel_attention(q, k, v, topology=topology, strategy=strategy, causal=True)
            out.mul_(2)
            out.sum().backward()
    return log.failures


@pytest.mark.timeout(60)
def test_output_changed_in_place_is_refused():
    assert_no_failures(run_distributed(_modified_output_rank, 2, timeout=50))


def _second_backward_rank(rank: int, world: int) -> list[str]:
    """Dense Ulysses over more rows than a block writes its gradients over its head shards: a second backward through
    the same graph is refused by name, while a new forward gives the same gradients again."""
    overwrite.BLOCK_ROWS = 6
    log = CaseLog()
    topology = Topology(ulysses=2)
    for strategy in ("ulysses", "hybrid"):
        q, k, v = (torch.randn(1, L, 4, 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
                   for _ in range(3))  # fmt: skip
        grads = []
        for _ in range(2):
            out = sequence_parallel_attention(q, k, v, topology=topology, strategy=strategy, causal=True)
            grads.append(torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True))
        with log.case(f"{strategy} again"):
            for first, second in zip(*grads, strict=True):
                torch.testing.assert_close(first, second, rtol=0, atol=0)
        with log.case(strategy), pytest.raises(RuntimeError, match=r"second backward through .* \(retain_graph=True\)"):
            out.sum().backward()
    return log.failures


@pytest.mark.timeout(60)
def test_second_backward_through_overwritten_head_shards_is_refused():
    assert_no_failures(run_distributed(_second_backward_rank, 2, timeout=50))
