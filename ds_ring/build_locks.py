"""A lock left by a killed build of DeepSpeed's JIT ops, found at start-up and named, never waited on forever.

DeepSpeed compiles small CPU ops on first use (``deepspeed_shm_comm``, ~90 s) through
``torch.utils.cpp_extension.load``, which holds ``<TORCH_EXTENSIONS_DIR>/<op>/lock`` while it builds; every other
process waits until the file is gone (``FileBaton.wait``, no deadline, no message). A build killed halfway
(Ctrl-C during the main job's first run, a test's deadline) leaves the file behind, and every later start waits on
it for good. :func:`refuse_stale_build_locks` runs before DeepSpeed starts: a lock older than :data:`FRESH_S` with
no live build (no process working in that op's build folder: its compiler and ninja run there) is stale, and it
raises naming the file and the fix.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["extensions_dir", "stale_build_locks", "refuse_stale_build_locks"]

FRESH_S = 60.0
"""A lock younger than this is taken as live: a build writes its ninja file before the compiler starts."""


def extensions_dir() -> Path:
    """Where torch builds JIT extensions: ``TORCH_EXTENSIONS_DIR``, else torch's default under the cache."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("_", verbose=False)).parent


def _building_in(folder: Path) -> bool:
    """Whether a live process works in ``folder`` (``/proc/<pid>/cwd``: the compiler and ninja of a build)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: cannot tell, assume the build is live
        return True
    target = folder.resolve()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd")).resolve()
        except OSError:  # the process ended, or is not ours to read
            continue
        if cwd == target or target in cwd.parents:
            return True
    return False


def stale_build_locks(root: Path | None = None) -> list[Path]:
    """The lock files under ``root`` (default :func:`extensions_dir`) that no live build holds."""
    root = extensions_dir() if root is None else root
    if not root.is_dir():
        return []
    now = time.time()
    return [
        lock
        for lock in sorted(root.glob("*/lock"))
        if now - lock.stat().st_mtime > FRESH_S and not _building_in(lock.parent)
    ]


def refuse_stale_build_locks(root: Path | None = None) -> None:
    """``RuntimeError`` naming each stale lock and the fix, instead of DeepSpeed's silent wait on it."""
    stale = stale_build_locks(root)
    if stale:
        names = ", ".join(str(lock) for lock in stale)
        raise RuntimeError(
            f"a build of DeepSpeed's ops was killed halfway and left its lock ({names}); every start would wait on "
            f"it forever. No build is running there: remove it (rm {' '.join(str(lock) for lock in stale)}) and "
            f"start again (the op is rebuilt once, ~90 s)"
        )
