"""Per-step metrics: measured from the hooks, aggregated over ranks, written by rank 0; CSV and plot.

- ``RingMonitor`` alone (no DeepSpeed), p = 2 and 3: one dense ring attention forward + backward
  per step, bit-equal to the same call with no hook registered; bytes sent and received per rank
  are exactly the ring's (``3(p − 1)`` K/V-sized blocks: p − 1 forward, p − 1 backward, p − 1
  gradient hops) whatever the monitor's own aggregation moves; times are consistent (compute ≤ attention,
  wait ≤ in flight, hidden share in [0, 1]); only rank 0 writes, min ≤ max, every rank gets the
  same summary; ``close()`` unhooks everything.
- The main job under ``torchrun`` with ``ds_configs/cpu_default.json`` (metrics on, CSV monitor):
  every metric has a CSV row for every step, and ``launch/plot_metrics.py`` draws them to a PNG.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ds_ring
from ds_ring.hooks import hooks_active
from ds_ring.monitor import METRICS, RingMonitor
from launch.plot_metrics import read_metrics
from tests.dist import CaseLog, run_distributed
from tests.trainer_runs import ROOT, torchrun_reaped

B, L, H, D, STEPS = 1, 8, 2, 4, 3


class _ListWriter:
    def __init__(self) -> None:
        self.events: list[tuple[str, float, int]] = []

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        self.events.extend(event_list)


def _attention(seed: int) -> list[torch.Tensor]:
    """Output and input gradients of one dense ring attention forward + backward (non-causal: every block
    visits every rank, so the bytes are the full ring's)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L, H, D, generator=g, requires_grad=True) for _ in range(3))
    out = ds_ring.ring_dilated_attention(q, k, v)
    out.sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _rank(rank: int, world: int) -> dict:
    log = CaseLog()
    unobserved = _attention(rank)
    writer = _ListWriter()
    monitor = RingMonitor(metrics=True, watchdog=True, numerics_guard="warn", writer=writer)
    summaries, observed = [], []
    for step in range(1, STEPS + 1):
        monitor.begin_step(step)
        observed.append(_attention(rank))
        summaries.append(monitor.end_step(loss=float(step)))
    monitor.close()
    with log.case("hooks never change results: output and gradients bit-equal"):
        for got, want in zip(observed[0], unobserved, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    block = 2 * B * L * H * D * 4  # one rank's K and V, fp32 (the dK/dV blocks are the same size)
    with log.case("bytes: exactly the ring's, per rank and step"):
        for summary in summaries:
            for name in ("sent_bytes", "received_bytes"):
                assert summary[f"{name}_min"] == summary[f"{name}_max"] == 3 * (world - 1) * block, summary
    with log.case("times are consistent"):
        for s in summaries:
            assert 0 < s["attention_compute_ms_min"] <= s["attention_ms_max"], s
            assert s["comm_wait_ms_min"] >= 0 and s["comm_wait_ms_max"] <= s["comm_ms_max"], s
            assert 0 <= s["comm_hidden_share_min"] <= s["comm_hidden_share_max"] <= 1, s
            assert s["attention_ms_max"] <= s["step_ms_max"] and s["peak_memory_mib_min"] > 0, s
            assert all(s[f"{m}_min"] <= s[f"{m}_max"] for m in METRICS), s
    with log.case("rank 0 writes every metric's min and max for every step, the others nothing"):
        expected = sorted((f"ds_ring/{m}_{stat}", step) for m in METRICS for stat in ("min", "max")
                          for step in range(1, STEPS + 1))  # fmt: skip
        expected += [("ds_ring/loss", step) for step in range(1, STEPS + 1)]
        written = sorted((name, step) for name, _, step in writer.events)
        assert written == (sorted(expected) if rank == 0 else []), written[:5]
        if rank == 0:
            values = {(name, step): value for name, value, step in writer.events}
            assert all(values[(f"ds_ring/{m}_max", 1)] == summaries[0][f"{m}_max"] for m in METRICS)
    with log.case("close() removes every hook"):
        assert not hooks_active() and not hooks_active("start")
    return {"failures": log.failures, "summaries": summaries}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_metrics_are_measured_and_aggregated(world: int) -> None:
    results = run_distributed(_rank, world, timeout=90)
    failures = [f for result in results for f in result["failures"]]
    assert not failures, "\n".join(failures[:3])
    summaries = [result["summaries"] for result in results]
    for other in summaries[1:]:
        for mine, theirs in zip(summaries[0], other, strict=True):
            assert all(math.isclose(mine[k], theirs[k]) or (math.isnan(mine[k]) and math.isnan(theirs[k]))
                       for k in mine)  # fmt: skip


@pytest.mark.timeout(180)
def test_training_run_writes_every_metric_every_step_and_plots_them(tmp_path: Path) -> None:
    steps = 5
    args = ["--deepspeed_config", str(ROOT / "ds_configs" / "cpu_default.json"), "--seq", "512", "--steps",
            str(steps), "--save-every", "0", "--save-dir", str(tmp_path / "run")]  # fmt: skip
    done = torchrun_reaped(args, tmp_path, tmp_path / "torchrun.log", timeout=150)
    assert done.code == 0, done.output[-4000:]
    directory = tmp_path / "run" / "monitor" / "cpu_default"  # output_path "" -> <save-dir>/monitor
    metrics = read_metrics(directory)
    for name in METRICS:
        for stat in ("min", "max"):
            series = metrics[f"{name}_{stat}"]
            assert sorted(series) == list(range(1, steps + 1)), (name, stat, series)
        assert all(metrics[f"{name}_min"][s] <= metrics[f"{name}_max"][s] for s in range(1, steps + 1)), name
    assert all(v > 0 for v in metrics["sent_bytes_min"].values())
    assert all(0 <= v <= 1 for v in metrics["comm_hidden_share_max"].values())
    out = tmp_path / "metrics.png"
    plot = subprocess.run([sys.executable, str(ROOT / "launch" / "plot_metrics.py"), str(directory), "--out",
                           str(out)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
