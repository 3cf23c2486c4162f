"""A heterogeneous config (transformers' ``per_layer_config``) has its attention heads checked layer by layer.

Gemma 4's global layers with ``attention_k_eq_v`` take their own K/V heads (``num_global_key_value_heads``), and the
config refuses to give a global ``num_key_value_heads``: registration read it and crashed with transformers'
``AmbiguousGlobalPerLayerAttributeError``. Each layer's heads are checked instead, a refusal naming the layer.
"""

from __future__ import annotations

import pytest
import transformers

import ds_ring
from ds_ring.integrations.hf.registration import check_model_config

pytestmark = pytest.mark.skipif(
    not hasattr(transformers, "Gemma4TextConfig"), reason="this transformers has no Gemma 4 (per-layer configs)"
)


def _gemma4(global_kv_heads: int):  # noqa: ANN202 - a transformers config
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, attention_k_eq_v=True,
        num_global_key_value_heads=global_kv_heads, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
    )  # fmt: skip


def test_each_layers_heads_are_checked():
    ring = ds_ring.load_config({"ring_attention": {"strategy": "ring"}})
    ulysses = ds_ring.load_config({"ring_attention": {"strategy": "ulysses", "ulysses_degree": 2}})
    config = _gemma4(1)
    assert config.is_heterogeneous
    for section in (ring, ulysses):
        check_model_config(config, section, 2)
    with pytest.raises(ValueError, match=r"Gemma4TextConfig\.per_layer_config\[1\]\.num_attention_heads = 4: .*3"):
        check_model_config(_gemma4(3), ring, 2)
