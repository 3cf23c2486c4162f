"""The ``long_context`` section applied to a Hugging Face causal LM instance (its rest made O(seq/p) per rank).

:func:`check_long_context` refuses, before any communication, a model the section cannot be applied to;
:func:`apply_long_context` then patches the instance (never its class) and returns how to undo it. Both are called
by :meth:`ds_ring.integrations.hf.session.SequenceParallelSession.apply_long_context`, which :meth:`close` undoes:

* ``tiled_loss``: the model's ``forward`` runs its decoder and, when the batch carries ``shift_labels``
  (and no ``labels``), returns ``loss`` = the sequence-group mean computed tile by tile
  (:func:`ds_ring.tiles.tiled_cross_entropy_sum`) and ``logits=None``. Any other call runs the model's own
  forward (logits included).
* ``tiled_mlp``: every ``*.mlp`` (``*.feed_forward``: Bamba, Jamba and kin) runs :func:`ds_ring.tiles.tiled_gated_mlp`.
* ``offload_checkpoints``: gradient checkpointing on, with :func:`ds_ring.tiles.offloaded_checkpoint` as each
  layer's checkpointing function (set again at every forward, so a later ``gradient_checkpointing_enable``
  keeps it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ds_ring.integrations.hf.compat import (
    activation_checkpointing_disable,
    activation_checkpointing_enable,
    causal_lm_output,
    is_activation_checkpointing,
)
from ds_ring.integrations.hf.documents import IGNORE_INDEX
from ds_ring.integrations.internal import (
    SECTION,
    LongContextConfig,
    Patch,
    Topology,
    gated_mlp_parts,
    keep_attribute,
    make_store,
    offloaded_checkpoint,
    sequence_parallel_mean,
    set_attribute,
    tiled_cross_entropy_sum,
    tiled_gated_mlp,
    undo_all,
)

__all__ = ["check_long_context", "apply_long_context"]

_WHERE = f"{SECTION}.long_context"


def _causal_lm(model: Any) -> nn.Module:
    """The causal LM inside a wrapper: PEFT's ``get_base_model()``, an engine's ``module``."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    while not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def check_long_context(model: Any, section: LongContextConfig) -> None:
    """``ValueError`` naming the field and the fix when ``section`` cannot be applied to ``model``.

    Refused: no model instance given; ``tiled_loss`` on a model without a bias-free linear LM head and a
    decoder, or with final logit soft-capping; ``tiled_mlp`` on a model with no ``*.mlp`` or one that is not
    a gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``); offload on a model without gradient
    checkpointing.
    """
    if not section.enabled:
        return
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"{_WHERE} is applied to the model instance, and none was given; call "
            f"session.apply_long_context(model) with the model (or drop {_WHERE})"
        )
    lm = _causal_lm(model)
    name = type(lm).__name__
    if section.tiled_loss:
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear) or head.bias is not None or not hasattr(lm, "get_decoder"):
            raise ValueError(
                f"{_WHERE}.tiled_loss: {name} has no bias-free linear LM head over a decoder to tile; set "
                f"tiled_loss to false for this model"
            )
        config = getattr(lm, "config", None)
        softcap = getattr(config, "final_logit_softcapping", None)
        if softcap is not None:
            raise ValueError(
                f"{_WHERE}.tiled_loss: {name} caps its logits (config.final_logit_softcapping = {softcap}), which "
                f"the tiled loss does not compute; set tiled_loss to false, or final_logit_softcapping=None"
            )
        for field in ("logits_scaling", "logit_scale"):  # Granite divides its logits, Cohere multiplies them
            factor = getattr(config, field, None)
            if factor is not None and factor != 1:
                raise ValueError(
                    f"{_WHERE}.tiled_loss: {name} scales its logits (config.{field} = {factor}), which the tiled "
                    f"loss does not compute; set tiled_loss to false for this model"
                )
    if section.tiled_mlp:
        mlps = _mlps(lm)
        if not mlps:
            raise ValueError(
                f"{_WHERE}.tiled_mlp: {name} has no '*.mlp' or '*.feed_forward' modules to tile; set tiled_mlp to false"
            )
        for path, mlp in mlps:
            if gated_mlp_parts(mlp) is None:
                raise ValueError(
                    f"{_WHERE}.tiled_mlp: {path} ({type(mlp).__name__}) is not a gated MLP of gate_proj, up_proj, "
                    f"down_proj and act_fn (a mixture of experts or a fused projection cannot be tiled); set "
                    f"tiled_mlp to false for this model"
                )
    if section.offload_checkpoints != "none" and not getattr(lm, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{_WHERE}.offload_checkpoints: {name} does not support gradient checkpointing, whose kept inputs are "
            f"what is offloaded; set offload_checkpoints to 'none'"
        )


def _mlps(lm: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(path, module) for path, module in lm.named_modules() if path.endswith((".mlp", ".feed_forward"))]


def apply_long_context(
    model: nn.Module,
    section: LongContextConfig,
    topology: Topology,
    gradient_scale: Callable[[], int],
) -> Callable[[], None]:
    """Patch ``model`` (checked by :func:`check_long_context`) for ``section``; return what undoes it.

    ``gradient_scale()`` gives the factor on each rank's gradient share its engine needs (the registration's,
    as :func:`causal_lm_loss` applies it), read at every loss.
    """
    if not section.enabled:
        return lambda: None
    lm = _causal_lm(model)
    patches: list[Patch] = []
    if section.tiled_mlp:
        for _, mlp in _mlps(lm):
            tiled = functools.partial(tiled_gated_mlp, mlp, tile_tokens=section.tile_tokens)
            patches.append(set_attribute(mlp, "forward", tiled, library=LIB))
    store = make_store(section.offload_checkpoints, section.offload_dir)
    checkpointing_was_on = is_activation_checkpointing(lm)
    # the layers' own checkpointing functions, put back by undo (enabling checkpointing, and offloading, set them)
    kept = [keep_attribute(m, "_gradient_checkpointing_func", library=LIB) for m in lm.modules()
            if hasattr(m, "gradient_checkpointing")] if store is not None else []  # fmt: skip
    if store is not None and not checkpointing_was_on:
        activation_checkpointing_enable(lm)
    if section.tiled_loss or store is not None:
        checkpoint = store and offloaded_checkpoint(store, recompute=section.offload_recompute)
        forward = functools.partial(_forward, lm, lm.forward, section, topology, gradient_scale, checkpoint)
        patches.append(set_attribute(lm, "forward", forward, library=LIB))

    def undo() -> None:
        undo_all(patches)
        if store is None:
            return
        if not checkpointing_was_on:
            activation_checkpointing_disable(lm)
        undo_all(kept)
        store.close()

    return undo


LIB = "transformers"


def _forward(
    lm: nn.Module,
    original: Callable[..., Any],
    section: LongContextConfig,
    topology: Topology,
    gradient_scale: Callable[[], int],
    checkpoint: Callable[..., Any] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``lm``'s forward with the section applied (the module docstring says what changes)."""
    if checkpoint is not None:
        _offload_checkpoints(lm, checkpoint)
    shift_labels = kwargs.get("shift_labels")
    if not section.tiled_loss or shift_labels is None or kwargs.get("labels") is not None:
        return original(*args, **kwargs)
    bound = inspect.signature(original).bind(*args, **kwargs)
    inputs = {**bound.arguments}
    inputs.update(inputs.pop("kwargs", {}))
    for unused in ("labels", "shift_labels", "logits_to_keep"):
        inputs.pop(unused, None)
    outputs = lm.get_decoder()(**inputs)
    hidden = outputs.last_hidden_state
    total = tiled_cross_entropy_sum(
        hidden, lm.get_output_embeddings().weight, shift_labels, tile_tokens=section.tile_tokens
    )
    count = (shift_labels != IGNORE_INDEX).sum()
    loss = sequence_parallel_mean(total, count, topology, gradient_scale=gradient_scale())
    return causal_lm_output(loss, None, outputs)


def _offload_checkpoints(lm: nn.Module, checkpoint: Callable[..., Any]) -> None:
    """Make ``checkpoint`` every checkpointed layer's function; refuse training with checkpointing turned off."""
    layers = [m for m in lm.modules() if getattr(m, "gradient_checkpointing", False)]
    if lm.training and torch.is_grad_enabled() and not layers:
        raise ValueError(
            f"{_WHERE}.offload_checkpoints offloads what gradient checkpointing keeps, and the model's gradient "
            f"checkpointing was turned off; call model.gradient_checkpointing_enable(), or set offload_checkpoints "
            f"to 'none'"
        )
    for layer in layers:  # undone with the rest (the functions kept when the section was applied)
        if layer.__dict__.get("_gradient_checkpointing_func") is not checkpoint:
            set_attribute(layer, "_gradient_checkpointing_func", checkpoint, library=LIB)
