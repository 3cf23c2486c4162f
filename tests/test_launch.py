"""Every launcher starts the main job (2 CPU ranks, loopback only) for a few steps.

``deepspeed`` (local, and with a hostfile started per node with ``--no_ssh``), ``torchrun`` and
``mpirun`` (rank discovery through mpi4py, TCP restricted to ``lo``, ``MASTER_ADDR=127.0.0.1``).
"""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.jobs  # a whole job under a launcher: CI's second step (docs/testing.md)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TRAIN_ARGS = ["launch/train.py", "--deepspeed_config", "ds_configs/cpu_default.json", "--seq", "512", "--steps", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: list[str], tmp_path: Path, port: int) -> str:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(
            [*command, "--save-dir", str(tmp_path / "ckpt"), "--save-every", "3"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        # DeepSpeed's CPU shared-memory all-reduce (under its launcher) leaves 2 × 69 MB per job in /dev/shm.
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            leftover.unlink(missing_ok=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "rank 0:" in output and "rank 1:" in output, output[-4000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step3"
    return output


@pytest.mark.timeout(300)
def test_launch_deepspeed(tmp_path):
    port = _free_port()
    _run([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
          *TRAIN_ARGS], tmp_path, port)  # fmt: skip


@pytest.mark.timeout(300)
def test_launch_deepspeed_hostfile(tmp_path):
    port = _free_port()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    # --no_ssh --node_rank: each node of the hostfile is started by hand (no ssh; one node here).
    _run([str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0", "--master_addr",
          "127.0.0.1", "--master_port", str(port), *TRAIN_ARGS], tmp_path, port)  # fmt: skip


@pytest.mark.timeout(300)
def test_launch_torchrun(tmp_path):
    port = _free_port()
    _run([str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
          "--master-port", str(port), *TRAIN_ARGS], tmp_path, port)  # fmt: skip


@pytest.mark.timeout(300)
def test_launch_mpirun(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin libopenmpi-dev; .ci/run installs it)")
    pytest.importorskip("mpi4py", reason="pip install -e .[mpi]")
    port = _free_port()
    _run([mpirun, "-np", "2", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
          "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo",
          "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}", "-x", "DS_ACCELERATOR", "-x",
          "TORCH_EXTENSIONS_DIR", sys.executable, *TRAIN_ARGS], tmp_path, port)  # fmt: skip
