"""A lock left by a killed build of DeepSpeed's ops is found, named and removed; a live build's lock is left alone."""

import logging
import subprocess
import sys

from ds_ring.engine.build_locks import clear_stale_build_locks, stale_build_locks


def _lock(root, name: str):
    folder = root / name
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    return lock


def test_a_killed_builds_lock_is_removed_with_a_warning_naming_it(tmp_path, caplog):
    lock = _lock(tmp_path, "deepspeed_shm_comm")
    assert stale_build_locks(tmp_path) == [lock]
    with caplog.at_level(logging.WARNING, logger="ds_ring.engine.build_locks"):
        assert clear_stale_build_locks(tmp_path) == [lock]
    assert not lock.exists()
    assert f"removed {lock}: a build of DeepSpeed's ops was killed halfway" in caplog.text
    assert clear_stale_build_locks(tmp_path) == []


def test_a_lock_held_open_or_a_compiler_at_work_is_live(tmp_path):
    held = _lock(tmp_path, "held")
    building = _lock(tmp_path, "building")
    holder = subprocess.Popen(  # the builder: FileBaton keeps the lock open from creating it to removing it
        [sys.executable, "-c", f"import os, sys, time; fd = os.open({str(held)!r}, os.O_RDONLY); print(); "
                               "sys.stdout.flush(); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    compiler = subprocess.Popen(["sleep", "60"], cwd=building.parent)  # ninja / the compiler in the build folder
    try:
        holder.stdout.readline()  # the lock is open
        assert stale_build_locks(tmp_path) == []
        assert clear_stale_build_locks(tmp_path) == []
        assert held.exists() and building.exists()
    finally:
        for proc in (holder, compiler):
            proc.kill()
            proc.wait()
    assert stale_build_locks(tmp_path) == [building, held]
