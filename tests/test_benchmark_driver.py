"""The benchmark driver: its arithmetic, its timing rules, and one tiny run end to end."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from benchmarks import cases, common, driver, peers, ring, rows, suite
from benchmarks.cases import Case
from benchmarks.rows import Column, Row


def _brute_pairs(seq: int, heads: int, segs, rates, causal: bool, split_heads: bool = False) -> int:
    """Count computed (query, key) pairs one by one: branch i, segment, offset, causal mask."""
    total = 0
    groups = [heads // len(rates) + (i < heads % len(rates)) for i in range(len(rates))]
    for i, (w, r) in enumerate(zip(segs, rates, strict=True)):
        head_ids = [i] * groups[i] if split_heads else range(heads)
        for h, start in itertools.product(head_ids, range(0, seq, w)):
            kept = list(range(start + h % r, min(start + w, seq), r))
            total += sum(1 for a in kept for b in kept if not causal or b <= a)
    return total


@pytest.mark.parametrize("causal", [False, True])
def test_useful_work_counts_every_computed_pair(causal):
    segs, rates = (8, 16, 32), (1, 2, 4)
    case = Case("ds_ring", 96, causal=causal, heads=5, head_dim=4, segment_lengths=segs, dilation_rates=rates)
    assert cases.pairs_dilated(96, 5, segs, rates, causal) == _brute_pairs(96, 5, segs, rates, causal)
    assert cases.useful_gflop(case) == pytest.approx(3.5 * 4 * 4 * _brute_pairs(96, 5, segs, rates, causal) / 1e9)
    dap = Case("dap", 96, causal=causal, heads=5, head_dim=4, segment_lengths=segs, dilation_rates=rates)
    assert peers.flop(dap) == pytest.approx(3.5 * 4 * 4 * _brute_pairs(96, 5, segs, rates, causal, True) / 1e9)
    dense = Case("dense", 96, causal=causal, heads=5, head_dim=4)
    assert cases.useful_gflop(dense) == pytest.approx(3.5 * 4 * 4 * 5 * (96 * 97 // 2 if causal else 96 * 96) / 1e9)


def test_fixed_calls_and_time_budget():
    calls = []
    fixed = common.measure(lambda: calls.append(1), calls=3)
    assert len(calls) == len(fixed.times_s) == 3 and not fixed.warm
    slow = common.measure(lambda: time.sleep(0.06), calls=3, budget_s=0.1)  # first call over half the budget
    assert len(slow.times_s) == 1 and not slow.warm
    quick = common.measure(lambda: None, calls=3, budget_s=10.0)  # warm-up, then 3 timed calls
    assert len(quick.times_s) == 3 and quick.warm
    grow = common.measure(lambda: bytearray(64 * 2**20), calls=1)
    assert grow.first_extra_mib >= 32 and grow.peak_extra_mib >= grow.first_extra_mib


def test_tables_find_and_ratios():
    a = Row(Case("ring", 1024, 2), "ring", "2×1", 1.0, fwdbwd_s=2.0, peak_mib=10.0)
    b = Row(Case("rap", 1024, 2), "rap", "2×1", 1.0, fwdbwd_s=8.0)
    assert rows.find([a, b], impl="rap", world=2) is b and rows.find([a, b], world=4) is None
    assert rows.ratio(b, a) == 4.0 and rows.ratio(a, None) is None
    table = rows.markdown_table(
        [a, b], [Column("impl", lambda r: r.label), Column("MiB", lambda r: r.peak_mib, "{:.1f}")]
    )
    assert table.splitlines() == ["| impl | MiB |", "|---|---|", "| ring | 10.0 |", "| rap | — |"]
    shared = rows.markdown_table([a], ["impl", "fwd+bwd s", Column("p", lambda r: r.case.world)])
    assert shared.splitlines()[2] == "| ring | 2.000 | 2 |"  # a plain header names one of rows.COLUMNS
    (target,) = rows.compare("ring ≥ 2× faster than rap", b, a, met=lambda x: x >= 2.0, note="; quiet")
    assert (target.value, target.met, target.detail) == (4.0, True, "8.00 s vs 2.00 s; quiet")
    assert rows.compare("no rap row", None, a) == []


def test_estimates_come_from_the_measured_rate():
    tp = driver.Throughput(cores=2, matmul_per_core=100.0)
    case = Case("ring", 4096, 4)
    assert tp.estimate_s("ring", case, 70.0, 0.35)[0] == pytest.approx(1.0)  # 35 GFLOP/s per core × 2 cores
    tp.record("ring", Case("ring", 2048, 4), 10.0, 1.0, other=0.5)  # 20 GFLOP/s undisturbed over 2 cores
    seconds, how = tp.estimate_s("ring", case, 40.0, 0.35)
    assert seconds == pytest.approx(2.0) and "measured 10.0 GFLOP/s per core on 2K p=4" in how


def test_fit_search_candidates_stay_inside_the_bracket():
    assert suite.next_candidate([(4096, 50.0)], (4096, 50.0), None, 100.0, 1024) == 8192
    assert suite.next_candidate([(4096, 50.0), (8192, 120.0)], (4096, 50.0), (8192, 120.0), 100.0, 1024) == 6144
    assert suite.next_candidate([(4096, 50.0), (5120, 120.0)], (4096, 50.0), (5120, 120.0), 100.0, 1024) is None


@pytest.mark.timeout(240)
def test_a_tiny_ring_run_end_to_end(tmp_path):
    argv = ["--seqs", "512", "--worlds", "2", "--impls", "ring", "rap", "--calls", "1"]
    assert driver.main(ring.BENCHMARK, [*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "ring.json").read_text())
    measured = [Row.from_json(r) for r in report["rows"]]
    assert [(r.case.impl, r.case.world) for r in measured] == [("ring", 2), ("rap", 2)]
    for r in measured:
        if r.case.impl == "rap":  # a missing peer is skipped with the command that installs it, never an error
            assert r.fwdbwd_s is not None or "python -m benchmarks install-peers" in r.notes[0]
            continue
        assert r.fwdbwd_s > 0 and r.peak_mib > 0 and len(r.raw) == r.case.world, r.notes
        assert r.warmup_max_abs_err < 1e-5
    assert measured[0].overlap_ratio is not None and len(measured[0].blocked_s_per_rank) == 2
    assert "| ds_ring ring (contiguous) | 512 | 2×1 |" in report["report"]
    assert (tmp_path / "ring_time.png").stat().st_size > 0 and (tmp_path / "ring_memory.png").stat().st_size > 0
