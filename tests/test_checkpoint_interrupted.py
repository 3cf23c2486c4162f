"""A save cut short never becomes the checkpoint a restart resumes from.

The main job (launch/train.py, 2 CPU ranks, ZeRO-2 so that every rank writes its own optimizer
file) checkpoints every 2 of 8 steps. In the save of step 6, rank 1 writes half of its file and is
then SIGKILLed, or stalls there until the watchdog's step deadline ends it with ``os._exit``.
DeepSpeed alone would have let rank 0 point ``latest`` at step 6 already; with
``ds_ring.save_checkpoint`` the restarted job (``torchrun --max-restarts 1``) resumes from step 4
and ends with parameters bit-equal to an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_ring.engine.checkpoint import COMPLETE, checkpoint_files
from tests.trainer_runs import train_with_checkpoints, write_config

pytestmark = pytest.mark.jobs  # a whole job under a launcher: CI's second step (docs/testing.md)

STEPS, SAVE_EVERY, FAULT_STEP = 8, 2, 6
STEP_TIMEOUT_S = 20  # the watchdog's step deadline in the stalled case: far above a step with its save


def _launch(run: Path, config: Path, max_restarts: int = 0, **env: str):
    return train_with_checkpoints(run, config, run / "torchrun.log", steps=STEPS, save_every=SAVE_EVERY, timeout=200,
                                  max_restarts=max_restarts, **env)  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run = tmp_path_factory.mktemp("uninterrupted")
    done = _launch(run, write_config(run / "ds_config.json", zero_stage=2))
    assert done.code == 0, done.output[-4000:]
    return torch.load(run / "final.pt")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["kill_in_save", "sleep_in_save"])
def test_interrupted_save_is_never_resumed_from(uninterrupted, fault: str, tmp_path: Path) -> None:
    stalls = fault == "sleep_in_save"
    monitoring = {"step_timeout_s": STEP_TIMEOUT_S} if stalls else {}
    config = write_config(tmp_path / "ds_config.json", zero_stage=2, **monitoring)
    spec = f"{fault}:rank=1:step={FAULT_STEP}" + (":seconds=600" if stalls else "")
    done = _launch(tmp_path, config, max_restarts=1, DS_RING_FAULT=spec)
    output = done.output
    assert done.code == 0, output[-4000:]
    assert f"ds_ring fault injection: rank 1 {fault} after writing half of zero_pp_rank_1" in output, output[-4000:]
    if stalls:
        assert "still running after 20" in output and "dumping every thread's stack" in output, output[-4000:]
    assert "resumed from checkpoint step4 at step 4" in output, output[-4000:]
    final = torch.load(tmp_path / "final.pt")
    assert final.keys() == uninterrupted.keys()
    unequal = [name for name in final if not torch.equal(final[name], uninterrupted[name])]
    assert not unequal, f"parameters differ from the uninterrupted run: {unequal}"
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == f"step{STEPS}"
    for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):  # step 6 re-saved whole by the restarted job
        listed = json.loads((ckpt / f"step{step}" / COMPLETE).read_text())["files"]
        assert listed == checkpoint_files(ckpt / f"step{step}"), step
