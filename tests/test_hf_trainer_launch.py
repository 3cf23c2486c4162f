"""``launch/train_trainer.py`` (``SequenceParallelTrainer``) under the three launchers, killed and resumed.

The script leaves ``TrainingArguments(use_cpu=...)`` at its default, as a GPU job does. An uninterrupted 6-step run
under ``accelerate launch`` over a ``datasets.Dataset``; the same run over the torch dataset of the same 64 samples
under the ``deepspeed`` launcher with rank 1 SIGKILLed when step 5 begins (checkpoints every 2 steps); ``torchrun``
resuming it with ``resume_from_checkpoint`` from ``checkpoint-4``: the final parameters are bit-equal to the
uninterrupted run's (same batches from either dataset under either launcher, and the resume exact).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_runs import BIN, ROOT, free_port, reap, run_command

pytestmark = pytest.mark.jobs  # a whole job under a launcher: CI's second step (docs/testing.md)

SCRIPT = str(ROOT / "launch" / "train_trainer.py")
ARGS = ["--seq", "512", "--steps", "6", "--batch", "2", "--samples", "64"]


def _launch(launcher: list[str], tmp: Path, name: str, *args: str, **env: str) -> tuple[int | None, str]:
    port = free_port()
    command = [arg.replace("PORT", str(port)) for arg in launcher] + [SCRIPT, *ARGS, *args]
    try:
        done = run_command(command, port, tmp / f"{name}.log", timeout=150, **env)
    finally:
        assert reap(str(tmp)) == [], "processes left running"
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            leftover.unlink(missing_ok=True)  # DeepSpeed's CPU shared-memory all-reduce buffers (its launcher)
    return done.code, done.output


@pytest.mark.timeout(400)
def test_trainer_killed_and_resumed_bit_exactly(tmp_path: Path) -> None:
    accelerate = [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
                  "--main_process_port", "PORT"]  # fmt: skip
    code, output = _launch(accelerate, tmp_path, "whole", "--output-dir", str(tmp_path / "whole"),
                           "--final-params", str(tmp_path / "whole.pt"), "--dataset", "datasets")  # fmt: skip
    assert code == 0, output[-4000:]
    assert "6 steps, 6144 tokens on 2 ranks" in output, output[-4000:]

    run = tmp_path / "run"
    deepspeed = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", "PORT"]
    code, output = _launch(deepspeed, tmp_path, "killed", "--output-dir", str(run), "--save-steps", "2",
                           DS_RING_FAULT="kill:rank=1:step=5")  # fmt: skip
    assert code not in (0, None), output[-4000:]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"], output[-4000:]

    torchrun = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", "PORT"]  # fmt: skip
    code, output = _launch(torchrun, tmp_path, "resumed", "--output-dir", str(run), "--save-steps", "2", "--resume",
                           "--final-params", str(tmp_path / "resumed.pt"))  # fmt: skip
    assert code == 0, output[-4000:]
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert len(whole) == len(resumed)
    for a, b in zip(whole, resumed, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
