"""On a CUDA machine (``pytest -m cuda``; skipped without one): the jobs run end to end on NCCL.

- the main job on one GPU rank through ``ds_ring.initialize`` (``"cpu:gloo,cuda:nccl"``: control traffic on
  gloo, data on NCCL), a few steps, in fp32 and in bf16 (DeepSpeed's ``bf16`` section, as a GPU job runs it);
  then on every GPU of the machine when there are two or more;
- ``launch/train_hf.py`` (a Hugging Face Llama through ``ds_ring.integrations.hf``) for a few steps.

Each run's ds_config is the launch script's default with ``sequence_parallel_size`` set to the ranks it runs on
(the defaults ask for 2 sequence ranks, which one GPU cannot hold: NCCL allows one rank per GPU).
"""

from __future__ import annotations

import json
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


def _config(default: str, ranks: int, path: Path, *, bf16: bool = False) -> str:
    """``default`` (a ds_configs file) with every rank in one sequence-parallel group of ``ranks``."""
    config = json.loads((ROOT / default).read_text())
    config["ring_attention"]["sequence_parallel_size"] = ranks
    if bf16:
        config["bf16"] = {"enabled": True}
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_main_job_on_nccl(tmp_path, bf16):
    ranks = [1] + ([torch.cuda.device_count()] if torch.cuda.device_count() > 1 else [])
    for count in ranks:
        config = _config("ds_configs/cpu_default.json", count, tmp_path / f"ds_config{count}.json", bf16=bf16)
        out = _torchrun("launch/train.py", count, "--deepspeed_config", config, "--steps", "5",
                        "--save-dir", str(tmp_path / f"run{count}"), tmp_path=tmp_path)  # fmt: skip
        assert "loss:" in out, out


@pytest.mark.timeout(900)
def test_train_hf_on_nccl(tmp_path):
    ranks = max(1, min(2, torch.cuda.device_count()))
    config = _config("ds_configs/hf_ring.json", ranks, tmp_path / "ds_config.json")
    out = _torchrun("launch/train_hf.py", ranks, "--deepspeed_config", config, "--steps", "5", tmp_path=tmp_path)
    assert "loss:" in out, out
