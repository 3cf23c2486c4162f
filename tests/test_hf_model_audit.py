"""Modules that would mix the sequence behind ds_ring's back are refused by name, before they train.

On one process (a sequence-parallel group of 1 still registers): a Mamba model is refused at registration naming
its mixer, and let through when the user declares the class position-wise; an attention module that computes
attention in its own code is refused right after its first forward; a family with nothing but eager attention is
refused at registration; attention modules that receive no keyword arguments get the batch's positions from the
model's call.
"""

import pytest
import torch

import ds_ring
from ds_ring.integrations.hf import register_with_transformers, shard_batch
from ds_ring.integrations.hf.audit import CallAudit, refuse_sequence_mixers
from tests.dist import run_distributed


def test_a_state_space_mixer_is_refused_by_name_unless_declared_position_wise():
    from transformers import MambaConfig, MambaForCausalLM

    with torch.device("meta"):
        model = MambaForCausalLM(MambaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"MambaMixer \(at backbone.layers.0.mixer\) mixes information along"):
        refuse_sequence_mixers(model)
    refuse_sequence_mixers(model, position_wise=["MambaMixer", "Conv1d"])


def test_convolutions_over_time_are_refused_and_gpt2s_linear_conv1d_is_not():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        refuse_sequence_mixers(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32)))
    with pytest.raises(ValueError, match=r"Conv1d \(at 1\)"):
        refuse_sequence_mixers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 3)))


class OwnAttention(torch.nn.Module):
    """Computes attention itself, as Falcon's or GPT-J's modules do."""

    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_an_attention_module_that_never_calls_ds_ring_is_refused_after_its_first_forward():
    audit = CallAudit()
    try:
        with pytest.raises(ValueError, match="OwnAttention ran without calling ds_ring's attention"):
            OwnAttention()(torch.randn(1, 1, 4, 8))
    finally:
        audit.remove()
    OwnAttention()(torch.randn(1, 1, 4, 8))  # hooks gone with the audit


def _rank(rank: int, world: int) -> None:
    from transformers import BloomConfig, BloomForCausalLM, PersimmonConfig, PersimmonForCausalLM

    topology = ds_ring.Topology(1, 1, world)
    config = {"ring_attention": {"timeout_s": 60}}
    bloom = BloomForCausalLM(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="BloomForCausalLM computes attention in its own code"):
        session = register_with_transformers(bloom, config=config, topology=topology)
    torch.manual_seed(0)
    persimmon = PersimmonForCausalLM(
        PersimmonConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, attn_implementation="sdpa")
    ).double()  # fmt: skip
    input_ids = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(0))
    whole = persimmon(input_ids=input_ids).logits
    session = register_with_transformers(persimmon, config=config, topology=topology)
    try:  # Persimmon's attention receives no position_ids: the model's call gives them
        sharded = shard_batch(session, {"input_ids": input_ids})
        local = persimmon(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
    finally:
        session.close()
    torch.testing.assert_close(
        ds_ring.gather_sequence(local.detach(), topology.sequence_parallel_group), whole.detach()
    )


def test_eager_only_families_are_refused_and_attention_without_kwargs_gets_the_batch():
    run_distributed(_rank, 2, timeout=120)
