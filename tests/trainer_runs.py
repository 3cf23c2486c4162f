"""Start the main job (launch/train.py) for recovery tests: per-rank processes or a launcher, hang guards.

Every process starts in its own session (process group), output goes to files (no pipe to fill),
and whatever is still running when the processes stop making progress (no CPU used by them or anything
they started for ``timeout`` seconds: :class:`ds_ring.testing.Progress`) or when the test ends is
SIGKILLed by group, so a test can neither hang nor leave a process behind, nor fail for being slow on a
loaded machine; :func:`reap` tells whether one survived.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ds_ring.testing import Progress

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TRAIN = str(ROOT / "launch" / "train.py")
_TERM_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, *, sequence_parallel: int = 2, dense: bool = False, timeout_s: float = 120,
                 zero_stage: int | None = None, micro_batch: int | None = None,
                 **monitoring: object) -> Path:  # fmt: skip
    """``ds_configs/cpu_default.json`` with the given ring size, wait bound, ZeRO stage, micro-batch and monitoring
    settings."""
    config = json.loads((ROOT / "ds_configs" / "cpu_default.json").read_text())
    if zero_stage is not None:
        config["zero_optimization"] = {"stage": zero_stage}
    if micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = micro_batch
    section = config["ring_attention"]
    section.update(sequence_parallel_size=sequence_parallel, timeout_s=timeout_s)
    section["monitoring"] = {**section.get("monitoring", {}), **monitoring}
    if dense:
        section.pop("segment_lengths")
        section.pop("dilation_rates")
    path.write_text(json.dumps(config))
    return path


def environment(port: int, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "DS_RING_FAULT"}
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", **extra}


@dataclass
class Exit:
    """How one process ended: its exit code, when (``time.time()``), and its output."""

    code: int | None  # None: killed by the hang guard
    at: float
    output: str


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first (torchrun then stops its workers, which run in sessions of their own), then SIGKILL."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_TERM_GRACE_S)
    _signal_group(proc, signal.SIGKILL)  # also whatever the process started in its group and left behind
    proc.wait()


def _run_all(commands: list[tuple[list[str], dict[str, str]]], logs: list[Path], timeout: float) -> list[Exit]:
    procs, handles, ended = [], [], {}
    try:
        for (command, env), log in zip(commands, logs, strict=True):
            handle = open(log, "w")  # noqa: SIM115 - closed below
            handles.append(handle)
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
        progress = Progress(lambda: [proc.pid for i, proc in enumerate(procs) if i not in ended], timeout)
        while len(ended) < len(procs) and not progress.stalled():
            for i, proc in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = (proc.returncode, time.time())
            time.sleep(0.05)
    finally:
        for proc in procs:
            _stop(proc)
        for handle in handles:
            handle.close()
    return [Exit(*ended.get(i, (None, time.time())), logs[i].read_text()) for i in range(len(procs))]


@contextlib.contextmanager
def launched(command: list[str], port: int, log: Path, **env: str) -> Iterator[subprocess.Popen]:
    """A launcher command running in its own session (output to ``log``) while the block runs; stopped after it."""
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, cwd=ROOT, env=environment(port, **env), stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            yield proc
        finally:
            _stop(proc)


def run_ranks(args: list[str], world: int, port: int, tmp: Path, timeout: float, **env: str) -> list[Exit]:
    """One trainer process per rank, started like a launcher would (``RANK``/``WORLD_SIZE`` env)."""
    commands = [
        ([sys.executable, TRAIN, *args], environment(port, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                     LOCAL_WORLD_SIZE=str(world), **env))
        for r in range(world)
    ]  # fmt: skip
    return _run_all(commands, [tmp / f"rank{r}.log" for r in range(world)], timeout)


def run_command(command: list[str], port: int, log: Path, timeout: float, **env: str) -> Exit:
    """One launcher command (its own session, output to ``log``) with ``MASTER_ADDR``/``MASTER_PORT`` set."""
    return _run_all([(command, environment(port, **env))], [log], timeout)[0]


def run_torchrun(
    args: list[str], port: int, log: Path, timeout: float, max_restarts: int = 0, nproc: int = 2, **env: str
) -> Exit:
    """``torchrun --nproc-per-node <nproc>`` of the trainer on loopback."""
    command = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--max-restarts", str(max_restarts), TRAIN, *args]  # fmt: skip
    return run_command(command, port, log, timeout, **env)


def processes_with(marker: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the live processes (not zombies, not this one) whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            zombie = "(zombie)" in (entry / "status").read_text()
        except OSError:
            continue
        if marker in cmdline and not zombie:
            found.append((int(entry.name), cmdline))
    return found


def reap(marker: str) -> list[str]:
    """SIGKILL processes still running whose command line holds ``marker`` (the test's unique tmp
    dir: only processes the test started); returns their command lines (a test asserts none)."""
    found = []
    for pid, cmdline in processes_with(marker):
        found.append(cmdline)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def train_with_checkpoints(
    run: Path, config: Path, log: Path, *, steps: int, save_every: int, timeout: float, max_restarts: int = 0,
    extra: tuple[str, ...] = (), **env: str,
) -> Exit:  # fmt: skip
    """``torchrun`` of the trainer at 512 tokens saving to ``run/ckpt`` every ``save_every`` steps and its final
    parameters to ``run/final.pt``; asserts that nothing it started is left running."""
    args = ["--deepspeed_config", str(config), "--seq", "512", "--steps", str(steps), "--save-every", str(save_every),
            "--save-dir", str(run / "ckpt"), "--final-params", str(run / "final.pt"), *extra]  # fmt: skip
    return torchrun_reaped(args, run, log, timeout, max_restarts, **env)


def torchrun_reaped(
    args: list[str], run: Path, log: Path, timeout: float, max_restarts: int = 0, nproc: int = 2, **env: str
) -> Exit:
    """:func:`run_torchrun` on a free port, then assert that no process whose command line names ``run`` is left."""
    try:
        return run_torchrun(args, free_port(), log, timeout=timeout, max_restarts=max_restarts, nproc=nproc, **env)
    finally:
        left = reap(str(run))
        assert left == [], f"processes left running: {left}"
