"""``ring_attention.long_context`` on Hugging Face models = the whole model (issue 22).

Tiny float64 Llama (GQA) and Qwen2 at 2 and 4 gloo ranks: with the tiled loss (``.loss`` the group mean,
``.logits`` None), the tiled MLP, both, and both with gradient checkpointing offloaded to disk, the loss and
every parameter's gradient summed over the sequence group equal the whole model's — tiles that do not divide
a shard, packed batches with -100 labels (against every document run alone), ring, zigzag and Ulysses. Through
``ds_ring.initialize`` at ZeRO 0, 2 and 3 (fp32; both tiles and disk-offloaded checkpoints), three SGD steps give
the one-process parameters, and ZeRO 3 makes as many collectives with 7 tiles per shard as with one. Refusals
name the field and the fix, before any communication.
"""

from __future__ import annotations

import collections
import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_ring
from ds_ring.hooks import Event, register_hook
from ds_ring.integrations.hf import (
    causal_lm_loss,
    register_with_transformers,
    shard_batch,
)
from ds_ring.integrations.hf.compat import activation_checkpointing_disable, activation_checkpointing_enable
from ds_ring.integrations.hf.long_context import check_long_context
from ds_ring.tiles import offload
from ds_ring.tiles.zero import gathered
from tests.dist import CaseLog, run_distributed
from tests.hf_cases import (
    BATCH,
    MODELS,
    documents_alone,
    ds_config,
    full_batch,
    llama,
    one_process_parameters,
    sgd,
    topology_for,
    whole_model,
)

TILE = 5  # divides no shard: 2 × 16 or 2 × 8 rows per rank
VARIANTS = {
    "tiled loss": {"tiled_loss": True, "tile_tokens": TILE},
    "tiled mlp": {"tiled_mlp": True, "tile_tokens": TILE},
    "both": {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": TILE},
    "both + disk offload": {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": TILE, "offload_checkpoints": "disk"},
    "both + host offload": {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": TILE, "offload_checkpoints": "host"},
    "both + disk offload + recompute": {
        "tiled_loss": True,
        "tiled_mlp": True,
        "tile_tokens": TILE,
        "offload_checkpoints": "disk",
        "offload_recompute": True,
    },  # fmt: skip
    "both + checkpointing": {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": 64, "checkpointing": True},
}
STRATEGIES = {
    "ring": {"strategy": "ring"},
    "zigzag": {"strategy": "ring", "layout": "zigzag"},
    "ulysses": {"strategy": "ulysses"},
    "hybrid 2x2": {"strategy": "hybrid", "ulysses_degree": 2},
}
# (batch, strategy, variant): every variant once, the rest with both tiles on.
CASES_2 = [("unpacked", "ring", variant) for variant in VARIANTS] + [
    ("unpacked", "zigzag", "both"),
    ("packed", "ring", "both"),
    ("packed", "zigzag", "both + disk offload"),
]
CASES_4 = [
    ("unpacked", "ulysses", "both"),
    ("unpacked", "hybrid 2x2", "both + disk offload"),
    ("packed", "ring", "both + checkpointing"),
    ("unpacked", "ring", "both + host offload"),  # a CPU keeps them where they are
    ("packed", "ulysses", "both + disk offload + recompute"),
]
DOCUMENTS = [0, 11, 20, 32]
STEPS = 3


def _packed(batch: dict) -> dict:
    positions = torch.cat([torch.arange(b - a) for a, b in zip(DOCUMENTS[:-1], DOCUMENTS[1:], strict=True)])
    labels = batch["labels"].clone()
    labels[1, 12:15] = -100
    return {**batch, "labels": labels, "position_ids": positions.expand(batch["input_ids"].shape[0], -1)}


def _summed_grads(model: torch.nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad, group=group)
    return grads


def _check(model, batch, topology, strategy: dict, variant: dict, expected, offload_dir: str) -> None:
    variant = dict(variant)
    checkpointing = variant.pop("checkpointing", False) or variant.get("offload_checkpoints", "none") != "none"
    if variant.get("offload_checkpoints") == "disk":
        variant["offload_dir"] = offload_dir
    if checkpointing:
        activation_checkpointing_enable(model)
    model.train()
    section = {**strategy, "long_context": variant}
    session = register_with_transformers(model, config=ds_config(**section), topology=topology)
    try:
        session.apply_long_context(model)
        sharded = shard_batch(session, batch)
        model.zero_grad()
        offloads: list[Event] = []
        with register_hook(lambda event: offloads.append(event) if event.kind == "offload" else None):
            out = model(**sharded)
            if variant.get("tiled_loss"):
                assert out.logits is None, "the tiled loss returned logits"
                loss = out.loss
            else:
                loss = causal_lm_loss(session, out.logits, sharded["shift_labels"])
            loss.backward()
        if variant.get("offload_checkpoints") == "disk":
            written = sum(e.op == "disk_write" for e in offloads)
            live = written - sum(e.op == "disk_release" for e in offloads)
            layers = model.config.num_hidden_layers
            # With offload_recompute every layer's recompute writes its activations (this test's: all of them) too.
            assert written > 2 * layers if variant.get("offload_recompute") else written == layers, written
            assert live == 0, (written, live)
        grads = _summed_grads(model, topology.sequence_parallel_group)
    finally:
        session.close()
        activation_checkpointing_disable(model)
    assert "forward" not in model.__dict__, "unregister left the model patched"
    functions = [m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()]
    left = [f for f in functions if "offloaded_checkpoint" in getattr(f, "__qualname__", "")]
    assert not left, "unregister left the offloaded checkpointing on the layers"
    torch.testing.assert_close(loss.double(), expected.loss.double(), rtol=1e-12, atol=0.0)
    for name, grad in expected.grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-7, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def _reference(model, batch, packed: bool):
    """The whole model's float64 token mean and its gradients (packed: every document run alone)."""
    if packed:
        return documents_alone(model, batch, DOCUMENTS)
    result = whole_model(model, batch)
    logits = result.logits.flatten(0, 1)
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:].flatten()
    result.loss = F.cross_entropy(logits, labels, ignore_index=-100)
    return result


def _zero_config(stage: int, long_context: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        # every weight partitioned and fetched when used (none persistent, none prefetched)
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "ring_attention": {"strategy": "ring", "timeout_s": 60, "long_context": long_context},
    }


_COLLECTIVES = ("allgather_fn", "all_gather_into_tensor", "all_gather", "reduce_scatter_fn", "all_reduce")


def _train(
    batch: dict, stage: int | None, long_context: dict, collectives: collections.Counter | None = None
) -> list[torch.Tensor]:
    """Three SGD steps: the whole model in one process (``stage`` None), else through ds_ring.initialize (DeepSpeed's
    collectives counted in ``collectives``)."""
    if stage is None:
        return one_process_parameters(batch, STEPS)
    model = llama(torch.float32)
    optimizer = sgd(model)
    import deepspeed
    import deepspeed.comm

    config = _zero_config(stage, long_context)
    engine, *_ = ds_ring.initialize(model=model, config=config, optimizer=optimizer)
    session = register_with_transformers(model, config=config, topology=engine.mpu)
    session.apply_long_context(model)
    originals = {name: getattr(deepspeed.comm, name) for name in _COLLECTIVES}

    def counted(name):
        def collective(*args, **kwargs):
            collectives[name] += 1
            return originals[name](*args, **kwargs)

        return collective

    for name in _COLLECTIVES:
        setattr(deepspeed.comm, name, counted(name))
    try:
        sharded = shard_batch(session, batch)
        for _ in range(STEPS):
            out = engine(**sharded)
            assert out.logits is None
            engine.backward(out.loss)
            engine.step()
    finally:
        for name in _COLLECTIVES:
            setattr(deepspeed.comm, name, originals[name])
        session.close()
    params = list(engine.module.parameters())
    with gathered(params):
        got = [copy.deepcopy(p.detach()) for p in params]
    engine.destroy()
    return got


def _rank(rank: int, world: int, cases: list, offload_dir: str, zero_stages: list[int]) -> list[str]:
    offload.RECOMPUTE_MIN_BYTES = 0  # offload_recompute: this tiny model's activations are all written too
    log = CaseLog()
    unpacked = full_batch()
    batches = {"unpacked": unpacked, "packed": _packed(unpacked)}
    topologies: dict = {}
    for model_name, build in MODELS.items():
        model = build()
        expected = {kind: _reference(model, batch, kind == "packed") for kind, batch in batches.items()}
        for kind, strategy, variant in cases:
            section = STRATEGIES[strategy]
            with log.case(f"{model_name} {kind}, {strategy}, {variant}, {world} ranks"):
                topology = topology_for(section, world, topologies)
                _check(model, batches[kind], topology, section, VARIANTS[variant], expected[kind], offload_dir)
    if world == 2:
        with log.case("llama with tied embeddings, tiled loss, 2 ranks"):
            model = llama(tie_word_embeddings=True)
            assert model.lm_head.weight is model.model.embed_tokens.weight
            section = STRATEGIES["ring"]
            topology = topology_for(section, world, topologies)
            _check(model, unpacked, topology, section, VARIANTS["tiled loss"], _reference(model, unpacked, False), "")
    if zero_stages:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
        long_context = {"tiled_loss": True, "tiled_mlp": True, "tile_tokens": TILE}
        long_context.update(offload_checkpoints="disk", offload_dir=offload_dir)  # reentrant checkpoints under ZeRO
        reference = _train(unpacked, None, long_context)
        for stage in zero_stages:
            with log.case(f"ds_ring.initialize, ZeRO {stage}, {world} ranks"):
                collectives = collections.Counter()
                got = _train(unpacked, stage, long_context, collectives)
                for param, want in zip(got, reference, strict=True):
                    torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-6)
            if stage == 3:
                with log.case(f"ZeRO 3 gathers and reduces as often with 7 tiles per shard as with one, {world} ranks"):
                    one_tile = collections.Counter()
                    _train(unpacked, stage, {**long_context, "tile_tokens": 64}, one_tile)
                    assert collectives["allgather_fn"] > 0, collectives
                    assert collectives == one_tile, (collectives, one_tile)
    return log.failures


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: CI's second step (time)
def test_long_context_matches_the_whole_model(world, tmp_path):
    cases = CASES_2 if world == 2 else CASES_4
    stages = [0, 2, 3] if world == 2 else []
    results = run_distributed(_rank, world, timeout=200, cases=cases, offload_dir=str(tmp_path), zero_stages=stages)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"{len(failures)} failures; first:\n" + "\n".join(failures[:2])
    assert not list(Path(tmp_path).iterdir()), "offloaded checkpoints left files behind"


def test_tiled_loss_in_bf16_is_the_models_own_head_and_loss():
    """Half precision: logits in bf16 (as the model's head computes them), the loss in fp32, the gradients in bf16."""
    from ds_ring.tiles import tiled_cross_entropy_sum

    torch.manual_seed(0)
    hidden = torch.randn(300, 64).bfloat16().requires_grad_()
    weight = (torch.randn(1000, 64) / 8).bfloat16().requires_grad_()
    labels = torch.randint(0, 1000, (300,))
    labels[::7] = -100
    expected = F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")
    want = torch.autograd.grad(expected, [hidden, weight])
    got = tiled_cross_entropy_sum(hidden, weight, labels, tile_tokens=64)
    assert got.dtype == torch.float32
    grads = torch.autograd.grad(got, [hidden, weight])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0.0)
    for grad, reference in zip(grads, want, strict=True):
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad.float(), reference.float(), rtol=2e-2, atol=2e-2)


def _section(**long_context) -> dict:
    return ds_config(long_context=long_context)


REFUSED = [
    ({"tile_tokens": 0, "tiled_loss": True}, ["tile_tokens", "0", "positive"]),
    ({"offload_checkpoints": "disk"}, ["offload_dir", "missing"]),
    (
        {"offload_checkpoints": "disk", "offload_dir": "/no/such/dir"},
        ["offload_dir", "/no/such/dir", "not an existing"],
    ),
    ({"offload_checkpoints": "tape"}, ["offload_checkpoints", "tape"]),
    ({"offload_recompute": True}, ["offload_recompute", "offload_checkpoints to 'disk'"]),
    ({"tiled_los": True}, ["tiled_los", "did you mean 'tiled_loss'"]),
]


@pytest.mark.parametrize("section, words", REFUSED)
def test_bad_sections_are_refused_naming_the_field(section, words):
    with pytest.raises(ValueError) as err:
        ds_ring.load_config(_section(**section))
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_unwritable_offload_dir_is_refused():
    with pytest.raises(ValueError, match="offload_dir '/proc' is not writable"):  # not even by root
        ds_ring.load_config(_section(offload_checkpoints="disk", offload_dir="/proc"))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, attn_implementation="sdpa"))


def _granite() -> torch.nn.Module:
    """A Granite, whose head divides its logits by ``logits_scaling``."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, logits_scaling=8.0)  # fmt: skip
    return GraniteForCausalLM(config)


def test_models_that_cannot_be_tiled_are_refused_before_any_communication():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="GPT2MLP.*not a gated MLP.*tiled_mlp to false"):
        register_with_transformers(_gpt2(), config=_section(tiled_mlp=True))
    capped = llama(final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping = 30.0.*tiled_loss to false"):
        register_with_transformers(capped, config=_section(tiled_loss=True))
    with pytest.raises(ValueError, match="GraniteForCausalLM scales its logits.*logits_scaling = 8.0"):
        register_with_transformers(_granite(), config=_section(tiled_loss=True))
    with pytest.raises(ValueError, match="model instance.*session.apply_long_context\\(model\\)"):
        check_long_context(None, ds_ring.load_config(_section(tiled_loss=True)).long_context)
    assert not dist.is_initialized()
