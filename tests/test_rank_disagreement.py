"""Ranks that disagree get one clear ValueError on every rank, naming the field and each rank's value.

Two gloo ranks; rank 1 differs from rank 0 in one thing per case. Every case must raise on both
ranks (a rank that raised while the other hung would fail the run at its short deadline).
"""

from __future__ import annotations

import time

import pytest

import ds_ring
from tests.dist import CaseLog, run_distributed

TIMEOUT_S = 10.0


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
    results = run_distributed(_initialize_rank, 2, timeout=90)
    assert not any(failures for failures, _ in results), "\n".join(f for failures, _ in results for f in failures)
    for name, seconds in results[0][1].items():
        print(f"{name}: ValueError on every rank after {seconds * 1e3:.0f} ms")
