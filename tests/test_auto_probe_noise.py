"""``auto``'s choice under the probe's noise, from recorded probes (no timing), and the probe's bandwidth when its
timings invert. The recorded probes are ``benchmarks/results/probe.json`` (``python -m benchmarks.probe``: 20 agreed
probes per world on 2 shared cores at load 17-20, FLOP/s spread 8-22×, bandwidth 12-40×; docs/auto.md)."""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

import pytest
import torch

from ds_ring.auto import probe
from ds_ring.auto.model import Link, Problem, choose

RECORDED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "probe.json"
KEYS = ("latency_s", "bandwidth", "flops")


def _runs() -> list[tuple[str, int, list[Link]]]:
    runs = []
    for label, worlds in json.loads(RECORDED.read_text()).items():
        for run in worlds:
            links = [Link(**{key: p[key] for key in KEYS}) for p in run["probes"]]
            runs.append((label, run["world"], links))
    return runs


@pytest.mark.parametrize(("label", "world", "links"), _runs(), ids=lambda x: str(x)[:12] if isinstance(x, str) else "")
def test_the_choice_is_the_median_probes_on_nine_in_ten_recorded_probes(label: str, world: int, links: list[Link]):
    median = Link(**{key: statistics.median(getattr(link, key) for link in links) for key in KEYS})
    degrees = ((1, world), (2, world // 2)) if world == 4 else ((1, world),)
    for seq in (2048, 4096, 8192, 16384, 32768):
        for heads, kv_heads in ((8, 8), (8, 2)):
            problem = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=64, world=world, itemsize=4,
                              causal=True, layouts=("contiguous",), degrees=degrees,
                              oversubscription=2.0 if world == 4 else 1.0)  # fmt: skip
            picks = collections.Counter(choose(problem, link).label for link in links)
            expected = choose(problem, median).label
            assert picks[expected] >= 0.9 * len(links), (seq, heads, kv_heads, picks, expected)


@pytest.mark.parametrize(("small_s", "large_s"), [(1e-3, 0.9e-3), (1e-3, 1e-3), (1e-4, 1.05e-4)])
def test_bandwidth_is_a_lower_bound_when_the_large_exchange_is_not_slower(
    monkeypatch: pytest.MonkeyPatch, small_s: float, large_s: float
) -> None:
    timed = {probe.SMALL: small_s, probe.LARGE: large_s}
    monkeypatch.setattr(probe, "group_size", lambda group: 2)
    monkeypatch.setattr(probe, "_time_flops", lambda device: 1e10)
    monkeypatch.setattr(probe, "_time_all_to_all", lambda nbytes, *args: timed[nbytes])
    link = probe.measure_link(None, torch.device("cpu"))
    assert link.bandwidth == pytest.approx(probe.LARGE / 2 / large_s)  # the large exchange all transfer


def test_bandwidth_is_the_extra_bytes_over_the_extra_time(monkeypatch: pytest.MonkeyPatch) -> None:
    timed = {probe.SMALL: 1e-4, probe.LARGE: 6e-4}
    monkeypatch.setattr(probe, "group_size", lambda group: 4)
    monkeypatch.setattr(probe, "_time_flops", lambda device: 1e10)
    monkeypatch.setattr(probe, "_time_all_to_all", lambda nbytes, *args: timed[nbytes])
    link = probe.measure_link(None, torch.device("cpu"))
    assert link.bandwidth == pytest.approx((probe.LARGE - probe.SMALL) * 3 / 4 / 5e-4)
    assert link.latency_s == pytest.approx(1e-4 / 3)
