"""Make the repository root importable (``ds_ring``, ``tests.dist``) however pytest is invoked."""

import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The tests run on CPU ranks with gloo whatever the machine has; DeepSpeed's JIT-compiled CPU ops
# (~90 s the first time) are cached in the repository (git-ignored) so later runs load them.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(_ROOT) / ".torch_extensions"))


def pytest_sessionstart(session) -> None:
    """A lock left by a killed build of DeepSpeed's ops fails the run at once, naming it (it would hang every test
    that starts DeepSpeed)."""
    from ds_ring.build_locks import refuse_stale_build_locks

    refuse_stale_build_locks()
