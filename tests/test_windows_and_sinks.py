"""Sliding windows and attention sinks equal the float64 oracle, on one process and on every strategy.

- ``ds_ring.dilated_attention`` (one process): windows of 1 key to longer than the sequence, packed documents,
  GQA, sinks, fp64 and fp32: out, LSE, dq/dk/dv and d sinks.
- ring and all-gather over 1-4 ranks (contiguous and zigzag), Ulysses over 2 and 4, hybrid 2 × 2: windows
  shorter than a shard, as long as one, spanning 2-3 shards and longer than the sequence; with packed
  documents; with sinks (their gradient each rank's share, summed over the group).
- refused with a ValueError naming the argument, before any communication: a window < 1, a window with
  ``causal=False`` or with dilated branches, sinks of another shape or dtype.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import ds_ring
from tests.sharded_cases import EveryStrategy, assert_refused_on_one_rank, check_case, seeded

L = 6  # rows per rank


def _windows(world: int) -> list[int]:
    """Shorter than a shard, one shard, spanning 2-3 shards, longer than the sequence."""
    return sorted({2, L, min(2 * L + 1, world * L), 3 * L - 1, 10 * world * L})


def _ring_cases(world: int) -> list[dict]:
    cases = []
    grid = itertools.product(["ring", "allgather"], _windows(world), [(4, 2), (4, 4)], [False, True])
    for i, (comm, window, (h, hkv), sinks) in enumerate(grid):
        cases.append(dict(communication=comm, causal=True, window=window, heads=h, kv_heads=hkv, sinks=sinks,
                          layout="zigzag" if i % 3 == 2 else "contiguous",
                          dtype="float32" if i % 7 == 6 else "float64",
                          block_rows=4 if i % 2 else None))  # fmt: skip
    seq = world * L
    documents = [0, 5, 6, seq - 3, seq] if world > 1 else [0, 2, 3, seq]  # one of 1 token; some crossing shards
    cases.append(dict(cases[0], cu_seqlens=documents, window=4, sinks=True))
    cases.append(dict(cases[0], cu_seqlens=[0, seq // 2 + 1, seq], window=L + 2, communication="allgather"))
    return seeded(cases, batch=2, seq=seq, head_dim=8)


def _strategy_cases(world: int, ring: int) -> list[dict]:
    seq = world * L
    cases = []
    strategies = ["ulysses"] + (["hybrid"] if ring > 1 else [])
    for i, (strategy, window) in enumerate(itertools.product(strategies, _windows(world))):
        cases.append(dict(strategy=strategy, causal=True, window=window, heads=4, kv_heads=2 if i % 2 else 4,
                          sinks=i % 2 == 0, layout="zigzag" if i % 3 == 1 else "contiguous",
                          block_rows=5 if i % 3 == 0 else None))  # fmt: skip
    cases.append(dict(cases[0], cu_seqlens=[0, 7, seq], window=5))
    return seeded(cases, batch=1, seq=seq, head_dim=8)


class TestEveryStrategy(EveryStrategy):
    """Windows and sinks on ring and all-gather over 1-4 ranks, Ulysses over 2 and hybrid 2 × 2."""

    ring_cases = staticmethod(_ring_cases)
    strategy_cases = staticmethod(_strategy_cases)


def _one_process(q, k, v, segments, rates, *, layout, **options):
    return ds_ring.dilated_attention(q, k, v, segments, rates, **options)


@pytest.mark.parametrize("window", [1, 2, 3, 7, 16, 100])
@pytest.mark.parametrize("packed", [False, True])
def test_one_process(window, packed):
    for i, (dtype, (h, hkv), sinks) in enumerate(
        itertools.product(["float64", "float32"], [(4, 4), (4, 2), (4, 1)], [False, True])
    ):
        case = dict(causal=True, window=window, heads=h, kv_heads=hkv, sinks=sinks, dtype=dtype, batch=2, seq=33,
                    head_dim=8, seed=i, **({"cu_seqlens": [0, 11, 12, 33]} if packed else {}))  # fmt: skip
        check_case(case, _one_process)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(window=0), "window must be an integer >= 1"),
        (dict(window=2.5), "window must be an integer >= 1"),
        (dict(window=4, causal=False), "causal=False"),
        (dict(window=4, segment_lengths=[8], dilation_rates=[2]), "dense attention only"),
        (dict(sinks=torch.zeros(3)), r"sinks must be a \[heads\] tensor"),
        (dict(sinks=torch.zeros(4, dtype=torch.float64)), "sinks must have q's dtype"),
    ],
)
def test_bad_windows_and_sinks_are_refused(kwargs, message):
    assert_refused_on_one_rank(kwargs, message)
