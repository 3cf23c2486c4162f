"""``launch/train.py`` with DeepSpeed's CPU accelerator reporting fp16 as supported (tests only).

DeepSpeed refuses ``fp16`` on a CPU whose oneDNN has no fp16 kernels (``Type fp16 is not supported on your
device``), though torch computes in fp16 on any CPU (slowly, upcasting). What the recovery tests check of fp16 —
the loss scaler and the fp32 master weights across a checkpoint — does not depend on the matmul kernel, so they
start ranks through this script: ``torchrun ... tests/cpu_fp16_train.py <launch/train.py arguments>``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

TRAIN = Path(__file__).resolve().parents[1] / "launch" / "train.py"

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float32, torch.bfloat16, torch.float16]
    sys.argv[0] = str(TRAIN)
    runpy.run_path(str(TRAIN), run_name="__main__")
