"""A lock left by a killed build of DeepSpeed's JIT ops, found at start-up, named and removed, never waited on.

DeepSpeed compiles small CPU ops on first use (``deepspeed_shm_comm``, ~90 s) through
``torch.utils.cpp_extension.load``, which holds ``<TORCH_EXTENSIONS_DIR>/<op>/lock`` while it builds; every other
process waits until the file is gone (``FileBaton.wait``, no deadline, no message). A build killed halfway
(Ctrl-C during the main job's first run, a test's hang guard) leaves the file behind, and every later start would
wait on it for good. :func:`clear_stale_build_locks` runs before DeepSpeed starts: a lock that no live process
holds (the builder keeps the lock file open from creating it to removing it; its ninja and compiler work in the
op's build folder) is stale: removed with a warning naming it, and the op is rebuilt once (ninja redoes only what
the killed build did not finish).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["extensions_dir", "stale_build_locks", "clear_stale_build_locks"]

_log = logging.getLogger(__name__)


def extensions_dir() -> Path:
    """Where torch builds JIT extensions: ``TORCH_EXTENSIONS_DIR``, else torch's default under the cache."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("_", verbose=False)).parent


def _held(lock: Path) -> bool:
    """Whether a live process holds ``lock`` open (its builder) or works in its folder (ninja, the compiler)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: cannot tell, assume the build is live
        return True
    lock, folder = lock.resolve(), lock.parent.resolve()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            if cwd == folder or folder in cwd.parents:
                return True
            if any(os.readlink(fd) == str(lock) for fd in (entry / "fd").iterdir()):
                return True
        except OSError:  # the process ended, or is not ours to read
            continue
    return False


def stale_build_locks(root: Path | None = None) -> list[Path]:
    """The lock files under ``root`` (default :func:`extensions_dir`) that no live build holds."""
    root = extensions_dir() if root is None else root
    return [lock for lock in sorted(root.glob("*/lock")) if not _held(lock)] if root.is_dir() else []


def clear_stale_build_locks(root: Path | None = None) -> list[Path]:
    """Remove each stale lock under ``root`` (default :func:`extensions_dir`), warning with its name and why;
    returns those removed."""
    removed: list[Path] = []
    for lock in stale_build_locks(root):
        try:
            lock.unlink()
        except FileNotFoundError:  # its build finished meanwhile
            continue
        removed.append(lock)
        _log.warning(
            "ds_ring: removed %s: a build of DeepSpeed's ops was killed halfway and left it (no process holds it; "
            "every start would wait on it forever). The op is rebuilt once (~90 s).",
            lock,
        )
    return removed
