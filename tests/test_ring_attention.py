"""Dense ring and all-gather attention equal the oracle on the gathered tensors, world sizes 1-4."""

import itertools

import pytest

from tests.dist import assert_no_failures, run_distributed
from tests.sharded_cases import ring_rank, seeded


def _cases(world: int) -> list[dict]:
    grid = itertools.product(
        ["ring", "allgather"], [False, True], ["contiguous", "zigzag"], [(4, 4), (4, 2), (3, 1)], ["float64", "float32"]
    )
    cases = (  # every other case: the own runs' backward in tiles of at most 4 rows a side (4 + 2 rows)
        dict(communication=comm, causal=causal, layout=layout, heads=heads, kv_heads=kv_heads, dtype=dtype,
             block_rows=4 if i % 2 else None)
        for i, (comm, causal, layout, (heads, kv_heads), dtype) in enumerate(grid)
    )  # fmt: skip
    return seeded(cases, batch=2, seq=world * 6, head_dim=8)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dense_ring_and_allgather_match_reference(world):
    assert_no_failures(run_distributed(ring_rank, world, timeout=200, cases=_cases(world)))
