"""The loss of a sequence-parallel causal LM, under ds_ring's gradient contract."""

from __future__ import annotations

import torch

from ds_ring.integrations.hf.registration import registration_for
from ds_ring.loss import sequence_parallel_cross_entropy
from ds_ring.topology import Topology

__all__ = ["causal_lm_loss"]


def causal_lm_loss(logits: torch.Tensor, shift_labels: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Mean cross-entropy over every counted token of the whole sequence group.

    Args:
        logits: this rank's ``[b, S/p, vocab]`` (computed in fp32; fp64 stays fp64).
        shift_labels: this rank's ``[b, S/p]`` from :func:`shard_batch` (-100: not counted).
        topology: the registered topology.

    Returns:
        A scalar, the same on every rank, equal to ``model(input_ids, labels=labels).loss`` of the
        whole model on the full batch. Its gradient on each rank is that rank's tokens' share: the
        sum over the sequence group is the whole model's gradient (no division by the group size),
        which is what the engine's reduction gives at ZeRO 0-2 and under ``ds_ring.initialize``. A model
        that ``deepspeed.initialize(..., mpu=topology)`` made ZeRO-3 (DeepSpeed ALST's order) divides by every
        rank on its default reduce-scatter path; the share is then scaled by the sequence-parallel degree
        (read off the model's parameters by its attention: :mod:`ds_ring.zero`), so training is the same.
    """
    registration = registration_for(topology)
    scale = 1 if registration is None else registration.gradient_scale
    return sequence_parallel_cross_entropy(logits, shift_labels, topology, gradient_scale=scale)
