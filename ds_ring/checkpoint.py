"""Checkpoints a kill cannot corrupt: DeepSpeed's save, published only once every rank has written it.

DeepSpeed's ``engine.save_checkpoint`` has rank 0 write ``<save_dir>/latest`` as soon as *its own*
files are written, while other ranks may still be writing theirs (and it truncates ``latest``
before writing it). A rank killed mid-save (SIGKILL, the OOM killer, the watchdog's ``os._exit``)
can so leave ``latest`` naming a tag whose files are half-written or missing, and every restart
then fails to load it. Here:

- :func:`save_checkpoint` runs DeepSpeed's save without ``latest``. When it returns on rank 0 every
  rank has passed DeepSpeed's closing barrier, so every file of the tag is complete. Rank 0 then
  fsyncs them, writes :data:`COMPLETE` into the tag (file names and sizes) and only then replaces
  ``latest`` atomically (temporary file, fsync, ``os.replace``). An interrupted save leaves
  ``latest`` at the previous complete checkpoint.
- :func:`load_checkpoint` resumes from the tag ``latest`` names only when its marker is there and
  every listed file has its recorded size.

Both are collectives: the ranks agree on the tag (``ds_ring.comm.agree``), so ranks that see
different checkpoint directories fail together with each rank's view. Needs DeepSpeed's default
(synchronous) checkpoint engine.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ds_ring.comm.agree import agree
from ds_ring.topology import control_world

__all__ = ["COMPLETE", "LATEST", "save_checkpoint", "load_checkpoint", "checkpoint_files"]

LATEST = "latest"
COMPLETE = "ds_ring_complete.json"
"""Written by rank 0 into a tag directory once every rank's files of it are complete."""


def _agreement(engine: Any) -> dict[str, Any]:
    """How the ranks agree on a checkpoint: uncached, over the engine's :class:`ds_ring.Topology`'s control group
    of every rank and bounded by its timeout (an engine without one: the world, 300 s)."""
    mpu = getattr(engine, "mpu", None)
    group = mpu.control_group(None) if hasattr(mpu, "control_group") else control_world()
    return dict(group=group, timeout_s=getattr(mpu, "timeout_s", None), fix=_SAME_DIRECTORY, cache=False)


def save_checkpoint(engine: Any, save_dir: str | os.PathLike, tag: str, client_state: dict | None = None) -> Path:
    """Collective: ``engine.save_checkpoint(save_dir, tag, client_state)``, then publish ``tag`` atomically.

    ``tag`` must be new: saving over the checkpoint ``latest`` names would leave no complete one
    if the save were interrupted. Returns the tag's directory.

    Raises:
        ValueError: on every rank, before anything is written, when ranks pass different tags or see
            a different ``latest``, when ``tag`` is the one ``latest`` names, or with a decoupled
            (asynchronous) checkpoint engine.
    """
    save_dir, tag = Path(save_dir), str(tag)
    published = _read_latest(save_dir)
    agree({"tag": tag, "latest": published}, op="save_checkpoint", **_agreement(engine))
    if tag == published:
        raise ValueError(
            f"ds_ring: checkpoint tag {tag!r} is the one {save_dir / LATEST} names; saving over it would leave no "
            f"complete checkpoint if the save were interrupted; use a new tag per save (e.g. the step)"
        )
    if getattr(engine.checkpoint_engine, "is_decoupled", lambda: False)():
        raise ValueError(
            "ds_ring.save_checkpoint needs DeepSpeed's default checkpoint engine: a decoupled engine is still "
            "writing when save_checkpoint returns, so completeness cannot be published; remove the "
            "checkpoint engine setting from the ds_config"
        )
    directory = save_dir / tag
    if dist.get_rank() == 0:  # before DeepSpeed's opening barrier: no rank writes this tag yet
        (directory / COMPLETE).unlink(missing_ok=True)
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state or {}, save_latest=False)
    if dist.get_rank() == 0:
        files = checkpoint_files(directory)
        for path in files:
            _fsync(directory / path)
        _write_atomically(directory / COMPLETE, json.dumps({"tag": tag, "files": files}, indent=1))
        _write_atomically(save_dir / LATEST, tag)
    return directory


def load_checkpoint(engine: Any, save_dir: str | os.PathLike) -> tuple[str, dict] | None:
    """Collective: load the checkpoint ``<save_dir>/latest`` names; ``(tag, client_state)``, or
    ``None`` when there is none (a fresh start).

    Raises:
        ValueError: on every rank when ranks see different checkpoints, or when the tag is not
            complete (no marker, or a file missing or of another size), naming the tag and the fix.
    """
    save_dir = Path(save_dir)
    tag = _read_latest(save_dir)
    agree({"latest": tag}, op="load_checkpoint", **_agreement(engine))
    if tag is None:
        return None
    problem = _incomplete(save_dir / tag)
    if problem:
        raise ValueError(
            f"ds_ring: {save_dir / LATEST} names checkpoint {tag!r}, which is not complete ({problem}); it was "
            f"not published by ds_ring.save_checkpoint. Point {LATEST} at a complete checkpoint (one holding "
            f"{COMPLETE}) or remove it to start afresh"
        )
    path, client_state = engine.load_checkpoint(str(save_dir), tag=tag)
    if path is None:
        raise ValueError(f"ds_ring: DeepSpeed could not load checkpoint {tag!r} from {save_dir}")
    return tag, client_state or {}


def checkpoint_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` but the marker: relative path → size in bytes."""
    return {
        path.relative_to(directory).as_posix(): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != COMPLETE
    }


_SAME_DIRECTORY = "every rank must save to and resume from the same checkpoint directory, with the same tags"


def _read_latest(save_dir: Path) -> str | None:
    try:
        return (save_dir / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def _incomplete(directory: Path) -> str | None:
    """Why ``directory`` is not a complete checkpoint, or ``None``."""
    try:
        listed = json.loads((directory / COMPLETE).read_text())["files"]
    except FileNotFoundError:
        return f"no {COMPLETE}: the save was interrupted"
    present = checkpoint_files(directory)
    wrong = sorted(name for name, size in listed.items() if present.get(name) != size)
    return f"files missing or of another size: {wrong}" if wrong else None


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: readers see the old file or the whole new one."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
