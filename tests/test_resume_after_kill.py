"""A rank SIGKILLed mid-training: the restarted job resumes from the last checkpoint and ends bit-equal.

The main job (launch/train.py, 2 CPU ranks, fp32, deterministic data: a pure function of the step)
trains 8 steps, checkpointing every 2. Rank 1 is SIGKILLed in training step 6, just before its
first ring transfer (``DS_RING_FAULT``), so the last checkpoint is ``step4`` and step 5 is lost.

- ``torchrun --max-restarts 1``: the agent restarts both ranks, which resume from ``step4``;
- a plain re-run: ``torchrun --max-restarts 0`` fails (non-zero), then the very same command (the
  fault still set: it fires only in a run started from scratch) resumes from ``step4``.

Both end with parameters exactly equal to those of an uninterrupted run, and the CSV monitor
holds the metrics of all 8 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launch.plot_metrics import read_metrics
from tests.trainer_runs import train_with_checkpoints, write_config

pytestmark = pytest.mark.jobs  # a whole job under a launcher: CI's second step (docs/testing.md)

STEPS, SAVE_EVERY, KILL_STEP = 8, 2, 6
LAST_CHECKPOINT = KILL_STEP - 1 - (KILL_STEP - 1) % SAVE_EVERY  # 4
FAULT = f"kill:rank=1:step={KILL_STEP}"


def _launch(run: Path, log: str, max_restarts: int = 0, **env: str):
    return train_with_checkpoints(
        run, run.parent / "ds_config.json", run / log, steps=STEPS, save_every=SAVE_EVERY, timeout=150,
        max_restarts=max_restarts, extra=("--metrics-log", str(run / "metrics.jsonl")), **env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("resume")
    write_config(root / "ds_config.json")
    run = root / "uninterrupted"
    run.mkdir()
    done = _launch(run, "torchrun.log")
    assert done.code == 0, done.output[-4000:]
    return torch.load(run / "final.pt")


def _check_resumed(run: Path, output: str, expected: dict[str, torch.Tensor]) -> int:
    """Assert the resumed run's state; returns the steps lost (done before the kill, not in the checkpoint)."""
    assert f"ds_ring fault injection: rank 1 kill in training step {KILL_STEP}" in output, output[-4000:]
    assert f"resumed from checkpoint step{LAST_CHECKPOINT} at step {LAST_CHECKPOINT}" in output, output[-4000:]
    final = torch.load(run / "final.pt")
    assert final.keys() == expected.keys()
    unequal = [name for name in final if not torch.equal(final[name], expected[name])]
    assert not unequal, f"parameters differ from the uninterrupted run: {unequal}"
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    before_kill = logged[: logged.index(LAST_CHECKPOINT + 1, logged.index(LAST_CHECKPOINT + 1) + 1)]
    assert before_kill == list(range(1, KILL_STEP)), logged
    metrics = read_metrics(run / "ckpt" / "monitor" / "cpu_default")
    for name in ("attention_compute_ms_max", "comm_hidden_share_min", "sent_bytes_max", "peak_memory_mib_max"):
        assert sorted(metrics[name]) == list(range(1, STEPS + 1)), (name, metrics[name])
    return len(before_kill) - LAST_CHECKPOINT


@pytest.mark.timeout(300)
def test_torchrun_restart_resumes_to_the_same_parameters(uninterrupted, tmp_path: Path) -> None:
    write_config(tmp_path / "ds_config.json")
    run = tmp_path / "restarted"
    run.mkdir()
    done = _launch(run, "torchrun.log", max_restarts=1, DS_RING_FAULT=FAULT)
    assert done.code == 0, done.output[-4000:]
    lost = _check_resumed(run, done.output, uninterrupted)
    assert lost == 1
    print(f"torchrun --max-restarts 1: resumed from step{LAST_CHECKPOINT}, {lost} completed step(s) lost")


@pytest.mark.timeout(300)
def test_plain_rerun_resumes_to_the_same_parameters(uninterrupted, tmp_path: Path) -> None:
    write_config(tmp_path / "ds_config.json")
    run = tmp_path / "rerun"
    run.mkdir()
    failed = _launch(run, "first.log", DS_RING_FAULT=FAULT)
    assert failed.code not in (0, None), failed.output[-4000:]
    assert (run / "ckpt" / "latest").read_text().strip() == f"step{LAST_CHECKPOINT}"
    again = _launch(run, "second.log", DS_RING_FAULT=FAULT)
    assert again.code == 0, again.output[-4000:]
    lost = _check_resumed(run, failed.output + again.output, uninterrupted)
    assert lost == 1
    print(f"plain re-run: resumed from step{LAST_CHECKPOINT}, {lost} completed step(s) lost")
