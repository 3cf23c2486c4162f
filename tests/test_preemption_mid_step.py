"""A signal in the middle of a step many times longer than the grace period: the step is abandoned on every rank,
the step before it is saved within the grace, and a relaunch resumes from it and ends as if never stopped.

The main job (launch/train.py, 2 CPU ranks, ZeRO 2, 512 tokens, ``grace_s`` 2, no periodic saves) runs 6 steps.
In step 3 rank 1 sleeps 60 s before its first ring transfer (``DS_RING_FAULT``), so rank 0 waits on it: a 60 s
step. Once rank 1 has logged that it sleeps (progress, not a clock), the signal goes to

- torchrun's process group (both workers get SIGTERM);
- rank 1 alone, as SIGUSR1, ranks started per process (as ``srun`` starts them): rank 0 learns of it from
  rank 1's notice in the save directory.

Every worker must be gone within ``grace_s`` + 3 s of the signal (torchrun itself within ``grace_s`` + 10 s: its
agent's own teardown), every worker must exit 0 having abandoned
step 3, ``latest`` must name step 2 (each rank's part written, no collective), and the same command relaunched
must resume from step 2 and end with the uninterrupted run's parameters (bit-equal). The SIGTERM case is a CI job
(``jobs``: 1 min for the uninterrupted run and 2 for the case at load 20 on 2 cores), the SIGUSR1 case ``slow``.
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
from tests.trainer_runs import BIN, ROOT, TRAIN, free_port, launched, processes_with, reap, torchrun_reaped

STEPS, STALLED_STEP, GRACE_S = 6, 3, 2.0
FAULT = f"sleep:rank=1:step={STALLED_STEP}:seconds=60"
WORKER_SLACK_S = 3.0  # a worker's save and exit after the grace-bound abandon, on a loaded machine
LAUNCHER_SLACK_S = 10.0  # torchrun's agent: its own teardown after its workers are gone
HANG_GUARD_S = 300


def _config(run: Path) -> Path:
    config = json.loads((ROOT / "ds_configs" / "cpu_default.json").read_text())
    config["zero_optimization"] = {"stage": 2}
    section = config["ring_attention"]
    section["monitoring"] = {"metrics": False, "watchdog": True, "numerics_guard": "warn"}
    section["preemption"] = {"grace_s": GRACE_S}
    path = run / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def _args(run: Path) -> list[str]:
    return ["--deepspeed_config", str(_config(run)), "--seq", "512", "--steps", str(STEPS), "--save-every", "0",
            "--save-dir", str(run / "ckpt"), "--final-params", str(run / "final.pt")]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run = tmp_path_factory.mktemp("uninterrupted")
    done = torchrun_reaped(_args(run), run, run / "torchrun.log", timeout=HANG_GUARD_S)
    assert done.code == 0, done.output[-4000:]
    return torch.load(run / "final.pt")


def _running(run: Path, workers_only: bool = False) -> list[int]:
    """Processes whose command line names ``run`` (the launcher and its workers, or only the workers)."""
    return [pid for pid, cmdline in processes_with(str(run)) if not (workers_only and "bin/torchrun" in cmdline)]


def _stalled(logs: list[Path]) -> bool:
    return any(f"rank 1 sleep 60.0 s in training step {STALLED_STEP}" in log.read_text(errors="replace")
               for log in logs if log.exists())  # fmt: skip


def _preempt(commands: Callable[[int], list[tuple[list[str], dict[str, str]]]], run: Path, sig: int, target: int,
             group: bool) -> tuple[list[int | None], str, float, float]:  # fmt: skip
    """Start ``commands(port)``, each in a session of its own; once rank 1 stalls in step 3, send ``sig`` to the
    ``target``-th one's group (or to it alone). Returns the exit codes, the output, and the seconds from the
    signal until no worker, and no process at all, of the run is left."""
    port = free_port()
    listed = commands(port)
    logs = [run / f"launched{i}.log" for i in range(len(listed))]
    try:
        with contextlib.ExitStack() as stack:
            procs = [stack.enter_context(launched(command, port, log, DS_RING_FAULT=FAULT, **env))
                     for (command, env), log in zip(listed, logs, strict=True)]  # fmt: skip
            progress = Progress(lambda: [p.pid for p in procs], HANG_GUARD_S)
            progress.wait_until(lambda: _stalled(logs) or any(p.poll() is not None for p in procs), "the stall")
            assert _stalled(logs), "".join(log.read_text() for log in logs)[-4000:]
            signalled_at = time.monotonic()
            (os.killpg if group else os.kill)(procs[target].pid, sig)
            deadline = signalled_at + HANG_GUARD_S  # a hang guard: the bounds asserted are far below it
            while _running(run, workers_only=True) and time.monotonic() < deadline:
                time.sleep(0.02)
            workers_s = time.monotonic() - signalled_at
            while _running(run) and time.monotonic() < deadline:
                time.sleep(0.02)
            gone_s = time.monotonic() - signalled_at
            codes = [p.wait() for p in procs]
    finally:
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            leftover.unlink(missing_ok=True)
        assert reap(str(run)) == []
    return codes, "".join(log.read_text(errors="replace") for log in logs), workers_s, gone_s


def _check(run: Path, output: str, workers_s: float, gone_s: float, uninterrupted: dict[str, torch.Tensor]) -> None:
    assert workers_s < GRACE_S + WORKER_SLACK_S, f"workers left {workers_s:.1f} s after the signal\n{output[-4000:]}"
    assert gone_s < GRACE_S + LAUNCHER_SLACK_S, f"processes left {gone_s:.1f} s after the signal\n{output[-4000:]}"
    completed = STALLED_STEP - 1
    for rank in (0, 1):
        assert f"abandoned it, saved rank {rank}'s part of step {completed} in" in output, output[-4000:]
    assert "exiting with code" not in output and "ChildFailedError" not in output, output[-4000:]
    assert (run / "ckpt" / "latest").read_text().strip() == f"step{completed}", output[-4000:]
    done = torchrun_reaped(_args(run), run, run / "relaunch.log", timeout=HANG_GUARD_S)
    assert done.code == 0, done.output[-4000:]
    assert f"resumed from checkpoint step{completed} at step {completed} (native" in done.output, done.output[-4000:]
    final = torch.load(run / "final.pt")
    unequal = [name for name in uninterrupted if not torch.equal(final[name], uninterrupted[name])]
    assert not unequal, f"parameters differ from the uninterrupted run: {unequal}"


@pytest.mark.jobs  # CI's second step
@pytest.mark.timeout(900)
def test_sigterm_mid_step_to_torchrun(uninterrupted, tmp_path: Path) -> None:
    args = _args(tmp_path)
    _, output, workers_s, gone_s = _preempt(lambda port: [(
        [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), TRAIN, *args], {})], tmp_path, signal.SIGTERM, 0, group=True)  # fmt: skip
    _check(tmp_path, output, workers_s, gone_s, uninterrupted)
    print(f"SIGTERM to torchrun mid-step: workers gone {workers_s:.2f} s, torchrun {gone_s:.2f} s after it "
          f"(grace {GRACE_S:g} s)")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigusr1_mid_step_to_one_rank(uninterrupted, tmp_path: Path) -> None:
    args = _args(tmp_path)

    def ranks(port: int) -> list[tuple[list[str], dict[str, str]]]:
        return [([sys.executable, TRAIN, *args], dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                      LOCAL_WORLD_SIZE="2")) for r in range(2)]  # fmt: skip

    codes, output, workers_s, gone_s = _preempt(ranks, tmp_path, signal.SIGUSR1, 1, group=False)
    assert codes == [0, 0], output[-4000:]
    assert "rank 0 abandons step 3 in flight" in output, output[-4000:]
    _check(tmp_path, output, workers_s, gone_s, uninterrupted)
    print(f"SIGUSR1 to rank 1 mid-step: both ranks gone {workers_s:.2f} s after it (grace {GRACE_S:g} s)")
