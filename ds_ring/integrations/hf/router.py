"""Mixture-of-experts load-balancing loss over the whole sequence group, not one shard.

transformers' MoE models (Mixtral, Qwen2-MoE, OLMoE, ...) add ``router_aux_loss_coef × load_balancing_loss`` to
the loss when ``output_router_logits`` is on: ``E · Σ_e f_e · P_e``, with ``f_e`` the share of routing choices
that went to expert ``e`` and ``P_e`` its mean router probability, both over every token of the batch (every
layer's tokens concatenated). Both are means over tokens, so a rank that computes them on its shard gets another,
nonlinear, value. :func:`router_aux_loss` sums counts and probabilities over the sequence group first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_ring.integrations.hf.session import SequenceParallelSession, require_session
from ds_ring.integrations.internal import Topology, all_reduce, sequence_group

__all__ = ["router_aux_loss", "add_router_aux_loss"]


def router_aux_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    topology: Topology,
    *,
    gradient_scale: float = 1,
) -> torch.Tensor:
    """transformers' load-balancing loss of the whole sequence, from this rank's shard of router logits.

    Args:
        router_logits: one ``[tokens, num_experts]`` (or ``[b, s/p, num_experts]``) tensor per MoE layer, this
            rank's tokens (``outputs.router_logits``).
        num_experts, top_k: the model's ``num_local_experts`` / ``num_experts`` and ``num_experts_per_tok``.
        topology: the registered topology (the sum runs over its sequence-parallel group).
        gradient_scale: as :func:`ds_ring.loss.sequence_parallel_mean`.

    Returns:
        A scalar, the same on every rank, equal to ``load_balancing_loss_func(router_logits of the whole
        model, num_experts, top_k)``; its gradient on each rank is its tokens' share (the group's gradients sum
        to the whole loss's gradient).
    """
    logits = torch.cat([layer.reshape(-1, layer.shape[-1]) for layer in router_logits], dim=0)
    weights = torch.softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
    chosen = torch.topk(weights, top_k, dim=-1).indices
    counts = torch.nn.functional.one_hot(chosen, num_experts).to(weights.dtype).sum(dim=0)  # [top_k, E]
    probabilities = weights.sum(dim=0)  # [E]
    group, timeout_s = sequence_group(topology, None)
    local = torch.cat([counts.flatten(), probabilities.detach(), weights.new_tensor([logits.shape[0]])])
    total = all_reduce(local, group=group, timeout_s=timeout_s)
    tokens = total[-1].clamp(min=1)
    share_of_choices = total[: counts.numel()].view_as(counts) / tokens
    whole = num_experts * (share_of_choices * (total[counts.numel() : -1] / tokens)).sum()
    share = num_experts * (share_of_choices * (probabilities / tokens)).sum() * gradient_scale
    return share + (whole - share).detach()


def add_router_aux_loss(session: SequenceParallelSession, loss: torch.Tensor, outputs: Any, model: Any) -> torch.Tensor:
    """``loss`` plus the model's ``router_aux_loss_coef × router_aux_loss`` when it returned router logits (what
    transformers adds to a whole model's loss when labels are given); ``loss`` unchanged otherwise. ``session``: what
    ``register_with_transformers`` returned (its topology and gradient scale, as
    :func:`~ds_ring.integrations.hf.loss.causal_lm_loss` takes them)."""
    session = require_session(session, "add_router_aux_loss")
    topology, gradient_scale = session.topology, session.gradient_scale
    router_logits = outputs.get("router_logits") if hasattr(outputs, "get") else None
    config = getattr(model, "config", None)
    if not router_logits or config is None or not getattr(config, "output_router_logits", False):
        return loss
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = next(
        getattr(config, n) for n in ("num_local_experts", "num_experts", "n_routed_experts") if hasattr(config, n)
    )
    aux = router_aux_loss(
        [r for r in router_logits if r is not None], experts, config.num_experts_per_tok, topology,
        gradient_scale=gradient_scale,
    )  # fmt: skip
    return loss + config.router_aux_loss_coef * aux.to(loss.dtype)
