"""Convert a ZeRO checkpoint to DeepSpeed's universal format once, atomically, for a resume at another shape.

``<save_dir>/<tag>`` becomes ``<save_dir>/<tag>_universal`` (one folder per parameter: fp32 weights and
optimizer moments, whole), written by rank 0 with ``python -m deepspeed.checkpoint.ds_to_universal`` into a
temporary folder renamed when complete; a later resume at yet another shape reuses it. The other ranks wait,
bounded by :data:`CONVERSION_TIMEOUT_S`, and learn rank 0's outcome, so a failed conversion fails on every rank.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from ds_ring.comm.agree import gather_texts

__all__ = ["CONVERSION_TIMEOUT_S", "UNIVERSAL_SUFFIX", "convert_to_universal"]

UNIVERSAL_SUFFIX = "_universal"
CONVERSION_TIMEOUT_S = 3600.0
"""Bound in seconds on rank 0's conversion (and on the other ranks' wait for it): a hang guard, far above the
seconds to minutes a conversion takes (docs/elastic.md)."""
_DONE = "ds_ring_universal_done"


def convert_to_universal(save_dir: Path, tag: str, *, group: dist.ProcessGroup | None = None) -> tuple[str, float]:
    """Collective: the tag of ``tag``'s universal form under ``save_dir`` (converted now unless it exists) and the
    seconds rank 0 spent converting (0.0 when reused).

    Raises:
        RuntimeError: on every rank when the conversion failed, with the converter's last output.
    """
    universal = f"{tag}{UNIVERSAL_SUFFIX}"
    outcome = ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome = _convert(save_dir / tag, save_dir / universal)
        except OSError as err:  # reported on every rank below, not only here while the others wait
            outcome = f"{type(err).__name__}: {err}"
    if dist.is_initialized():
        outcome = gather_texts([outcome], group=group, op="convert_to_universal", timeout_s=CONVERSION_TIMEOUT_S)[0][0]
    if not outcome.startswith("ok "):
        raise RuntimeError(f"ds_ring: converting checkpoint {save_dir / tag} to the universal format failed: {outcome}")
    return universal, float(outcome.split()[1])


_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""Where a universal checkpoint's model states (step, client state) are looked for: by an engine at ZeRO 1-2, and
at ZeRO 3. ds_to_universal writes the name of the source's stage only."""


def _name_model_states_for_every_stage(folder: Path) -> None:
    """Give the model states file both names of :data:`_MODEL_STATES` (a hard link), so any stage loads it."""
    present = [name for name in _MODEL_STATES if (folder / name).exists()]
    if not present:
        raise FileNotFoundError(f"ds_to_universal wrote no model states ({' or '.join(_MODEL_STATES)}) in {folder}")
    for name in _MODEL_STATES:
        if not (folder / name).exists():
            os.link(folder / present[0], folder / name)


_OPTIMIZER_STATE = Path("zero") / "optimizer_state.pt"
_ZERO3_KEY = "optimizer_state_dict"


def _optimizer_state_for_every_stage(folder: Path) -> None:
    """Make a conversion's optimizer state loadable at every ZeRO stage 1-3, whatever the source's stage.

    The per-parameter files (``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: whole tensors) are the same
    for every source stage; DeepSpeed 0.19.8's two universal loaders differ in where they take the optimizer step
    and the global state from:

    - ZeRO 3 (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``): ``optimizer_state.pt[optimizer_state_dict]``
      (``state[0][step]``, ``param_groups``), which only a ZeRO-3 conversion writes (``KeyError:
      'optimizer_state_dict'``): added to a ZeRO 1-2 conversion, with the step every parameter's ``step.pt`` holds;
    - ZeRO 1-2 (``load_hp_checkpoint_state_from_checkpoint_dir``): ``optimizer_state.pt[ds_version]``, every
      parameter's ``step.pt`` and its tensors as ``{"param": tensor of the parameter's shape}``, which only a ZeRO 1-2
      conversion writes (a ZeRO-3 conversion writes flat bare tensors): added to a ZeRO-3 conversion, with its step
      and the shapes its model states record.

    Each loader ignores what is added for the other.
    """
    path = folder / _OPTIMIZER_STATE
    state = torch.load(path, map_location="cpu", weights_only=False)
    parameters = sorted(entry for entry in path.parent.iterdir() if (entry / "fp32.pt").exists())
    if _ZERO3_KEY in state:  # a ZeRO-3 conversion
        step = state[_ZERO3_KEY]["state"][0].get("step") if state[_ZERO3_KEY]["state"] else None
        shapes = _parameter_shapes(folder)
        for parameter in parameters:
            if step is not None and not (parameter / "step.pt").exists():
                torch.save(step, parameter / "step.pt")
            for key in _MOMENTS:
                _as_shaped_record(parameter / f"{key}.pt", shapes.get(parameter.name))
        state.setdefault("ds_version", deepspeed.__version__)
    else:
        steps = {repr(torch.load(parameter / "step.pt", map_location="cpu", weights_only=False))
                 for parameter in parameters if (parameter / "step.pt").exists()}  # fmt: skip
        if len(steps) > 1:
            raise OSError(f"the parameters of {folder} hold different optimizer steps: {sorted(steps)}")
        step = next((torch.load(parameter / "step.pt", map_location="cpu", weights_only=False)
                     for parameter in parameters if (parameter / "step.pt").exists()), 0)  # fmt: skip
        state[_ZERO3_KEY] = {"state": {0: {"step": step}}, "param_groups": state["param_groups"]}
    torch.save(state, path)


_MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")


def _parameter_shapes(folder: Path) -> dict[str, torch.Size]:
    """Parameter name → shape, from the model states a conversion copies (``param_shapes``: one dict per group)."""
    states = torch.load(folder / _MODEL_STATES[1], map_location="cpu", weights_only=False)
    return {name: shape for group in states.get("param_shapes", []) for name, shape in group.items()}


def _as_shaped_record(path: Path, shape: torch.Size | None) -> None:
    """Rewrite a bare tensor file as ``{"param": tensor}`` of ``shape``, the record the ZeRO 1-2 loader reads."""
    if not path.exists():
        return
    value = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(value, dict):
        return
    if shape is None or value.numel() != torch.Size(shape).numel():
        raise OSError(f"{path} holds {value.numel()} values; the model states record the shape {shape}")
    torch.save({"param": value.reshape(shape)}, path)


def _convert(source: Path, target: Path) -> str:
    """``"ok <seconds>"`` once ``target`` holds the universal form of ``source``, else what went wrong."""
    if (target / _DONE).exists():
        return "ok 0.0"
    temporary = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    started = time.perf_counter()
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
               "--output_folder", str(temporary), "--num_extract_workers", "1", "--num_merge_workers", "1",
               "--inject_missing_state"]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CONVERSION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"ds_to_universal still running after {CONVERSION_TIMEOUT_S:g} s"
    if done.returncode != 0:
        return f"ds_to_universal exited with code {done.returncode}: {(done.stdout + done.stderr)[-2000:]}"
    (source.parent / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's, naming the temporary folder
    _name_model_states_for_every_stage(temporary)
    _optimizer_state_for_every_stage(temporary)
    (temporary / _DONE).write_text(source.name)
    shutil.rmtree(target, ignore_errors=True)  # a half-renamed leftover of an earlier attempt
    os.replace(temporary, target)
    return f"ok {time.perf_counter() - started:.3f}"
