"""Preemption and resume for the Hugging Face entry points: ``launch/train_hf.py`` (ds_ring.initialize + a Llama)
and ``launch/train_trainer.py`` (``SequenceParallelTrainer``), each under ``torchrun`` on 2 CPU ranks.

Each script runs 8 steps with no periodic saves; once its progress bar shows step 2, SIGTERM goes to torchrun's
process group. Every worker must exit 0 (torchrun itself exits 1 after a SIGTERM: its agent re-raises the signal
as ``SignalException`` whatever its workers did), having saved the step reached (``ds_ring.save_checkpoint`` in
``--save-dir``; the Trainer: its own ``checkpoint-<step>`` through transformers' save path), and the same command
relaunched (the Trainer with ``--resume``) must resume from it and end with the uninterrupted run's parameters
(bit-equal: the same shape). About 4 minutes on 2 shared cores: marked slow.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from ds_ring.testing import Progress
from tests.trainer_runs import BIN, ROOT, free_port, launched, reap, run_command

pytestmark = pytest.mark.slow
STEPS, SIGNAL_AFTER = 8, 2
IDLE_S = 120  # a hang guard: no CPU used by the launched processes for this long


def _torchrun(port: int, script: str, *args: str) -> list[str]:
    return [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), str(ROOT / "launch" / script), "--seq", "512", "--steps", str(STEPS),
            *args]  # fmt: skip


def _step_shown(log: Path) -> int:
    """The highest step a progress bar in ``log`` shows (tqdm: ``| 3/8 [``)."""
    return max(map(int, re.findall(rf"(\d+)/{STEPS} \[", log.read_text(errors="replace"))), default=0)


def _run(run: Path, name: str, script: str, *args: str) -> str:
    port = free_port()
    done = run_command(_torchrun(port, script, *args), port, run / f"{name}.log", timeout=IDLE_S)
    assert done.code == 0, done.output[-4000:]
    return done.output


def _preempt(run: Path, script: str, *args: str) -> str:
    """Start the script, SIGTERM torchrun's group once step ``SIGNAL_AFTER`` shows; its output once every worker
    exited 0 (torchrun names a worker that did not: ``ChildFailedError``)."""
    port, log = free_port(), run / "preempted.log"
    try:
        with launched(_torchrun(port, script, *args), port, log) as proc:
            progress = Progress(lambda: [proc.pid], IDLE_S)
            progress.wait_until(lambda: _step_shown(log) >= SIGNAL_AFTER or proc.poll() is not None, "step shown")
            os.killpg(proc.pid, signal.SIGTERM)
            progress.wait_until(lambda: proc.poll() is not None, "exit after SIGTERM")
            output = log.read_text()
            assert "SignalException" in output and "ChildFailedError" not in output, output[-4000:]
    finally:
        assert reap(str(run)) == [], "processes left running"
    return output


def _assert_equal(whole: Path, resumed: Path) -> None:
    expected, final = torch.load(whole), torch.load(resumed)
    pairs = (
        zip(expected.values(), final.values(), strict=True)
        if isinstance(expected, dict)
        else zip(expected, final, strict=True)
    )
    assert all(torch.equal(a, b) for a, b in pairs), "parameters differ from the uninterrupted run"


@pytest.mark.timeout(600)
def test_train_hf_saves_on_sigterm_and_resumes(tmp_path: Path) -> None:
    _run(tmp_path, "whole", "train_hf.py", "--save-dir", str(tmp_path / "whole"), "--final-params",
         str(tmp_path / "whole.pt"))  # fmt: skip
    run = tmp_path / "run"
    output = _preempt(tmp_path, "train_hf.py", "--save-dir", str(run))
    step = int(re.search(r"preempted after step (\d+): saved step \1 in", output).group(1))
    assert SIGNAL_AFTER <= step < STEPS and (run / "latest").read_text().strip() == f"step{step}", output[-4000:]
    output = _run(tmp_path, "resumed", "train_hf.py", "--save-dir", str(run), "--final-params",
                  str(tmp_path / "resumed.pt"))  # fmt: skip
    assert f"resumed from checkpoint step{step} at step {step}" in output, output[-4000:]
    _assert_equal(tmp_path / "whole.pt", tmp_path / "resumed.pt")


@pytest.mark.timeout(600)
def test_trainer_saves_on_sigterm_and_resumes(tmp_path: Path) -> None:
    common = ("--batch", "2", "--samples", "64")
    _run(tmp_path, "whole", "train_trainer.py", *common, "--output-dir", str(tmp_path / "whole"), "--final-params",
         str(tmp_path / "whole.pt"))  # fmt: skip
    run = tmp_path / "run"
    output = _preempt(tmp_path, "train_trainer.py", *common, "--output-dir", str(run))
    saved = sorted(p.name for p in run.glob("checkpoint-*"))
    assert len(saved) == 1, (saved, output[-4000:])
    step = int(saved[0].removeprefix("checkpoint-"))
    assert SIGNAL_AFTER <= step < STEPS, output[-4000:]
    _run(tmp_path, "resumed", "train_trainer.py", *common, "--output-dir", str(run), "--resume", "--final-params",
         str(tmp_path / "resumed.pt"))  # fmt: skip
    _assert_equal(tmp_path / "whole.pt", tmp_path / "resumed.pt")
