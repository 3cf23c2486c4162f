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


HANG_GUARD_FACTOR = 10
"""pytest-timeout's limits (``timeout`` in pyproject.toml, ``@pytest.mark.timeout``) are hang guards only, this many
times a test's time on a quiet machine: the waits inside a test are on progress (:class:`ds_ring.testing.Progress`),
so a loaded machine slows a test down without failing it."""


def pytest_collection_modifyitems(config, items) -> None:
    """Every timeout marker scaled by :data:`HANG_GUARD_FACTOR` (the ini ``timeout`` is scaled in pyproject)."""
    import pytest

    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            item.add_marker(pytest.mark.timeout(marker.args[0] * HANG_GUARD_FACTOR), append=False)


def pytest_sessionstart(session) -> None:
    """A lock left by a killed build of DeepSpeed's ops is removed at once, with a warning naming it (it would hang
    every test that starts DeepSpeed)."""
    from ds_ring.engine.build_locks import clear_stale_build_locks

    clear_stale_build_locks()
