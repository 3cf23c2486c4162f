"""A lock left by a killed build of DeepSpeed's ops is found and named; a live build's lock is left alone."""

import os
import subprocess
import time

import pytest

from ds_ring.build_locks import FRESH_S, refuse_stale_build_locks, stale_build_locks


def _lock(root, name: str, age_s: float):
    folder = root / name
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    old = time.time() - age_s
    os.utime(lock, (old, old))
    return lock


def test_a_killed_builds_lock_is_named_with_its_fix(tmp_path):
    lock = _lock(tmp_path, "deepspeed_shm_comm", FRESH_S + 60)
    assert stale_build_locks(tmp_path) == [lock]
    with pytest.raises(RuntimeError, match=rf"left its lock \({lock}\).*rm {lock}"):
        refuse_stale_build_locks(tmp_path)


def test_a_fresh_lock_or_a_live_build_is_not_stale(tmp_path):
    _lock(tmp_path, "fresh", 1.0)
    old = _lock(tmp_path, "building", FRESH_S + 60)
    compiler = subprocess.Popen(["sleep", "30"], cwd=old.parent)  # a compiler at work in the build folder
    try:
        assert stale_build_locks(tmp_path) == []
    finally:
        compiler.kill()
        compiler.wait()
    assert stale_build_locks(tmp_path) == [old]
