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

The marker also records the shape the checkpoint was written at
(:class:`ds_ring.engine.checkpoint_shape.TrainingShape`): ranks, data-parallel × sequence-parallel, ZeRO stage, global
batch. :func:`load_checkpoint` resumes at any other shape it can (:func:`ds_ring.engine.checkpoint_shape.how_to_load`):
as it is, or through DeepSpeed's universal checkpoint, converted once when first needed
(:mod:`ds_ring.engine.universal`); a shape it cannot resume at is refused before anything loads, naming both shapes. A
new global batch is logged: from then on the samples of a step differ from the ones the old shape would have drawn.

Both are collectives: the ranks agree on the tag (``ds_ring.comm.agree``), so ranks that see
different checkpoint directories fail together with each rank's view. Needs DeepSpeed's default
(synchronous) checkpoint engine.

:func:`save_rank_checkpoint` is the one save that is no collective, for a preemption that abandons the
step in flight (:mod:`ds_ring.engine.preemption`): each rank writes the files DeepSpeed's save would have it
write (DeepSpeed's per-rank writers, without its barriers and tag check), fsyncs them and records them
in its own marker :data:`RANK_PART`; a rank that then finds every rank's marker of the same run (the
preemption's token) writes :data:`COMPLETE` and ``latest`` exactly as :func:`save_checkpoint` does. Two
ranks may both find them: they write the same bytes, each through its own temporary file. A rank that
never writes its part leaves ``latest`` where it was.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_ring.comm.agree import agree
from ds_ring.engine.checkpoint_shape import TrainingShape, how_to_load
from ds_ring.engine.universal import convert_to_universal
from ds_ring.parallel.groups import control_world

__all__ = [
    "COMPLETE",
    "LATEST",
    "RANK_PART",
    "Resumed",
    "save_checkpoint",
    "save_rank_checkpoint",
    "load_checkpoint",
    "checkpoint_files",
]

logger = logging.getLogger("ds_ring.engine.checkpoint")

LATEST = "latest"
COMPLETE = "ds_ring_complete.json"
"""Written by rank 0 into a tag directory once every rank's files of it are complete."""
RANK_PART = "ds_ring_rank{rank}.json"
"""Written by :func:`save_rank_checkpoint` into the tag directory once this rank's files are complete."""


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
        marker = {"tag": tag, "shape": TrainingShape.of(engine).to_dict(), "files": files}
        _write_atomically(directory / COMPLETE, json.dumps(marker, indent=1))
        _write_atomically(save_dir / LATEST, tag)
    return directory


def save_rank_checkpoint(
    engine: Any, save_dir: str | os.PathLike, tag: str, client_state: dict | None = None, *, token: str
) -> bool:
    """This rank's part of checkpoint ``tag``, with no collective; publishes the tag once every rank's part is there.

    For a preemption mid-step (``engine.preemption``'s :class:`~ds_ring.engine.preemption.StepAbandoned`), while the
    peers may be anywhere in the step: before the optimizer update the engine's parameters and optimizer state
    are the last completed step's. ``token`` names the run (``engine.preemption.token``): parts of another
    run's save of the same tag are not counted. Nothing is written when ``latest`` already names ``tag``
    (a periodic save of the same step). Returns whether ``latest`` names ``tag`` on return.

    Raises:
        ValueError: with a decoupled (asynchronous) checkpoint engine, MoE layers or NVMe optimizer offload
            (DeepSpeed writes more there), before anything is written.
    """
    save_dir, tag = Path(save_dir), str(tag)
    if _read_latest(save_dir) == tag:
        return True
    if getattr(engine.checkpoint_engine, "is_decoupled", lambda: False)():
        raise ValueError(
            "ds_ring.save_rank_checkpoint needs DeepSpeed's default checkpoint engine: a decoupled engine is still "
            "writing when the save returns; remove the checkpoint engine setting from the ds_config"
        )
    if getattr(engine, "has_moe_layers", False) or engine.zero_nvme_offload_optimizer():
        raise ValueError(
            "ds_ring.save_rank_checkpoint writes what DeepSpeed's save writes for dense models without NVMe "
            "optimizer offload; this engine has MoE layers or zero_optimization.offload_optimizer.device 'nvme': "
            "run steps without engine.preemption.step_in_flight (the end-of-step save covers them)"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    directory = save_dir / tag
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RANK_PART.format(rank=rank)).unlink(missing_ok=True)
    written = _write_rank_files(engine, save_dir, tag, client_state or {})
    files = {path.relative_to(directory).as_posix(): path.stat().st_size for path in written}
    for name in files:
        _fsync(directory / name)
    part = {"tag": tag, "token": token, "rank": rank, "files": files}
    _write_atomically(directory / RANK_PART.format(rank=rank), json.dumps(part), writer=rank)
    return _publish_if_complete(engine, save_dir, tag, token, world)


def _write_rank_files(engine: Any, save_dir: Path, tag: str, client_state: dict) -> list[Path]:
    """What ``engine.save_checkpoint`` writes on this rank into the tag (model states where DeepSpeed writes them,
    ZeRO optimizer states), through DeepSpeed's own writers minus its barriers; the paths written."""
    written: list[Path] = []
    checkpoint_engine = engine.checkpoint_engine
    own = "save" in vars(checkpoint_engine)
    save = checkpoint_engine.save

    def recording(state_dict: dict, path: str) -> Any:
        written.append(Path(path))
        return save(state_dict, path)

    checkpoint_engine.save = recording
    module_state_dict = engine.module_state_dict
    if engine.zero_optimization_partition_weights():
        engine.module_state_dict = partial(_partitioned_state_dict, engine, module_state_dict)
    try:
        engine._create_checkpoint_file(str(save_dir), tag, False)
        engine._save_checkpoint(str(save_dir), tag, client_state=client_state)
        if engine.save_zero_checkpoint:
            engine._create_zero_checkpoint_files(str(save_dir), tag)
            engine._save_zero_checkpoint(str(save_dir), tag)
    finally:
        if own:
            checkpoint_engine.save = save
        else:
            del checkpoint_engine.save
        if "module_state_dict" in vars(engine):
            del engine.module_state_dict
    return written


def _partitioned_state_dict(engine: Any, module_state_dict: Any, *args: Any, **kwargs: Any) -> dict:
    """ZeRO 3: the module's state dict with every partitioned parameter as the empty placeholder DeepSpeed's save
    writes (its checkpoint prologue re-partitions them first: that waits on gathers in flight, which peers stopped
    mid-step never finish). Abandoned mid-forward or mid-backward, some parameters are still gathered whole; their
    values live in the optimizer states' partitions either way."""
    state = module_state_dict(*args, **kwargs)
    for name, param in engine.module.named_parameters():
        if name in state and hasattr(param, "ds_id"):
            state[name] = torch.empty(0, dtype=param.dtype, device=param.device)
    return state


def _publish_if_complete(engine: Any, save_dir: Path, tag: str, token: str, world: int) -> bool:
    """Write :data:`COMPLETE` and ``latest`` when every rank's part of ``tag`` from run ``token`` is there."""
    directory, files = save_dir / tag, {}
    for rank in range(world):
        try:
            part = json.loads((directory / RANK_PART.format(rank=rank)).read_text())
        except FileNotFoundError:
            return False
        if part["token"] != token or part["tag"] != tag:
            return False
        files.update(part["files"])
    writer = dist.get_rank()
    marker = {"tag": tag, "shape": TrainingShape.of(engine).to_dict(), "files": files}
    _write_atomically(directory / COMPLETE, json.dumps(marker, indent=1), writer=writer)
    _write_atomically(save_dir / LATEST, tag, writer=writer)
    return True


@dataclass(frozen=True)
class Resumed:
    """What :func:`load_checkpoint` resumed from.

    tag: the checkpoint's tag. client_state: what was saved with it. saved, current: the shape it was written at
    (``None`` for a checkpoint older than shape records) and the shape it was loaded at. loaded_as: ``"native"`` or
    ``"universal"``. convert_s, load_s: seconds converting (rank 0; 0.0 when not needed or reused) and loading.
    """

    tag: str
    client_state: dict
    saved: TrainingShape | None
    current: TrainingShape
    loaded_as: str
    convert_s: float
    load_s: float


def load_checkpoint(engine: Any, save_dir: str | os.PathLike) -> Resumed | None:
    """Collective: load the checkpoint ``<save_dir>/latest`` names, at this engine's shape; a :class:`Resumed`, or
    ``None`` when there is none (a fresh start).

    Raises:
        ValueError: on every rank when ranks see different checkpoints, when the tag is not complete (no marker,
            or a file missing or of another size), or when it was written at a shape this one cannot resume
            from, naming the tag, both shapes and the fix — before anything is loaded.
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
    saved, current = _saved_shape(save_dir / tag), TrainingShape.of(engine)
    loaded_as = "native" if saved is None else how_to_load(saved, current)
    source, convert_s = tag, 0.0
    if loaded_as == "universal":
        _refuse_half_precision_universal(engine, saved, current)
        source, convert_s = convert_to_universal(save_dir, tag, group=_agreement(engine)["group"])
    started = time.perf_counter()
    path, client_state = _load(engine, save_dir, source, universal=loaded_as == "universal")
    if path is None:
        raise ValueError(f"ds_ring: DeepSpeed could not load checkpoint {source!r} from {save_dir}")
    resumed = Resumed(tag, client_state or {}, saved, current, loaded_as, convert_s, time.perf_counter() - started)
    if dist.get_rank() == 0 and saved is not None and saved != current:
        _log_reshape(resumed)
    return resumed


def _load(engine: Any, save_dir: Path, tag: str, *, universal: bool) -> tuple[str | None, dict | None]:
    """``engine.load_checkpoint`` of ``tag``; with ``universal``, DeepSpeed's ``checkpoint.load_universal`` set for
    this load only (the engine reads it when loading, not when built)."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = universal
    try:
        return engine.load_checkpoint(str(save_dir), tag=tag)
    finally:
        config.load_universal_checkpoint = before


def _saved_shape(directory: Path) -> TrainingShape | None:
    recorded = json.loads((directory / COMPLETE).read_text()).get("shape")
    return TrainingShape.from_dict(recorded) if recorded else None


UNIVERSAL_HALF_PRECISION = "0.19.8"
"""The lowest DeepSpeed on which a half-precision resume through the universal checkpoint was shown to equal the
uninterrupted run (tests/test_resume_on_another_shape.py); on 0.16.0 the ZeRO 2 resume (4 -> 2 ranks, bf16 and fp16)
read its fp32 master weights back as values of ~1e-5 instead of the weights."""


def _refuse_half_precision_universal(engine: Any, saved: TrainingShape, current: TrainingShape) -> None:
    import deepspeed
    from packaging.version import Version

    half = engine.bfloat16_enabled() or engine.fp16_enabled()
    if half and Version(deepspeed.__version__.split("+")[0]) < Version(UNIVERSAL_HALF_PRECISION):
        raise ValueError(
            f"ds_ring: resuming a {'bf16' if engine.bfloat16_enabled() else 'fp16'} checkpoint written at ({saved}) "
            f"at ({current}) goes through DeepSpeed's universal checkpoint, which resumed wrong on DeepSpeed below "
            f"{UNIVERSAL_HALF_PRECISION} in ds_ring's tests (DeepSpeed {deepspeed.__version__} is installed); "
            f"install deepspeed>={UNIVERSAL_HALF_PRECISION}, or resume at the shape it was written at"
        )


def _log_reshape(resumed: Resumed) -> None:
    how = (
        f"converted to a universal checkpoint in {resumed.convert_s:.1f} s, loaded in {resumed.load_s:.1f} s"
        if resumed.loaded_as == "universal"
        else f"loaded as it is in {resumed.load_s:.1f} s"
    )
    logger.warning(
        "ds_ring: resuming checkpoint %s written at (%s) at (%s): %s", resumed.tag, resumed.saved, resumed.current, how
    )
    if resumed.saved is not None and resumed.saved.global_batch != resumed.current.global_batch:
        logger.warning(
            "ds_ring: the global batch changes from %d to %d samples per step: the data order does not continue "
            "as the checkpoint's run would have drawn it (keep train_micro_batch_size_per_gpu × data-parallel "
            "ranks × gradient_accumulation_steps = %d to continue it exactly)",
            resumed.saved.global_batch, resumed.current.global_batch, resumed.saved.global_batch,
        )  # fmt: skip


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


def _write_atomically(path: Path, text: str, writer: int | str = "") -> None:
    """Replace ``path`` by a file holding ``text``: readers see the old file or the whole new one. ``writer`` names
    the temporary file when several processes may write ``path`` at once."""
    temporary = path.with_name(f".{path.name}.tmp{writer}")
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
