"""Hybrid and state-space models trained sequence-parallel equal the whole model: loss and every gradient.

Each family is built tiny from its config (random weights, float64, no hub; the mixers' own sizes chosen so the
layers fit together and a shard spans several of Mamba2's scan chunks), registered on 2 and 4 ranks, and run one
step on a batch unpacked and packed (documents starting inside a shard, at a shard boundary and inside a
convolution's reach of one). The reference is the whole model on one process, each document on its own. Under
ring (zigzag on 2 ranks) and Ulysses (2 ranks) / hybrid Ulysses × ring (4 ranks).

Equal means as in the zoo (:mod:`tests.zoo`): to a relative 1e-6, since these models' norms and Mamba2's torch
scan compute in float32 whatever the model's dtype.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.dist import CaseLog, assert_no_failures, run_distributed
from tests.zoo import BATCH, SEQ, _logits, _shifted, batch, relative_error, sequence_parallel, tiny_config

SSD = dict(expand=2, head_dim=16, num_heads=8, mamba_n_heads=8, mamba_d_head=16, n_groups=2, mamba_n_groups=2,
           state_size=16, mamba_d_state=16, chunk_size=8, mamba_chunk_size=8, mamba_expand=2)  # fmt: skip
"""Mamba2 mixers that fit a hidden size of 64 (8 heads × 16 = 2 × 64), with scan chunks of 8 tokens."""

DELTA = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
"""Gated delta rule layers of 4 value heads over 2 key heads (grouped), 16 channels each."""

FAMILIES: dict[str, dict[str, Any]] = {
    "lfm2": {"layer_types": ["conv", "full_attention"], "conv_L_cache": 4},
    "mamba2": SSD,
    "bamba": {**SSD, "attn_layer_indices": [1]},
    "granitemoehybrid": {**SSD, "layer_types": ["mamba", "attention"]},
    "falcon_h1": {**SSD, "mamba_d_ssm": 128},
    "mamba": {"state_size": 8, "expand": 2},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "mamba_d_state": 8},
    "minimax": {"layer_types": ["linear_attention", "full_attention"], "block_size": 8},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], **DELTA},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"], **DELTA},
    "kimi_linear": {
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "linear_num_heads": 4,
    },
}
"""Family → fields set on its tiny config (:func:`tests.zoo.tiny_config`)."""

DOCUMENTS = (0, 11, 32, 47, SEQ)
"""Packed documents: 32 and 48 are shard boundaries on 2 and 4 ranks; 47 is one token before one."""


def build(family: str) -> torch.nn.Module:
    """The tiny float64 model, seeded (the same weights on every rank), in training mode."""
    from transformers import AutoModelForCausalLM

    tiny = tiny_config(family)
    fields = {**tiny.to_dict(), **{k: v for k, v in FAMILIES[family].items() if hasattr(tiny, k)}}
    fields.pop("layer_types", None) if "layer_types" not in FAMILIES[family] else None
    config = type(tiny)(**fields)  # built again: fields derived from others follow them
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return model.double().train()


def reference(
    model: torch.nn.Module, full: dict[str, torch.Tensor], documents: tuple[int, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The whole model, each document on its own: the token-mean loss and every parameter's gradient."""
    model.zero_grad()
    logits = torch.cat(
        [
            _logits(model(input_ids=full["input_ids"][:, a:b]))
            for a, b in zip(documents[:-1], documents[1:], strict=True)
        ],
        dim=1,
    )
    labels = torch.cat(
        [_shifted(full["labels"][:, a:b]) for a, b in zip(documents[:-1], documents[1:], strict=True)], dim=1
    )
    loss = F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _cases(rank: int, world: int, families: list[str], checkpointing: bool = False) -> list[str]:
    """Every family × strategy × packed or not, on this rank: the failures. ``checkpointing``: with activation
    checkpointing (the layers run again in the backward, outside the model's forward)."""
    import transformers

    import ds_ring

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    sections = {
        "ring": {"strategy": "ring", "layout": "zigzag" if world == 2 else "contiguous"},
        "ulysses" if world == 2 else "hybrid": {"strategy": "ulysses" if world == 2 else "hybrid", "ulysses_degree": 2},
    }
    log = CaseLog()
    for family in families:
        model = build(family)
        if checkpointing:
            model.gradient_checkpointing_enable()
        for packed in (False, True):
            full = batch()
            documents = DOCUMENTS if packed else (0, SEQ)
            if packed:
                full["position_ids"] = torch.cat(
                    [torch.arange(b - a) for a, b in zip(documents[:-1], documents[1:], strict=True)]
                )[None].expand(BATCH, SEQ)
            loss, grads = reference(model, full, documents)
            for name, section in list(sections.items())[: 1 if checkpointing else None]:
                with log.case(f"{family} {name} packed={packed} world={world}"):
                    topology = ds_ring.Topology(*ds_ring.load_config({"ring_attention": section}).degrees(world))
                    got_loss, got_grads = sequence_parallel(model, full, section, topology)
                    error = max(relative_error(got_grads, grads), abs(float(got_loss - loss)) / abs(float(loss)))
                    assert error < 1e-6, f"relative error {error:.2g}"
    return log.failures


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: CI's second step (time)
@pytest.mark.timeout(900)
def test_hybrid_models_equal_the_whole_model_sequence_parallel(world: int) -> None:
    assert_no_failures(run_distributed(_cases, world, timeout=900, families=list(FAMILIES)))


def test_activation_checkpointing_runs_the_recurrent_layers_again_alike() -> None:
    assert_no_failures(run_distributed(_cases, 2, timeout=600, families=["bamba"], checkpointing=True))


def _bytes_per_layer(rank: int, world: int, family: str, lengths: list[int]) -> dict[int, dict[str, float]]:
    """Bytes this rank receives per recurrent layer and exchange (forward and backward) at each length."""
    import transformers

    import ds_ring
    from ds_ring.hooks import register_hook
    from ds_ring.integrations.hf.recurrent import sequence_parallel_mixers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    model = build(family)
    layers = len(sequence_parallel_mixers(model))
    section = {"strategy": "ring"}
    topology = ds_ring.Topology(*ds_ring.load_config({"ring_attention": section}).degrees(world))
    measured = {}
    for length in lengths:
        ids = torch.randint(3, 128, (BATCH, length), generator=torch.Generator().manual_seed(length))
        moved: dict[str, int] = {}

        def count(event: Any, moved: dict[str, int] = moved) -> None:
            if event.op.startswith("recurrent"):
                moved[event.op] = moved.get(event.op, 0) + event.nbytes

        with register_hook(count):
            sequence_parallel(model, {"input_ids": ids, "labels": ids}, section, topology)
        measured[length] = {op: n / layers for op, n in sorted(moved.items())}
    return measured


@pytest.mark.parametrize("family, scan", [("mamba2", "recurrent_ssd"), ("qwen3_next", "recurrent_delta")])
def test_recurrent_exchange_bytes_do_not_grow_with_the_sequence(family: str, scan: str) -> None:
    measured = run_distributed(_bytes_per_layer, 2, timeout=600, family=family, lengths=[SEQ, 4 * SEQ])
    for per_rank in measured:
        short, long = per_rank.values()
        assert short == long and set(short) == {
            "recurrent_halo", "recurrent_halo_grad", scan, f"{scan}_grad"
        }, per_rank  # fmt: skip
    print(f"\nbytes received per rank per {family} layer, by exchange, at lengths {list(measured[0])}: {measured[0]}")
