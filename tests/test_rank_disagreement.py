"""Ranks that disagree get one clear ValueError on every rank, naming the field and each rank's value.

Two gloo ranks; rank 1 differs from rank 0 in one thing per case (each alone a valid call): sequence
length, heads, head_dim, v's head dim, softcap, segment_lengths, dilation_rates, dtype, causal, communication, layout,
strategy, cu_seqlens, and more; the Topology's degrees; the ds_config section of ``ds_ring.initialize``.
Four ranks for ``hybrid`` (ulysses 2 × ring 2): one agreement over the whole sequence-parallel group.
Every case must raise on every rank (a rank that raised while another hung would fail the run at its
deadline); the seconds to the error are printed, not asserted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

import ds_ring
from tests.dist import CaseLog, run_distributed

TIMEOUT_S = 10.0
L, H, KV, D = 32, 4, 2, 8  # rows per rank, heads, K/V heads, head_dim
BASE = dict(rows=L, heads=H, head_dim=D, dtype=torch.float32, segment_lengths=[16, 2 * L], dilation_rates=[1, 2],
            causal=True, communication="ring", layout="contiguous", strategy="ring", cu_seqlens=None,
            backward=False, v_head_dim=D, softcap=None)  # fmt: skip
# field → (rank 1's value, the message's line for it); each alone is a call that runs.
DIFFERS = {
    "sequence length": (dict(rows=48), "rows: rank 0 has 32, rank 1 has 48"),
    "heads": (dict(heads=2), "heads: rank 0 has 4, rank 1 has 2"),
    "head_dim": (dict(head_dim=16), "head_dim: rank 0 has 8, rank 1 has 16"),
    "v_head_dim": (dict(v_head_dim=12), "v_head_dim: rank 0 has 8, rank 1 has 12"),
    "softcap": (dict(softcap=30.0), "softcap: rank 0 has None, rank 1 has 30.0"),
    "segment_lengths": (dict(segment_lengths=[32, 64]), "segment_lengths: rank 0 has [16, 64], rank 1 has [32, 64]"),
    "dilation_rates": (dict(dilation_rates=[1, 4]), "dilation_rates: rank 0 has [1, 2], rank 1 has [1, 4]"),
    "dtype": (dict(dtype=torch.float64), "dtype: rank 0 has torch.float32, rank 1 has torch.float64"),
    "causal": (dict(causal=False), "causal: rank 0 has True, rank 1 has False"),
    "communication": (dict(communication="allgather"), "communication: rank 0 has 'ring', rank 1 has 'allgather'"),
    "layout": (dict(layout="zigzag", segment_lengths=None, dilation_rates=None),
               "layout: rank 0 has 'contiguous', rank 1 has 'zigzag'"),
    "strategy": (dict(strategy="ulysses"), "strategy: rank 0 has 'ring', rank 1 has 'ulysses'"),
    "cu_seqlens": (dict(cu_seqlens=torch.tensor([0, 40, 64])), "cu_seqlens: rank 0 has None, rank 1 has [0, 40, 64]"),
    "backward": (dict(backward=True), "backward: rank 0 has False, rank 1 has True"),
}  # fmt: skip


def _inputs(
    rows: int, heads: int, head_dim: int, dtype: torch.dtype, backward: bool, v_head_dim: int, **_: object
) -> list:
    g = torch.Generator().manual_seed(0)
    shapes = [(1, rows, heads, head_dim), (1, rows, KV, head_dim), (1, rows, KV, v_head_dim)]
    return [torch.randn(shape, generator=g, dtype=dtype, requires_grad=backward) for shape in shapes]


def _options(call: dict, keys: tuple[str, ...]) -> dict:
    return {key: call[key] for key in keys}


def _expect_disagreement(log: CaseLog, seconds: dict, name: str, needles: list[str], run: Callable[[], object]) -> None:
    started = time.perf_counter()
    with log.case(name), pytest.raises(ValueError, match="disagree on") as caught:
        run()
    seconds[name] = time.perf_counter() - started
    for needle in needles:
        with log.case(f"{name} names {needle!r}"):
            assert needle in str(caught.value), str(caught.value)


def _attention_rank(rank: int, world: int) -> tuple[list[str], dict[str, float]]:
    """sequence_parallel_attention over Topology(ring=2), one differing field per case, then each entry point."""
    log, seconds = CaseLog(), {}
    topology = ds_ring.Topology(ring=2, timeout_s=TIMEOUT_S)
    calls = ("segment_lengths", "dilation_rates", "causal", "communication", "layout", "strategy", "cu_seqlens",
             "softcap")  # fmt: skip
    for name, (rank1, line) in DIFFERS.items():
        call = {**BASE, **(rank1 if rank == 1 else {})}
        q, k, v = _inputs(**call)
        _expect_disagreement(log, seconds, name, [line, "disagree on sequence_parallel_attention", "Fix:"],
                             lambda q=q, k=k, v=v, call=call: ds_ring.sequence_parallel_attention(
                                 q, k, v, topology=topology, timeout_s=TIMEOUT_S, **_options(call, calls)))  # fmt: skip
    heads = {**BASE, **(DIFFERS["heads"][0] if rank == 1 else {})}
    q, k, v = _inputs(**heads)
    for name, op, run in [
        ("ring_dilated_attention", "ring_dilated_attention",
         lambda: ds_ring.ring_dilated_attention(q, k, v, timeout_s=TIMEOUT_S)),
        ("ulysses", "sequence_parallel_attention",
         lambda: ds_ring.sequence_parallel_attention(q, k, v, topology=topology, strategy="ulysses")),
        ("hybrid", "sequence_parallel_attention",
         lambda: ds_ring.sequence_parallel_attention(q, k, v, topology=topology, strategy="hybrid")),
    ]:  # fmt: skip
        _expect_disagreement(log, seconds, f"{name}: heads", [f"disagree on {op}", DIFFERS["heads"][1]], run)
    _expect_disagreement(log, seconds, "Topology degrees", ["ring: rank 0 has 2, rank 1 has 1", "same degrees"],
                         lambda: ds_ring.Topology(ulysses=1 + rank, ring=2 - rank, timeout_s=TIMEOUT_S))  # fmt: skip
    with log.case("a repeated call is agreed once: the second makes no exchange"):
        events: list = []
        q, k, v = _inputs(**BASE)
        with ds_ring.register_hook(events.append):
            for _ in range(2):
                before = len(events)
                ds_ring.sequence_parallel_attention(q, k, v, topology=topology, timeout_s=TIMEOUT_S)
                agreements = [e for e in events[before:] if e.op.startswith("agree:")]
                assert len(agreements) == (1 if _ == 0 else 0), agreements  # prepared once, then run bare
    return log.failures, seconds


def _section(rank: int, **rank1: object) -> dict:
    section = {"strategy": "ring", "sequence_parallel_size": 2, "segment_lengths": [8, 32], "dilation_rates": [1, 2],
               "causal": True, "timeout_s": TIMEOUT_S}  # fmt: skip
    return {"train_micro_batch_size_per_gpu": 1, "ring_attention": {**section, **(rank1 if rank == 1 else {})}}


def _initialize_rank(rank: int, world: int) -> tuple[list[str], dict[str, float]]:
    """``ds_ring.initialize`` with a section (or ``seq_len``) that differs on rank 1."""
    log, seconds = CaseLog(), {}
    model = ds_ring.MultiheadRingDilatedAttention(16, 4, segment_lengths=[8, 32], dilation_rates=[1, 2])
    cases = [
        ("segment_lengths", dict(segment_lengths=[8, 16]), {}, ["ring_attention.segment_lengths: rank 0 has [8, 32], "
                                                                "rank 1 has [8, 16]"]),
        ("causal", dict(causal=False), {}, ["ring_attention.causal: rank 0 has True, rank 1 has False"]),
        ("monitoring", dict(monitoring={"numerics_guard": "warn"}), {},
         ["ring_attention.monitoring.numerics_guard: rank 0 has 'off', rank 1 has 'warn'"]),
        # Rank 1's section alone would fail the heads check (4 heads over ulysses 3): agreement comes first.
        ("strategy", dict(strategy="ulysses", sequence_parallel_size=None), {},
         ["ring_attention.strategy: rank 0 has 'ring', rank 1 has 'ulysses'",
          "ring_attention.sequence_parallel_size: rank 0 has 2, rank 1 has None"]),
        ("seq_len", {}, dict(seq_len=64 if rank == 0 else 96), ["seq_len: rank 0 has 64, rank 1 has 96"]),
    ]  # fmt: skip
    for name, rank1, kwargs, needles in cases:
        started = time.perf_counter()
        with log.case(name), pytest.raises(ValueError, match="disagree on ds_ring.initialize") as caught:
            ds_ring.initialize(model=model, config=_section(rank, **rank1), **kwargs)
        seconds[f"initialize {name}"] = time.perf_counter() - started
        for needle in [*needles, "same ds_config on every node"]:
            with log.case(f"{name} names {needle!r}"):
                assert needle in str(caught.value), str(caught.value)
    return log.failures, seconds


@pytest.mark.timeout(120)
def test_initialize_with_sections_that_differ_raises_on_every_rank() -> None:
    _report(run_distributed(_initialize_rank, 2, timeout=90))


def _hybrid_rank(rank: int, world: int) -> tuple[list[str], dict[str, float]]:
    """ulysses 2 × ring 2: rank 3 differs; ranks sharing no ulysses or ring group with it raise as well."""
    log, seconds = CaseLog(), {}
    topology = ds_ring.Topology(ulysses=2, ring=2, timeout_s=TIMEOUT_S)
    segments = [32, 2 * L] if rank == 3 else [16, 2 * L]
    q, k, v = _inputs(**BASE)
    needles = ["segment_lengths: ranks 0-2 have [16, 64], rank 3 has [32, 64]"]
    hybrid = dict(topology=topology, strategy="hybrid", timeout_s=TIMEOUT_S)
    _expect_disagreement(log, seconds, "hybrid via sequence_parallel_attention", needles,
                         lambda: ds_ring.sequence_parallel_attention(q, k, v, segments, [1, 2], **hybrid))  # fmt: skip
    return log.failures, seconds


def _report(results: list[tuple[list[str], dict[str, float]]]) -> None:
    assert not any(failures for failures, _ in results), "\n".join(f for failures, _ in results for f in failures)
    for name in results[0][1]:
        slowest = max(seconds[name] for _, seconds in results)
        print(f"{name}: ValueError on every rank, the last after {slowest * 1e3:.0f} ms")


@pytest.mark.timeout(120)
def test_attention_calls_that_differ_raise_on_every_rank() -> None:
    _report(run_distributed(_attention_rank, 2, timeout=90))


@pytest.mark.timeout(120)
def test_hybrid_agreement_reaches_every_rank() -> None:
    _report(run_distributed(_hybrid_rank, 4, timeout=90))
