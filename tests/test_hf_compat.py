"""``ds_ring.integrations.hf.compat``: the transformers APIs that moved between 5.0 and 5.24, on the release installed.

CI runs this on the newest release and on the lowest (``launch/oldest.sh``): the output of the tiled loss keeps the
decoder's cache under the installed field name (``past_key_values`` up to 5.23, ``cache`` from 5.24: naming the other
raises ``TypeError``), and gradient checkpointing turns on and off through whichever names the model has.
"""

from __future__ import annotations

import dataclasses

import torch

from ds_ring.integrations.hf.compat import (
    activation_checkpointing_disable,
    activation_checkpointing_enable,
    causal_lm_output,
    is_activation_checkpointing,
)
from tests.hf_cases import llama


def test_causal_lm_output_keeps_the_cache_under_the_installed_name() -> None:
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

    names = {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    name = "cache" if "cache" in names else "past_key_values"
    cache, hidden, loss = object(), (torch.zeros(1, 2, 4),), torch.tensor(1.5)
    decoder = BaseModelOutputWithPast(last_hidden_state=hidden[0], hidden_states=hidden, **{name: cache})
    out = causal_lm_output(loss, None, decoder)
    assert isinstance(out, CausalLMOutputWithPast)
    assert out.loss is loss and out.logits is None and out.hidden_states is hidden and out.attentions is None
    assert getattr(out, name) is cache
    assert out.get("loss") is loss  # what SequenceParallelTrainer.compute_loss reads


def test_checkpointing_turns_on_and_off() -> None:
    model = llama(torch.float32)
    assert not is_activation_checkpointing(model)
    activation_checkpointing_enable(model)
    assert is_activation_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    activation_checkpointing_disable(model)
    assert not is_activation_checkpointing(model)
