"""Bidirectional spans in a causal sequence (image tokens) and prefix-LM equal the float64 oracle on every strategy.

- ``ds_ring.dilated_attention`` (one process): spans as pairs and as per-token ids, prefixes, packed documents, GQA,
  sliding windows (``(causal OR same span) AND window``, Gemma 3's sliding layers), fp64 and fp32: out, LSE, dq/dk/dv.
- ring and all-gather over 1-4 ranks (contiguous and zigzag), Ulysses over 2, hybrid 2 × 2: spans straddling every
  shard boundary, several per shard, one longer than a shard, one covering the sequence, prefixes per document,
  windows shorter than a shard and spanning two, attention sinks, the backward tiled (``block_rows``).
- refused with a ValueError naming the argument, before any communication: spans without ``causal``, longer than
  the window, with dilated branches, overlapping, out of the sequence, crossing a document, ids not consecutive.
"""

from __future__ import annotations

import itertools

import pytest

import ds_ring
from tests.sharded_cases import EveryStrategy, assert_refused_on_one_rank, check_case, seeded

L = 8  # rows per rank (zigzag: two chunks of 4)


def _span_sets(world: int) -> list[dict]:
    """Spans straddling each shard boundary with more inside each shard; a long span; ids; prefixes."""
    seq = world * L
    straddling = [(r * L - 2, r * L + 2) for r in range(1, world)] + [(r * L + 3, r * L + 5) for r in range(world)]
    long_span = [(1, min(seq, 2 * L + 3))] + ([(seq - 3, seq)] if world > 2 else [])
    ids = [0] * seq
    for n, (a, b) in enumerate([(2, 5), (L - 1, min(seq, L + 4))], start=1):
        ids[a:b] = [n * 7] * (b - a)
    documents = [0, 5, 6, seq - 3, seq]  # one of 1 token; the third crosses shards
    return [
        dict(spans=sorted(straddling)),
        dict(spans=long_span),
        dict(spans=[(0, seq)]),
        dict(spans=ids),
        dict(prefix=L + 3 if world > 1 else 5),
        dict(prefix=[2, 1, seq - 10, 3], cu_seqlens=documents)
        if world > 1
        else dict(prefix=[2, 1, 2], cu_seqlens=[0, 5, 6, 8]),
        dict(spans=[(1, 4), (6, min(seq - 3, L + 3))], cu_seqlens=documents) if world > 1 else dict(spans=[(6, 8)]),
    ]


def _windowed(world: int) -> list[dict]:
    """Gemma 3's sliding layers, ``(causal OR same span) AND window``: windows shorter than a shard and spanning two,
    with spans straddling shard boundaries, a prefix, packed documents."""
    first, *_ = _span_sets(world)
    seq = world * L
    return [
        dict(first, window=5),
        dict(first, window=L + 3),
        dict(prefix=min(seq, L + 3), window=L + 4),
        dict(spans=[(1, 4), (6, min(seq - 3, 10))], cu_seqlens=[0, 5, 6, seq - 3, seq], window=4)
        if world > 1
        else dict(spans=[(6, 8)], window=3),
    ]


def _ring_cases(world: int) -> list[dict]:
    cases = []
    grid = itertools.product(["ring", "allgather"], _span_sets(world) + _windowed(world), [(4, 2), (4, 4)])
    for i, (comm, spans, (h, hkv)) in enumerate(grid):
        cases.append(dict(communication=comm, causal=True, heads=h, kv_heads=hkv, **spans, sinks=i % 4 == 1,
                          layout="zigzag" if i % 3 == 2 else "contiguous",
                          dtype="float32" if i % 7 == 6 else "float64",
                          block_rows=3 if i % 2 else None))  # fmt: skip
    return seeded(cases, batch=2, seq=world * L, head_dim=8)


def _strategy_cases(world: int, ring: int) -> list[dict]:
    cases = []
    strategies = [("ulysses", None)] + ([("hybrid", "ring"), ("hybrid", "allgather")] if ring > 1 else [])
    for i, ((strategy, comm), spans) in enumerate(itertools.product(strategies, _span_sets(world) + _windowed(world))):
        cases.append(dict(strategy=strategy, communication=comm, causal=True, heads=4, kv_heads=2 if i % 2 else 4,
                          **spans, sinks=i % 4 == 3, layout="zigzag" if i % 3 == 1 else "contiguous",
                          block_rows=5 if i % 3 == 0 else None))  # fmt: skip
    return seeded(cases, batch=1, seq=world * L, head_dim=8)


class TestEveryStrategy(EveryStrategy):
    """Spans and prefixes on ring and all-gather over 1-4 ranks, Ulysses over 2 and hybrid 2 × 2."""

    ring_cases = staticmethod(_ring_cases)
    strategy_cases = staticmethod(_strategy_cases)


def _one_process(q, k, v, segments, rates, *, layout, **options):
    return ds_ring.dilated_attention(q, k, v, segments, rates, **options)


@pytest.mark.parametrize("world", [1, 3])
def test_one_process(world):
    for i, (dtype, (h, hkv), spans) in enumerate(
        itertools.product(["float64", "float32"], [(4, 4), (4, 2), (4, 1)], _span_sets(world) + _windowed(world))
    ):
        case = dict(causal=True, heads=h, kv_heads=hkv, dtype=dtype, batch=2, seq=world * L, head_dim=8, seed=i,
                    **spans)  # fmt: skip
        check_case(case, _one_process)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(bidirectional_spans=[(2, 5)], causal=False), "causal=False"),
        (dict(prefix_lengths=4, causal=False), "causal=False"),
        (dict(bidirectional_spans=[(2, 8)], window=4), "longer than window=4"),
        (dict(bidirectional_spans=[(2, 5)], segment_lengths=[8], dilation_rates=[2]), "dense attention only"),
        (dict(bidirectional_spans=[(2, 5), (4, 7)]), "sorted and disjoint"),
        (dict(bidirectional_spans=[(2, 17)]), "not inside the sequence"),
        (dict(bidirectional_spans=[(6, 10)], cu_seqlens=[0, 8, 16]), "crosses the end of its document"),
        (dict(bidirectional_spans=[0, 1, 1, 0, 1] + [0] * 11), "not consecutive"),
        (dict(bidirectional_spans=[0, 1, 1]), "one id per token"),
        (dict(prefix_lengths=[4], cu_seqlens=[0, 8, 16]), "one integer per document"),
        (dict(prefix_lengths=9, cu_seqlens=[0, 8, 16]), "does not fit the document"),
        (dict(bidirectional_spans=[(2, 5)], prefix_lengths=3), "not both"),
    ],
)
def test_bad_spans_are_refused(kwargs, message):
    assert_refused_on_one_rank(kwargs, message)
