"""Ring dilated attention (dilation across shards) equals the oracle, forward and backward, p = 1-4."""

import functools
import itertools

import pytest

import ds_ring
from tests.dist import run_distributed
from tests.sharded_cases import run_cases

L = 8  # rows per rank


def _branches(world: int) -> list[tuple[list[int], list[int]]]:
    return [
        ([L // 2, 2 * L, 4 * L], [1, 2, 4]),  # shorter than, and spanning 2 and 4 shards
        ([L // 2, L, 2 * L, 4 * L], [1, 2, 2, 4]),  # equal to a shard too
        ([2 * L, 4 * L], [3, 3]),  # L % r != 0: kept rows differ from rank to rank
        ([4 * L], [16]),  # rate larger than a shard: some ranks keep no row for some heads
        ([1000], [2]),  # longer than the sequence: clamped
    ]


def _cases(world: int) -> list[dict]:
    cases = []
    for (segs, rates), comm, causal, (heads, kv_heads, head_offset) in itertools.product(
        _branches(world), ["ring", "allgather"], [False, True], [(4, 4, 0), (6, 2, 3)]
    ):
        cases.append(
            dict(
                segments=segs,
                rates=rates,
                communication=comm,
                causal=causal,
                heads=heads,
                kv_heads=kv_heads,
                head_offset=head_offset,
                batch=1,
                seq=world * L,
                head_dim=4,
                seed=len(cases),
                dtype="float64" if len(cases) % 4 else "float32",
            )  # fmt: skip
        )
    return cases


def _rank(rank: int, world: int) -> list[str]:
    failures = []
    for case in _cases(world):
        attention = functools.partial(ds_ring.ring_dilated_attention, communication=case["communication"])
        failures += run_cases([case], attention)
    return failures


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_dilated_matches_reference(world):
    results = run_distributed(_rank, world, timeout=200)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:3])
