"""Tiny Hugging Face models, batches and whole-model references for the ``test_hf_*`` tests.

Models are built from configs with random weights (nothing downloads): a Llama with GQA (8 heads,
4 K/V heads) and a Qwen2 (8 heads, 2 K/V heads, q/k/v biases), hidden 64, 2 layers, float64.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ds_ring
from ds_ring.integrations.hf import SequenceParallelSession, causal_lm_loss, shard_batch

VOCAB, SEQ, BATCH = 64, 32, 2
DILATED = {"segment_lengths": [8, SEQ], "dilation_rates": [1, 2]}
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    max_position_embeddings=4 * SEQ, attn_implementation="sdpa", use_cache=False,
)  # fmt: skip
REFERENCE_DILATED = "ds_ring_dilated_reference"
"""Registered name of the whole-sequence dilated attention the dilated cases are compared with."""


def llama(dtype: torch.dtype = torch.float64, **overrides: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**_SIZES, "num_key_value_heads": 4, **overrides})
    return LlamaForCausalLM(config).to(dtype)


def qwen2(dtype: torch.dtype = torch.float64, **overrides: Any) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{**_SIZES, "num_key_value_heads": 2, **overrides})
    return Qwen2ForCausalLM(config).to(dtype)


MODELS: dict[str, Callable[..., torch.nn.Module]] = {"llama": llama, "qwen2": qwen2}


def launcher_env(rank: int, world: int) -> None:
    """The variables a launcher sets, which DeepSpeed's and ALST's entry points read."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")


def run_on_saved_llama(rank_fn: Callable[..., list[str]], timeout: float) -> None:
    """``rank_fn(rank, world, model_dir)`` on 2 ranks, a tiny fp32 :func:`llama` saved in ``model_dir`` (loaded by
    path, as ALST's tests load a hub model); fails with the ranks' failed cases."""
    from tests.dist import assert_no_failures, run_distributed

    with tempfile.TemporaryDirectory() as model_dir:
        llama(torch.float32).save_pretrained(model_dir)
        assert_no_failures(run_distributed(rank_fn, 2, timeout=timeout, model_dir=model_dir))


def ds_config(**section: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": BATCH, "ring_attention": {"timeout_s": 30, **section}}


def full_batch(seq: int = SEQ, seed: int = 1) -> dict[str, torch.Tensor]:
    """``input_ids [BATCH, seq]`` and labels with a few ignored tokens."""
    input_ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))
    labels = input_ids.clone()
    labels[0, :3] = -100
    return {"input_ids": input_ids, "labels": labels}


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of the training comparisons: SGD with momentum, a step large enough to show any difference."""
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def one_process_parameters(batch: dict[str, torch.Tensor], steps: int) -> list[torch.Tensor]:
    """The whole fp32 :func:`llama` after ``steps`` :func:`sgd` steps on ``batch`` in one process."""
    model = llama(torch.float32)
    optimizer = sgd(model)
    labels = shifted(batch["labels"])
    for _ in range(steps):
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def register_reference_dilated() -> None:
    """Register ``ds_ring.dilated_attention`` (whole sequence, DILATED branches) as an HF attention."""
    from transformers.modeling_utils import AttentionInterface

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = ds_ring.dilated_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            DILATED["segment_lengths"], DILATED["dilation_rates"], causal=True, scale=scaling,
        )  # fmt: skip
        return out, None

    AttentionInterface.register(REFERENCE_DILATED, attend)


@dataclass
class Result:
    """Logits ``[b, S, vocab]`` of the whole sequence, the loss, and every parameter's gradient."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def whole_model(model: torch.nn.Module, batch: dict[str, torch.Tensor], attention: str = "sdpa") -> Result:
    """The unsharded model: HF's own loss, and gradients of the float64 token mean."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        model.zero_grad()
        out = model(input_ids=batch["input_ids"], labels=batch["labels"])
        logits = out.logits
        loss = F.cross_entropy(logits.flatten(0, 1), shifted(batch["labels"]).flatten(), ignore_index=-100)
        loss.backward()
    finally:
        model.set_attn_implementation(previous)
    return Result(logits.detach(), out.loss.detach(), _grads(model))


def documents_alone(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], bounds: Sequence[int], attention: str = "sdpa"
) -> Result:
    """Every packed document through the unsharded model on its own; loss = mean over all counted tokens."""
    model.set_attn_implementation(attention)
    try:
        model.zero_grad()
        logits, total, count = [], 0.0, 0
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            piece = model(input_ids=batch["input_ids"][:, start:stop]).logits
            labels = shifted(batch["labels"][:, start:stop])
            total = total + F.cross_entropy(piece.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            count += int((labels != -100).sum())
            logits.append(piece.detach())
        loss = total / count
        loss.backward()
    finally:
        model.set_attn_implementation("sdpa")
    return Result(torch.cat(logits, dim=1), loss.detach(), _grads(model))


def sequence_parallel(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], session: SequenceParallelSession
) -> Result:
    """The model registered by ``session`` on this rank's shard: gathered logits, the loss, gradients summed over the
    group."""
    sharded = shard_batch(session, batch)
    model.zero_grad()
    logits = model(**{k: v for k, v in sharded.items() if k != "shift_labels"}).logits
    loss = causal_lm_loss(session, logits, sharded["shift_labels"])
    loss.backward()
    group, layout = session.topology.sequence_parallel_group, session.section.layout
    grads = _grads(model)
    flat = torch.cat([g.flatten() for g in grads.values()])
    dist.all_reduce(flat, group=group)
    summed = dict(zip(grads, flat.split([g.numel() for g in grads.values()]), strict=True))
    summed = {name: part.view_as(grads[name]) for name, part in summed.items()}
    gathered = ds_ring.gather_sequence(logits.detach(), group, layout=layout)
    return Result(gathered, loss.detach(), summed)


def assert_same(got: Result, expected: Result, *, rtol: float = 1e-7, atol: float = 1e-9, loss_rtol: float = 1e-6):
    """Logits and gradients to float64 precision; the loss to HF's (its loss is computed in float32)."""
    torch.testing.assert_close(got.logits, expected.logits, rtol=rtol, atol=atol, msg=lambda m: f"logits: {m}")
    torch.testing.assert_close(got.loss.double(), expected.loss.double(), rtol=loss_rtol, atol=0.0)
    for name, grad in expected.grads.items():
        torch.testing.assert_close(got.grads[name], grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


STRATEGIES = {"ring": {"strategy": "ring"}, "ring zigzag": {"strategy": "ring", "layout": "zigzag"},
              "ulysses": {"strategy": "ulysses"}}  # fmt: skip
"""The ``ring_attention`` sections a model's features are checked under on every world size."""


def strategies_for(world: int) -> dict[str, dict[str, Any]]:
    """:data:`STRATEGIES`, and on 4 ranks the 2×2 hybrid too."""
    hybrid = {"hybrid 2x2": {"strategy": "hybrid", "ulysses_degree": 2, "ring_degree": 2}}
    return {**STRATEGIES, **(hybrid if world == 4 else {})}


def topology_for(section: dict[str, Any], world: int, cache: dict[tuple[int, ...], ds_ring.Topology]):
    """The topology of ``section`` at ``world`` ranks, one per set of degrees (every rank in the same order)."""
    degrees = ds_ring.load_config(ds_config(**section)).degrees(world)
    if degrees not in cache:
        cache[degrees] = ds_ring.Topology(*degrees)
    return cache[degrees]
