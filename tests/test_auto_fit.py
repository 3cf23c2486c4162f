"""``auto`` computes with the coefficients ``python -m benchmarks.auto_fit --fit`` decided on: fitted on the recorded
``fit`` grid, used only where they predict the held-out grid better than what the model had before
(``benchmarks/results/auto_fit.json``: ``coefficients``; docs/auto.md "Fitted, then held out"). Redoing the fit and
the gate from the recorded grids gives the same coefficients, and the model carries the used ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import auto_fit
from ds_ring.auto import model
from ds_ring.strategies import get_strategy

RECORDED = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "auto_fit.json").read_text())


def test_auto_uses_the_gated_coefficients() -> None:
    used = RECORDED["coefficients"]["used"]
    assert used["calibration_cpu"] == vars(model.CALIBRATION["cpu"])
    assert used["buffers"] == model.BUFFERS
    assert get_strategy("ring").buffers["ring"] == used["buffers"]["ring"]  # where auto reads them from


def test_the_fit_and_the_gate_reproduce_them() -> None:
    again = auto_fit.coefficients(RECORDED)
    recorded = RECORDED["coefficients"]
    assert again["fitted"]["calibration_cpu"] == recorded["fitted"]["calibration_cpu"]
    assert again["fitted"]["buffers"] == pytest.approx(recorded["fitted"]["buffers"], abs=1e-3)
    assert again["heldout_median_abs_log"] == pytest.approx(recorded["heldout_median_abs_log"], rel=1e-6)
    assert again["used"] == recorded["used"]


def test_a_measured_cpu_link_is_calibrated_and_others_are_not() -> None:
    cpu = model.Calibration(compute=0.5, comm=4.0)
    link = model.Link(latency_s=1e-3, bandwidth=1e9, flops=1e10, device="cpu")
    assert link.calibrated(cpu).flops == pytest.approx(2e10)
    assert link.calibrated(cpu).bandwidth == pytest.approx(2.5e8)
    assert link.calibrated(cpu).latency_s == pytest.approx(4e-3)
    assert link.calibrated() == link.calibrated(model.CALIBRATION["cpu"])
    given = model.Link(latency_s=1e-3, bandwidth=1e9, flops=1e10)
    assert given.calibrated() == given
