"""The existing libraries the benchmarks compare against, installed from PyPI on first use.

Pinned, and installed with ``--no-deps`` plus their light pure-Python needs: dilated-attention-pytorch
declares xformers (no CPU path; would also pull a CUDA torch), which the benchmark replaces with
PyTorch SDPA at run time instead (see ``benchmarks/dilated.py``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

__all__ = ["LIBRARIES", "ensure_libraries"]

# import name -> pip requirement
LIBRARIES = {
    "ring_attention_pytorch": "ring-attention-pytorch==0.5.20",
    "dilated_attention_pytorch": "dilated-attention-pytorch==0.2.0",
    "einops": "einops>=0.8.0",
    "beartype": "beartype",
    "jaxtyping": "jaxtyping",
}


def ensure_libraries() -> list[str]:
    """Install whichever of :data:`LIBRARIES` is missing into this interpreter; returns what was installed.

    A failed install is reported, not raised: each benchmark row records the library's import error.
    """
    missing = [req for name, req in LIBRARIES.items() if importlib.util.find_spec(name) is None]
    if not missing:
        return []
    print(f"benchmarks: installing {' '.join(missing)} (--no-deps)", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing], check=False)
    if done.returncode:
        print(f"benchmarks: pip exited {done.returncode}; rows of the missing libraries will show the error")
    return missing
