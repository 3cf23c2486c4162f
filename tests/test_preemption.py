"""SIGTERM mid-run, no periodic saves: every rank stops after the same step, saves it, exits 0; a relaunch
resumes from it and ends equal to an uninterrupted run.

The main job (launch/train.py, 2 CPU ranks, ZeRO 2, 512 tokens) runs for up to 12 steps with
``--save-every 0``. Once rank 0 has logged step 3, the signal goes to:

- torchrun's process group (the agent forwards SIGTERM to the workers, which run in sessions of their own);
- the ``deepspeed`` launcher's process group (runner, launch.py and the workers: each worker gets the
  signal twice, from the group and from launch.py, within ``repeat_window_s``);
- SIGUSR1 to rank 1 only of ranks started per process (as ``srun`` starts them; SLURM's ``--signal``).

Each rank must finish its main (its summary names the step it stopped at: ``run_main`` then exits 0)
within the grace period, ``latest`` must name that step, and the same command relaunched must resume
from it and end with the uninterrupted run's parameters (bit-equal: the same shape).
About 2-2.5 minutes on 2 shared cores (each case 25-50 s, the uninterrupted run 20 s): marked slow.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds_ring.testing import Progress
from tests.trainer_runs import BIN, TRAIN, free_port, launched, reap, torchrun_reaped, write_config

pytestmark = pytest.mark.slow
STEPS, SIGNAL_AFTER, GRACE_S = 12, 3, 25
HANG_GUARD_S = 300


def _args(run: Path, config: Path) -> list[str]:
    return ["--deepspeed_config", str(config), "--seq", "512", "--steps", str(STEPS), "--save-every", "0",
            "--save-dir", str(run / "ckpt"), "--final-params", str(run / "final.pt"),
            "--metrics-log", str(run / "metrics.jsonl")]  # fmt: skip


def _config(run: Path) -> Path:
    return write_config(run / "ds_config.json", zero_stage=2, metrics=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run = tmp_path_factory.mktemp("uninterrupted")
    done = torchrun_reaped(_args(run, _config(run)), run, run / "torchrun.log", timeout=HANG_GUARD_S)
    assert done.code == 0, done.output[-4000:]
    return torch.load(run / "final.pt")


def _steps_logged(run: Path) -> int:
    try:
        return len((run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _summaries_written(run: Path, ranks: int = 2) -> bool:
    return all(run.joinpath(f"summary.rank{r}.json").exists() for r in range(ranks))


def _summaries(run: Path, ranks: int = 2) -> list[dict]:
    return [json.loads(run.joinpath(f"summary.rank{r}.json").read_text()) for r in range(ranks)]


def _check_preempted(run: Path, output: str, signalled_at: float, ended_at: float) -> int:
    """Assert the stop; returns the step saved."""
    assert ended_at - signalled_at < GRACE_S, f"exited {ended_at - signalled_at:.1f} s after the signal"
    summaries = _summaries(run)
    stopped = {s["preempted"] for s in summaries}
    assert len(stopped) == 1 and None not in stopped, (summaries, output[-4000:])
    step = stopped.pop()
    assert SIGNAL_AFTER <= step <= STEPS
    assert f"preempted: saved step {step} in" in output, output[-4000:]
    assert "exiting with code 1" not in output, output[-4000:]
    assert (run / "ckpt" / "latest").read_text().strip() == f"step{step}"
    return step


def _check_relaunch(run: Path, step: int, expected: dict[str, torch.Tensor]) -> None:
    done = torchrun_reaped(_args(run, run / "ds_config.json"), run, run / "relaunch.log", timeout=HANG_GUARD_S)
    assert done.code == 0, done.output[-4000:]
    assert f"resumed from checkpoint step{step} at step {step} (native" in done.output, done.output[-4000:]
    final = torch.load(run / "final.pt")
    unequal = [name for name in expected if not torch.equal(final[name], expected[name])]
    assert not unequal, f"parameters differ from the uninterrupted run: {unequal}"


def _signal(commands: Callable[[int], list[tuple[list[str], dict[str, str]]]], run: Path, sig: int, target: int = 0,
            group: bool = True) -> tuple[list[int | None], str, float, float]:  # fmt: skip
    """Start ``commands(port)`` (command, extra environment) each in a session of its own; once step 3 is logged
    send ``sig`` to the process group of the ``target``-th (or to it alone: ``group=False``). Returns their exit
    codes, their output, when the signal went and when the last ended (``time.monotonic()``)."""
    port = free_port()
    logs = [run / f"launched{i}.log" for i in range(len(commands(port)))]
    summary = {"DS_RING_TRAIN_SUMMARY": str(run / "summary")}
    try:
        with contextlib.ExitStack() as stack:
            procs = [stack.enter_context(launched(command, port, log, **summary, **env))
                     for (command, env), log in zip(commands(port), logs, strict=True)]  # fmt: skip
            progress = Progress(lambda: [p.pid for p in procs], HANG_GUARD_S)  # a hang guard: steps are waited on
            progress.wait_until(lambda: _steps_logged(run) >= SIGNAL_AFTER or procs[0].poll() is not None,
                                f"step {SIGNAL_AFTER}")  # fmt: skip
            signalled_at = time.monotonic()
            (os.killpg if group else os.kill)(procs[target].pid, sig)
            # the deepspeed runner dies of the signal at once: wait for the workers' summaries, not the launcher
            progress.wait_until(lambda: all(p.poll() is not None for p in procs) and _summaries_written(run), "exit")
            ended_at = time.monotonic()
            codes = [p.returncode for p in procs]
    finally:
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            leftover.unlink(missing_ok=True)
        assert reap(str(run)) == []
    return codes, "".join(log.read_text() for log in logs), signalled_at, ended_at


@pytest.mark.timeout(600)
def test_sigterm_to_torchrun(uninterrupted, tmp_path: Path) -> None:
    args = _args(tmp_path, _config(tmp_path))
    _, output, signalled_at, ended_at = _signal(lambda port: [(
        [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), TRAIN, *args], {})], tmp_path, signal.SIGTERM)  # fmt: skip
    step = _check_preempted(tmp_path, output, signalled_at, ended_at)
    _check_relaunch(tmp_path, step, uninterrupted)


@pytest.mark.timeout(600)
def test_sigterm_to_the_deepspeed_launcher(uninterrupted, tmp_path: Path) -> None:
    args = _args(tmp_path, _config(tmp_path))
    _, output, signalled_at, ended_at = _signal(lambda port: [(
        [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
         TRAIN, *args], {})], tmp_path, signal.SIGTERM)  # fmt: skip
    step = _check_preempted(tmp_path, output, signalled_at, ended_at)
    assert "the same preemption" in output, output[-4000:]
    _check_relaunch(tmp_path, step, uninterrupted)


@pytest.mark.timeout(600)
def test_sigusr1_to_one_rank_of_srun_like_ranks(uninterrupted, tmp_path: Path) -> None:
    args = _args(tmp_path, _config(tmp_path))

    def ranks(port: int) -> list[tuple[list[str], dict[str, str]]]:
        return [([sys.executable, TRAIN, *args], dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                      LOCAL_WORLD_SIZE="2")) for r in range(2)]  # fmt: skip

    codes, output, signalled_at, ended_at = _signal(ranks, tmp_path, signal.SIGUSR1, target=1, group=False)
    assert codes == [0, 0], output[-4000:]
    step = _check_preempted(tmp_path, output, signalled_at, ended_at)
    assert "rank 1 received SIGUSR1" in output and "another rank was signalled" in output, output[-4000:]
    _check_relaunch(tmp_path, step, uninterrupted)
