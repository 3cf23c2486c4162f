"""On a CUDA machine (``pytest -m cuda``; skipped without one): the jobs run end to end on NCCL.

- the main job on one GPU rank through ``ds_ring.initialize`` (``"cpu:gloo,cuda:nccl"``: control traffic on
  gloo, data on NCCL), a few steps; then on every GPU of the machine when there are two or more;
- ``launch/train_hf.py`` (a Hugging Face Llama through ``ds_ring.integrations.hf``) for a few steps.

Nothing here has run yet: the project has no GPU (docs/testing.md, "Which paths have run on a GPU").
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with -m cuda on a GPU machine)"),
]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _torchrun(script: str, ranks: int, *args: str, tmp_path: Path) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # let DeepSpeed pick CUDA
    command = [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
               "--master-port", str(port), script, *args]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.timeout(900)
def test_main_job_on_nccl(tmp_path):
    ranks = [1] + ([torch.cuda.device_count()] if torch.cuda.device_count() > 1 else [])
    for count in ranks:
        out = _torchrun("launch/train.py", count, "--steps", "5", "--save-dir", str(tmp_path / f"run{count}"),
                        tmp_path=tmp_path)  # fmt: skip
        assert "loss:" in out, out


@pytest.mark.timeout(900)
def test_train_hf_on_nccl(tmp_path):
    ranks = max(1, min(2, torch.cuda.device_count()))
    out = _torchrun("launch/train_hf.py", ranks, "--steps", "5", tmp_path=tmp_path)
    assert "loss:" in out, out
