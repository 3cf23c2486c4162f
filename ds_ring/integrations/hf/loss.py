"""The loss of a sequence-parallel causal LM, under ds_ring's gradient contract; ALST's tutorial loss made right.

DeepSpeed's ALST tutorial computes the loss as ``model.loss_function(logits=..., labels=None,
shift_labels=..., vocab_size=...)`` on each rank's shard, all-gathers the ranks' losses with the
differentiable ``torch.distributed.nn.functional.all_gather`` and weights them by token counts. Every rank
then back-propagates the same total, and the all-gather's backward sums the ranks' gradients: each rank's
gradient is ``sp ×`` its share. ZeRO 3's reduce-scatter divides by every rank and undoes that; ZeRO 0–2
divide by the data-parallel degree only, so ALST trains with ``sp ×`` the whole model's gradient there
without a word (DeepSpeed #5248). While registered, ds_ring puts :func:`shard_loss` in transformers'
``LOSS_MAPPING["ForCausalLM"]`` (what ``loss_function`` returns): the loss's value is transformers' own, and
its gradient is scaled by ``gradient_scale / sp`` (``1 / sp`` at ZeRO 0–2 and on ZeRO 3's all-reduce path, 1
on its reduce-scatter path), so the tutorial's loop trains like the whole model at every stage.

The scaling applies to a ``loss_function`` call with ``shift_labels`` and no ``labels`` (the tutorial's; a
model computing its own loss from ``labels`` is unchanged): such a call must be the tutorial's
differentiable all-gather weighting. Any other use of a shard's loss should be :func:`causal_lm_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_ring.integrations.hf.session import SequenceParallelSession, require_session
from ds_ring.integrations.internal import sequence_parallel_cross_entropy

__all__ = ["causal_lm_loss", "shard_loss"]


def causal_lm_loss(session: SequenceParallelSession, logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every counted token of the whole sequence group.

    Args:
        session: what :func:`register_with_transformers` returned (its topology and gradient scale).
        logits: this rank's ``[b, S/p, vocab]`` (computed in fp32; fp64 stays fp64).
        shift_labels: this rank's ``[b, S/p]`` from :func:`shard_batch` (-100: not counted).

    Returns:
        A scalar, the same on every rank, equal to ``model(input_ids, labels=labels).loss`` of the
        whole model on the full batch. Its gradient on each rank is that rank's tokens' share: the
        sum over the sequence group is the whole model's gradient (no division by the group size),
        which is what the engine's reduction gives at ZeRO 0-2 and under ``ds_ring.initialize``. A model
        that ``deepspeed.initialize(..., mpu=topology)`` made ZeRO-3 (DeepSpeed ALST's order) divides by every
        rank on its default reduce-scatter path; the share is then scaled by the sequence-parallel degree
        (the session's :attr:`~ds_ring.integrations.hf.session.SequenceParallelSession.gradient_scale`, read off the
        model's parameters by its attention: :mod:`ds_ring.engine.gradient_scale`), so training is the same.

    Raises:
        TypeError: ``session`` is not a session (e.g. the Topology of older releases), naming the fix.
    """
    session = require_session(session, "causal_lm_loss")
    return sequence_parallel_cross_entropy(
        logits, shift_labels, session.topology, gradient_scale=session.gradient_scale
    )


class _ScaleGradient(torch.autograd.Function):
    """The identity, with the gradient multiplied by ``factor``."""

    @staticmethod
    def forward(ctx, value, factor):  # noqa: ANN001, ANN205
        ctx.factor = factor
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad * ctx.factor, None


def shard_loss(original: Callable[..., torch.Tensor], session: SequenceParallelSession) -> Callable:
    """transformers' causal LM loss ``original`` for ``LOSS_MAPPING``, its gradient made right for ALST's tutorial.

    Args:
        original: the entry it replaces (``ForCausalLMLoss``).
        session: the registration: its gradient scale (known once the model has run) and sequence-parallel degree.

    Returns:
        ``original``'s signature and value; called with ``shift_labels`` and ``labels=None``, the gradient is
        ``session.gradient_scale / sp`` times transformers' (the module docstring says why).
    """
    sp = session.topology.get_sequence_parallel_world_size()

    def loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int, **kwargs: Any) -> torch.Tensor:
        value = original(logits, labels, vocab_size, **kwargs)
        if labels is not None or kwargs.get("shift_labels") is None or not value.requires_grad:
            return value
        return _ScaleGradient.apply(value, session.gradient_scale / sp)

    return loss
