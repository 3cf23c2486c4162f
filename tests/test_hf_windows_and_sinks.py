"""Hugging Face models with sliding-window layers and attention sinks equal the whole model.

Tiny random-initialised float64 configs (nothing downloads): Gemma 3 text (a 5-token sliding layer and a global
one), GPT-OSS (alternating 4-token sliding and full layers, a learned sink per head passed as ``s_aux``, 4 tiny
experts; it allows no ``sdpa``, so ds_ring registers as its own ``"ds_ring"`` attention) and Mistral with a
20-token ``sliding_window`` on every layer (spanning 2 shards at 2 ranks, 3 at 4). On 2 and 4 gloo ranks with
ring, Ulysses and (4 ranks) hybrid 2 × 2: gathered logits, loss and every parameter gradient summed over the
group equal the unsharded model's (``sdpa``; GPT-OSS: ``eager``), which applies each model's own window
convention through transformers' masks.
"""

from __future__ import annotations

import pytest
import torch

from ds_ring.integrations.hf import register_with_transformers
from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.hf_cases import (
    VOCAB,
    assert_same,
    ds_config,
    full_batch,
    sequence_parallel,
    strategies_for,
    topology_for,
    whole_model,
)

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=256, use_cache=False)  # fmt: skip


def gemma3(implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        **_COMMON,
        head_dim=8,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        attn_implementation=implementation,
    )
    return Gemma3ForCausalLM(config).double()


def gpt_oss(implementation: str = "eager") -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(**_COMMON, head_dim=8, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                          experts_implementation="eager", layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          attn_implementation=implementation)  # fmt: skip
    model = GptOssForCausalLM(config).double()
    with torch.no_grad():  # random sinks (the default is 0): a sink that matters
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def mistral(implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(**_COMMON, sliding_window=20, attn_implementation=implementation)
    return MistralForCausalLM(config).double()


# model: (build, the whole model's attention, ds_ring's registry entry, tolerance). Gemma 3's RMSNorm computes in
# float32 inside the float64 model, so its norm weights' gradients, summed over tokens in another order, agree to
# float32's precision only.
MODELS = {
    "gemma3": (gemma3, "sdpa", "sdpa", dict(rtol=1e-5, atol=1e-8)),
    "gpt_oss": (gpt_oss, "eager", "ds_ring", {}),
    "mistral": (mistral, "sdpa", "sdpa", {}),
}


def _rank(rank: int, world: int) -> list[str]:
    log, topologies = CaseLog(), {}
    batch = full_batch()
    strategies = strategies_for(world)
    for name, (build, reference_implementation, implementation, tolerance) in MODELS.items():
        model = build(reference_implementation)
        expected = whole_model(model, batch, reference_implementation)
        for strategy, section in strategies.items():
            with log.case(f"{name}, {strategy}"):
                topology = topology_for(section, world, topologies)
                session = register_with_transformers(
                    core_attn_implementation=implementation, config=ds_config(**section), topology=topology
                )
                try:
                    model.set_attn_implementation(implementation)
                    got = sequence_parallel(model, batch, session)
                finally:
                    model.set_attn_implementation(reference_implementation)
                    session.close()
                assert_same(got, expected, **tolerance)
    return log.failures


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_windowed_and_sink_models_match_the_whole_model(world):
    assert_no_failures(run_distributed(_rank, world, timeout=260))
