"""One place for patches (``ds_ring/engine/patches.py``): every change ds_ring makes to a transformers, DeepSpeed or
accelerate object goes through it, is undone, is refused on a release outside the ones it was written for, and has a
check here that fails when the library changes what it replaces."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_ring.engine import patches

PACKAGE = Path(__file__).resolve().parent.parent / "ds_ring"

PATCHED_ATTRIBUTES = frozenset(
    {"forward", "step", "destroy", "initialize", "prepare_data_loader", "_allgather_params_coalesced",
     "_gradient_checkpointing_func", "ring_monitor", "preemption", "ds_ring_attachments", "_ds_ring_named"}
)  # fmt: skip
"""Attributes of a library's objects ds_ring replaces or adds (an assignment to one of these off ``self`` counts)."""
REGISTRIES = frozenset(
    {"ALL_ATTENTION_FUNCTIONS", "ALL_MASK_ATTENTION_FUNCTIONS", "LOSS_MAPPING", "_local_mapping", "_global_mapping"}
)
"""transformers' tables whose entries ds_ring replaces."""
OWN = frozenset({"self", "cls", "param", "attachments", "call"})  # ds_ring's own objects, its marks on torch parameters


def _names(node: ast.expr) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)
    }


def _raw_change(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
        return bool(node.args) and not (isinstance(node.args[0], ast.Name) and node.args[0].id in OWN)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "update"):
        root = node.func.value
        while isinstance(root, ast.Attribute | ast.Subscript):
            root = root.value
        own = isinstance(root, ast.Name) and root.id in OWN
        return not own and bool(_names(node.func.value) & (REGISTRIES | {"__dict__"}))
    if not isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
        return False
    for target in node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]:
        owner = target.value if isinstance(target, ast.Attribute | ast.Subscript) else None
        if owner is None or (isinstance(owner, ast.Name) and owner.id in OWN):
            continue
        if isinstance(target, ast.Attribute) and target.attr in PATCHED_ATTRIBUTES:
            return True
        if isinstance(target, ast.Subscript) and _names(owner) & (REGISTRIES | {"__dict__"}):
            return True
    return False


def patches_in(source: str) -> list[str]:
    """The raw changes of a library's object in ``source`` (what only ``ds_ring/engine/patches.py`` may do):
    ``setattr`` / ``delattr`` on anything but ``self``, ``cls`` or a parameter mark; an assignment or ``del`` of a
    :data:`PATCHED_ATTRIBUTES` attribute off ``self``; a write into ``__dict__`` or into one of :data:`REGISTRIES`."""
    return [f"{node.lineno}: {ast.unparse(node)[:60]}" for node in ast.walk(ast.parse(source)) if _raw_change(node)]


def patching_files(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Per file of ``package``, its raw changes of a library's objects (:func:`patches_in`)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        if changes := patches_in(path.read_text()):
            found[str(path.relative_to(package.parent))] = changes
    return found


def test_only_the_patches_module_changes_library_objects() -> None:
    found = patching_files()
    assert list(found) == ["ds_ring/engine/patches.py"], found


def test_the_counter_sees_each_kind_of_patch() -> None:
    source = """
def f(engine, model, deepspeed, interface, self):
    setattr(model, "x", 1)
    engine.destroy = None
    del model.forward
    deepspeed.initialize = None
    interface._local_mapping["sdpa"] = None
    model.__dict__.pop("forward", None)
    self.forward = None
    setattr(self, "x", 1)
    engine.other = 1
"""
    assert len(patches_in(source)) == 6


class _Class:
    def method(self) -> str:
        return "class"


def test_attribute_patches_put_back_what_was_there() -> None:
    instance, module = _Class(), SimpleNamespace(function=len)
    hidden = patches.set_attribute(instance, "method", lambda: "patched", library="deepspeed")
    replaced = patches.set_attribute(module, "function", max, library="deepspeed")
    added = patches.set_attribute(module, "new", 1, library="deepspeed")
    assert instance.method() == "patched" and module.function is max and module.new == 1
    patches.undo_all([hidden, replaced, added])
    assert "method" not in vars(instance) and instance.method() == "class"
    assert module.function is len and not hasattr(module, "new")
    hidden.undo()  # twice: nothing more
    assert instance.method() == "class"


def test_item_and_kept_patches_put_back_what_was_there() -> None:
    table, holder = {"a": 1}, SimpleNamespace(f=1)
    changed = patches.set_item(table, "a", 2, library="transformers")
    added = patches.set_item(table, "b", 3, library="transformers")
    kept = patches.keep_attribute(holder, "f", library="transformers")
    holder.f, holder.g = 5, 6  # what a library call made on ds_ring's behalf would change
    patches.undo_all([changed, added, kept])
    assert table == {"a": 1} and holder.f == 1


def test_a_release_outside_the_supported_ones_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    patches.check_library.cache_clear()
    monkeypatch.setitem(patches.SUPPORTED, "deepspeed", "<0.1")
    with pytest.raises(ValueError, match=r"written for deepspeed<0.1, but .* is installed"):
        patches.set_attribute(SimpleNamespace(), "x", 1, library="deepspeed")
    with pytest.raises(ValueError, match="ds_ring patches only"):
        patches.check_library("numpy")
    patches.check_library.cache_clear()


def _parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)


# Per patch: what it replaces or calls still exists with the signature the replacement uses.


def test_deepspeed_objects_patched_are_as_written_for() -> None:
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    from ds_ring.monitor.deepspeed_collectives import COLLECTIVES

    assert {"model", "optimizer", "model_parameters", "mpu", "config", "config_params"} <= set(
        _parameters(deepspeed.initialize)
    )  # the Trainer's initialize sets mpu and rewrites config / config_params
    for name in ("step", "destroy", "is_gradient_accumulation_boundary"):
        assert callable(getattr(DeepSpeedEngine, name)), name  # the fenced step, destroy and detach
    assert _parameters(Init._allgather_params_coalesced)[:4] == ["self", "param_list", "hierarchy", "quantize"]
    assert hasattr(ds_comm, "cdb")  # the backend whose collectives the monitor names
    from deepspeed.comm.torch import TorchBackend

    assert sum(callable(getattr(TorchBackend, name, None)) for name in COLLECTIVES) >= 10


def test_accelerate_objects_patched_are_as_written_for() -> None:
    from accelerate import Accelerator
    from accelerate.data_loader import prepare_data_loader

    assert _parameters(Accelerator.prepare_data_loader)[:4] == [
        "self", "data_loader", "device_placement", "slice_fn_for_dispatch"
    ]  # fmt: skip
    used = {"num_processes", "process_index", "split_batches", "put_on_device", "rng_types", "dispatch_batches",
            "even_batches", "use_seedable_sampler", "data_seed", "non_blocking", "use_stateful_dataloader"}  # fmt: skip
    assert used <= set(_parameters(prepare_data_loader))


def test_transformers_objects_patched_are_as_written_for() -> None:
    from transformers import modeling_layers
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

    for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):
        assert isinstance(registry._local_mapping, dict) and isinstance(type(registry)._global_mapping, dict)
        assert "sdpa" in registry
    assert callable(LOSS_MAPPING["ForCausalLM"])
    assert callable(PreTrainedModel.gradient_checkpointing_enable)
    # the function a checkpointed layer calls, which offloading replaces per layer
    assert "self._gradient_checkpointing_func(" in inspect.getsource(modeling_layers.GradientCheckpointingLayer)
