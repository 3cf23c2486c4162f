"""The benchmark driver: its arithmetic, its timing rules, and one tiny run end to end."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from benchmarks import common, driver, peers, ring, suite
from benchmarks.common import Case
from benchmarks.driver import Column, Row


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
    assert common.pairs_dilated(96, 5, segs, rates, causal) == _brute_pairs(96, 5, segs, rates, causal)
    assert common.useful_gflop(case) == pytest.approx(3.5 * 4 * 4 * _brute_pairs(96, 5, segs, rates, causal) / 1e9)
    dap = Case("dap", 96, causal=causal, heads=5, head_dim=4, segment_lengths=segs, dilation_rates=rates)
    assert peers.flop(dap) == pytest.approx(3.5 * 4 * 4 * _brute_pairs(96, 5, segs, rates, causal, True) / 1e9)
    dense = Case("dense", 96, causal=causal, heads=5, head_dim=4)
    assert common.useful_gflop(dense) == pytest.approx(3.5 * 4 * 4 * 5 * (96 * 97 // 2 if causal else 96 * 96) / 1e9)


def test_fixed_calls_and_the_peak_rss_they_add():
    calls = []
    fixed = common.measure(lambda: calls.append(1), calls=3)
    assert len(calls) == len(fixed.times_s) == 3
    grow = common.measure(lambda: bytearray(64 * 2**20), calls=2)
    assert grow.first_extra_mib >= 32 and grow.peak_extra_mib >= grow.first_extra_mib


def test_tables_find_and_ratios():
    a = Row(Case("ring", 1024, 2), "ring", "2×1", 1.0, fwdbwd_s=2.0, peak_mib=10.0)
    b = Row(Case("rap", 1024, 2), "rap", "2×1", 1.0, fwdbwd_s=8.0)
    assert driver.find([a, b], impl="rap", world=2) is b and driver.find([a, b], world=4) is None
    assert driver.ratio(b, a) == 4.0 and driver.ratio(a, None) is None
    table = driver.markdown_table(
        [a, b], [Column("impl", lambda r: r.label), Column("MiB", lambda r: r.peak_mib, "{:.1f}")]
    )
    assert table.splitlines() == ["| impl | MiB |", "|---|---|", "| ring | 10.0 |", "| rap | — |"]
    shared = driver.markdown_table([a], ["impl", "fwd+bwd s", Column("p", lambda r: r.case.world)])
    assert shared.splitlines()[2] == "| ring | 2.000 | 2 |"  # a plain header names one of driver.COLUMNS


def test_estimates_scale_the_last_measured_call(tmp_path):
    args = argparse.Namespace(max_call_s=100.0, out=str(tmp_path))
    session = driver.Session.__new__(driver.Session)
    session.args, session.seen = args, {("ring", 4, True, ""): (2048, 10.0, 1.0)}
    row = lambda seq: Row(Case("ring", seq, 4), "ring", "4×1", 1.0)
    assert session._estimate(row(4096)) == (40.0, None)  # ∝ S²
    seconds, why = session._estimate(row(8192))
    assert seconds == 160.0 and "> --max-call-s 100" in why
    assert session._estimate(Row(Case("rap", 4096, 4), "rap", "4×1", 1.0)) == (None, None)  # nothing measured yet
    assert "not divisible" in session._estimate(row(4097))[1]


def test_ring_runs_one_dense_row_per_length_at_one_rank():
    def planned(*impls: str) -> list[tuple[str, int, str, bool]]:
        cases: list[Case] = []
        args = argparse.Namespace(seqs=[4096], worlds=[1, 2], impls=list(impls))
        ring.plan(argparse.Namespace(args=args, run=cases.append))
        return [(c.impl, c.world, c.layout, c.segment_lengths is None) for c in cases]

    # issue 4's rows: ring_zigzag gives the p = 1 dense reference (one contiguous shard) when ring is not run
    assert planned("ring_dilated", "ring_zigzag") == [
        ("ring", 1, "contiguous", False), ("ring", 2, "contiguous", False),
        ("ring", 1, "contiguous", True), ("ring", 2, "zigzag", True),
    ]  # fmt: skip
    assert planned("ring", "ring_zigzag", "allgather") == [
        ("ring", 1, "contiguous", True), ("ring", 2, "contiguous", True), ("ring", 2, "zigzag", True),
        ("allgather", 2, "contiguous", True),
    ]  # fmt: skip


def test_fit_search_candidates_stay_inside_the_bracket():
    assert suite.next_candidate([(4096, 50.0)], (4096, 50.0), None, 100.0, 1024) == 8192
    assert suite.next_candidate([(4096, 50.0), (8192, 120.0)], (4096, 50.0), (8192, 120.0), 100.0, 1024) == 6144
    assert suite.next_candidate([(4096, 50.0), (5120, 120.0)], (4096, 50.0), (5120, 120.0), 100.0, 1024) is None


@pytest.mark.timeout(240)
def test_a_tiny_ring_run_end_to_end(tmp_path):
    argv = ["--seqs", "512", "--worlds", "2", "--impls", "ring", "rap", "--calls", "1"]
    assert driver.main(ring.BENCHMARK, [*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "ring.json").read_text())
    measured = report["rows"]
    assert [(r["case"]["impl"], r["case"]["world"]) for r in measured] == [("ring", 2), ("rap", 2)]
    for r in measured:
        if r["case"]["impl"] == "rap":  # a missing peer is skipped with the command that installs it, never an error
            assert r["fwdbwd_s"] is not None or "python -m benchmarks install-peers" in r["notes"][0]
            continue
        assert r["fwdbwd_s"] > 0 and r["peak_mib"] > 0 and len(r["raw"]) == 2, r["notes"]
        assert r["warmup_max_abs_err"] < 1e-5
    assert measured[0]["overlap_ratio"] is not None and len(measured[0]["blocked_s_per_rank"]) == 2
    assert "| ds_ring ring (contiguous) | 512 | 2×1 |" in report["report"]
    assert (tmp_path / "ring_time.png").stat().st_size > 0 and (tmp_path / "ring_memory.png").stat().st_size > 0
