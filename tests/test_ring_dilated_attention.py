"""Ring dilated attention (dilation across shards) equals the oracle, forward and backward, p = 1-4."""

import itertools

import pytest

from tests.dist import assert_no_failures, run_distributed
from tests.sharded_cases import ring_rank, seeded

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
    grid = itertools.product(_branches(world), ["ring", "allgather"], [False, True], [(4, 4, 0), (6, 2, 3)])
    cases = (
        dict(segments=segs, rates=rates, communication=comm, causal=causal, heads=heads, kv_heads=kv_heads,
             head_offset=head_offset, dtype="float64" if i % 4 else "float32")
        for i, ((segs, rates), comm, causal, (heads, kv_heads, head_offset)) in enumerate(grid)
    )  # fmt: skip
    return seeded(cases, batch=1, seq=world * L, head_dim=4)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_dilated_matches_reference(world):
    assert_no_failures(run_distributed(ring_rank, world, timeout=200, cases=_cases(world)))
