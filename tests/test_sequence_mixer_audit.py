"""The audit decides by what a module does, not by its name: sequence mixers ds_ring does not route are refused
before the first step, whatever they are called, and models without attention register as transformers builds them.

In one process: made-up modules with innocuous names (a cumulative sum, a causal convolution in functional code) are
found by the dependency probe and refused naming them; a position-wise module with a scary name is not; the first
forward's backstop raises ds_ring's ``ValueError`` (never torch's silenced hook warning, never a library's
``TypeError``). On 2 ranks: Mamba, Mamba2, Falcon-Mamba and xLSTM built with ``from_config`` alone (``eager``, no
attention) and registered over ``sdpa`` train equal to the whole model (float64, loss and every gradient, ring and
Ulysses; xLSTM's mLSTM state carried across shards), while Llama built ``eager`` is refused over ``sdpa``;
Falcon's own ``F.scaled_dot_product_attention`` is refused at registration, and Falcon registered by its config is
refused by ds_ring's error on its first forward.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_ring.integrations.hf.audit import CallAudit, refuse_probed
from ds_ring.integrations.hf.masks import MaskSpec
from ds_ring.integrations.hf.probe import probe_sequence_mixers
from tests.dist import CaseLog, assert_no_failures, run_distributed

HIDDEN, VOCAB = 16, 32


class Mixer2Block(nn.Module):
    """A running mean over the sequence: a cumulative sum, under a container's name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(dim=1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[:, None]


class Layer(nn.Module):
    """A causal depthwise convolution of width 3, in functional code (no ``nn.Conv1d`` to recognise)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(HIDDEN, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(F.pad(x.transpose(1, 2), (2, 0)), self.weight, groups=HIDDEN).transpose(1, 2)


class ShortConvMixer(nn.Module):
    """Position-wise (a gated linear unit per token), named like a sequence mixer."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gate(x)) * self.up(x)


class MadeUpModel(nn.Module):
    """A family transformers never saw: embedding, one block, head; its config selects ``sdpa``."""

    def __init__(self, block: nn.Module) -> None:
        from transformers import PretrainedConfig

        super().__init__()
        self.config = PretrainedConfig(vocab_size=VOCAB)
        self.config._attn_implementation = "sdpa"
        self.embed, self.block, self.head = nn.Embedding(VOCAB, HIDDEN), block, nn.Linear(HIDDEN, VOCAB)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.head(self.block(self.embed(input_ids)))


def _refusal(model: nn.Module) -> str | None:
    probe = probe_sequence_mixers(model, ["sdpa"], lambda _: False)
    assert not isinstance(probe, str), probe
    try:
        refuse_probed(probe)
    except ValueError as err:
        return str(err)
    return None


def test_made_up_sequence_mixers_are_refused_by_what_they_do_whatever_their_name():
    torch.manual_seed(0)
    assert _refusal(MadeUpModel(Mixer2Block())).startswith(
        "Mixer2Block (at block) mixes information along the sequence other than through attention"
    )
    assert _refusal(MadeUpModel(Layer())).startswith("Layer (at block) mixes information along the sequence")
    # a torch layer that mixes is reported as the class that owns it
    assert _refusal(MadeUpModel(Smoother())).startswith("Smoother (at block) mixes information along the sequence")


class Smoother(nn.Module):
    """A centred convolution over time (``nn.Conv1d``, width 3) inside a module of the family's own."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


def test_a_position_wise_module_with_a_mixers_name_is_not_refused():
    assert _refusal(MadeUpModel(ShortConvMixer())) is None


class _MaskAsTensor(nn.Module):
    """An attention module that calls ``F.scaled_dot_product_attention`` itself with the mask it was handed (as
    Falcon's does): under ds_ring that mask is a :class:`MaskSpec`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x, attn_mask=MaskSpec(causal=True, window=None))


class _BrokenAttention(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the module's own error")


def test_the_first_forward_backstop_raises_ds_rings_error_not_a_silenced_warning():
    audit = CallAudit()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match=r"uses its attention mask as a tensor \(scaled_dot_product_attent"):
                _MaskAsTensor()(torch.randn(1, 1, 4, 8))
            with pytest.raises(RuntimeError, match="the module's own error") as raised:
                _BrokenAttention()(torch.randn(1, 4))
        assert "_BrokenAttention ran without calling ds_ring's attention" in "".join(raised.value.__notes__)
        assert not [w for w in caught if "silenced" in str(w.message)]
    finally:
        audit.remove()


def _standard_build(family: str) -> torch.nn.Module:
    """The tiny float64 model as its users build it: ``from_config`` with no ``attn_implementation``."""
    from transformers import AutoModelForCausalLM

    from tests.test_hybrid_models import SSD
    from tests.zoo import tiny_config

    tiny = tiny_config(family)
    if family == "mamba2":  # mixer sizes that fit hidden 64 (the zoo's defaults do not build)
        tiny = type(tiny)(**{**tiny.to_dict(), **{k: v for k, v in SSD.items() if hasattr(tiny, k)}})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny).double().train()


def _xlstm() -> torch.nn.Module:
    """Tiny xLSTM (embedding 64, 4 heads, 2 blocks, chunks of 16), float64."""
    from transformers import AutoModelForCausalLM, xLSTMConfig

    config = xLSTMConfig(
        vocab_size=128, hidden_size=64, embedding_dim=64, num_hidden_layers=2, num_blocks=2, num_heads=4,
        chunk_size=16, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().train()


def _falcon() -> torch.nn.Module:
    """Tiny Falcon, new decoder architecture, 2 K/V heads, built with ``sdpa`` (which it calls itself)."""
    from transformers import AutoModelForCausalLM, FalconConfig

    config = FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().train()


def _cases(rank: int, world: int) -> list[str]:
    import transformers

    import ds_ring
    from ds_ring.integrations.hf import register_with_transformers, shard_batch
    from tests.zoo import STRATEGIES, batch, build, reference, relative_error, sequence_parallel

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    log = CaseLog()
    topologies = {
        name: ds_ring.Topology(*ds_ring.load_config({"ring_attention": section}).degrees(world))
        for name, section in STRATEGIES.items()
    }
    ring = {"ring_attention": {"timeout_s": 60}}
    for family in ("mamba", "mamba2", "falcon_mamba", "xlstm"):
        model = _xlstm() if family == "xlstm" else _standard_build(family)
        full = batch()
        loss, grads = reference(model, full)
        for name, section in STRATEGIES.items():
            with log.case(f"{family} built by from_config, {name}"):
                assert model.config._attn_implementation == "eager"
                got_loss, got_grads = sequence_parallel(model, full, section, topologies[name])
                error = max(relative_error(got_grads, grads), abs(float(got_loss - loss)) / abs(float(loss)))
                assert error < 1e-6, f"relative error {error:.2g}"
    eager = r"does not match the model's config._attn_implementation 'eager'"
    with log.case("a model with attention, built eager, is refused over sdpa"), pytest.raises(ValueError, match=eager):
        register_with_transformers(build("llama"), config=ring, topology=topologies["ring"])
    falcon = _falcon()
    own = r"FalconAttention \(at transformer.h.0.self_attention\) computes attention in its own code"
    with (
        log.case("Falcon's own F.scaled_dot_product_attention: refused at registration"),
        pytest.raises(ValueError, match=own),
    ):
        register_with_transformers(falcon, config=ring, topology=topologies["ring"])
    with log.case("Falcon registered by its config: ds_ring's error on the first forward"):
        session = register_with_transformers(falcon.config, config=ring, topology=topologies["ring"])
        try:
            sharded = shard_batch(session, batch())
            with pytest.raises(ValueError, match="uses its attention mask as a tensor") as raised:
                falcon(**{k: v for k, v in sharded.items() if k not in ("shift_labels", "labels")})
            assert "FalconAttention ran without calling ds_ring's attention" in "".join(raised.value.__notes__)
        finally:
            session.close()
    cumsum = r"Mixer2Block \(at block\) mixes information along the sequence"
    with (
        log.case("a made-up family's cumulative sum: refused at registration"),
        pytest.raises(ValueError, match=cumsum),
    ):
        register_with_transformers(MadeUpModel(Mixer2Block()), config=ring, topology=topologies["ring"])
    with log.case("a made-up position-wise module named like a mixer registers"):
        register_with_transformers(MadeUpModel(ShortConvMixer()), config=ring, topology=topologies["ring"]).close()
    return log.failures


@pytest.mark.timeout(600)
def test_models_register_by_what_their_modules_do():
    assert_no_failures(run_distributed(_cases, 2, timeout=600))
