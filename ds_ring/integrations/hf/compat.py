"""The transformers APIs that changed between the lowest release ds_ring supports (5.0) and the newest it is tested on.

One place for every such difference, each resolved by what the installed release has (never by its version number):

- gradient checkpointing: 5.0 has ``gradient_checkpointing_enable/disable`` and ``is_gradient_checkpointing``; later
  releases name it activation checkpointing (``activation_checkpointing_enable/disable``,
  ``is_activation_checkpointing``) and keep the old names as deprecated aliases;
- ``CausalLMOutputWithPast`` (and the decoder's ``BaseModelOutputWithPast``): the key/value cache field is
  ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (:func:`causal_lm_output` reads the dataclass's fields);
- the Trainer's count of input tokens: 5.0 counts them inside its training loop, later releases in
  ``Trainer._track_num_input_tokens`` (:func:`trainer_counts_tokens_in_hook`; between 5.2 and 5.8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

__all__ = [
    "activation_checkpointing_disable",
    "activation_checkpointing_enable",
    "causal_lm_output",
    "is_activation_checkpointing",
    "trainer_counts_tokens_in_hook",
]

_CACHE_FIELDS = ("cache", "past_key_values")
"""The key/value cache field of transformers' model outputs, newest name first."""


def is_activation_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` (a ``PreTrainedModel``) has gradient (activation) checkpointing on."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def activation_checkpointing_enable(model: nn.Module) -> None:
    """Turn gradient (activation) checkpointing on for ``model`` with transformers' defaults."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def activation_checkpointing_disable(model: nn.Module) -> None:
    """Turn gradient (activation) checkpointing off for ``model``."""
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()


def causal_lm_output(loss: Any, logits: Any, decoder_outputs: Any) -> Any:
    """A ``CausalLMOutputWithPast`` with ``loss`` and ``logits`` and the decoder's cache, hidden states and attentions,
    the cache under whichever field name the installed transformers uses."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    cache = next((getattr(decoder_outputs, name) for name in _CACHE_FIELDS if hasattr(decoder_outputs, name)), None)
    cache_field = {name: cache for name in _CACHE_FIELDS if name in fields}
    return CausalLMOutputWithPast(
        loss=loss, logits=logits, hidden_states=getattr(decoder_outputs, "hidden_states", None),
        attentions=getattr(decoder_outputs, "attentions", None), **cache_field,
    )  # fmt: skip


def trainer_counts_tokens_in_hook() -> bool:
    """Whether ``transformers.Trainer`` counts ``num_input_tokens_seen`` in ``_track_num_input_tokens`` (5.1 on)
    rather than inside its training loop (5.0)."""
    from transformers import Trainer

    return hasattr(Trainer, "_track_num_input_tokens")
