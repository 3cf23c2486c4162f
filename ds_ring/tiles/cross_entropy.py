"""Cross-entropy through an LM head, tile by tile: the ``[tokens, vocab]`` logits are never held.

One pass computes each tile's logits once, its token losses, and (when a gradient is wanted) the
gradients of the hidden states and the head's weight: ``softmax - one_hot`` is the logits' gradient of a
summed cross-entropy, so the backward only scales what the forward kept (``[tokens, hidden]`` and
``[vocab, hidden]``, the sizes of the inputs, in their dtype). Peak extra memory: one tile's ``[tile, vocab]``
in the accumulation dtype (fp32 for half precision; the matmuls run in the model's dtype, as its own head does).
"""

from __future__ import annotations

import torch

from ds_ring.kernels.merge import accum_dtype
from ds_ring.tiles.zero import gathered

__all__ = ["tiled_cross_entropy_sum"]


class _TiledCrossEntropySum(torch.autograd.Function):
    """``Σ_t CE(hidden_t @ weightᵀ, labels_t)`` over counted tokens; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, tile_tokens, ignore_index, want_grads):  # noqa: ANN001, ANN205
        acc = accum_dtype(hidden.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grads[0] else None
        grad_weight = torch.zeros_like(weight) if want_grads[1] else None
        for start in range(0, hidden.shape[0], tile_tokens):
            rows = hidden[start : start + tile_tokens].to(weight.dtype)
            targets = labels[start : start + tile_tokens]
            counted = targets != ignore_index
            picked = targets.masked_fill(~counted, 0).unsqueeze(1)
            # [tile, vocab] in the model's dtype, then fp32 for half precision (as the model's own head and loss)
            logits = (rows @ weight.T).to(acc)
            target_logit = logits.gather(1, picked).squeeze(1)
            peak = logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(peak).exp_()
            norm = probs.sum(dim=1, keepdim=True)
            lse = peak.squeeze(1) + norm.squeeze(1).log()
            total += ((lse - target_logit) * counted).sum()
            if grad_hidden is None and grad_weight is None:
                del logits, probs
                continue
            dlogits = probs.div_(norm)  # softmax - one_hot, zero for tokens not counted
            dlogits.scatter_add_(1, picked, -counted.to(acc).unsqueeze(1))
            dlogits = dlogits.mul_(counted.unsqueeze(1)).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + tile_tokens] = dlogits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(dlogits.T, rows)
            del logits, probs, dlogits  # before the next tile's logits exist: one [tile, vocab] at a time
        # Not saved tensors: the backward scales them in place and hands them on (no second copy of [vocab, hidden]).
        ctx.grads = (grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: ANN001, ANN205
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_total.to(grad.dtype))
        return grad_hidden, grad_weight, None, None, None, None


def tiled_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tile_tokens: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The summed cross-entropy of ``hidden @ weightᵀ`` against ``labels``, ``tile_tokens`` rows at a time.

    Args:
        hidden: ``[..., hidden]`` final hidden states (after the model's last norm).
        weight: the LM head's ``[vocab, hidden]`` weight (a tied embedding too); ZeRO-3 partitioned: gathered
            once here, its gradient returned once.
        labels: ``[...]`` target ids; ``ignore_index`` marks tokens not counted.
        tile_tokens: rows per tile (the last may be shorter).

    Returns:
        A scalar in the accumulation dtype (fp32 for half precision, else the input's): the sum of the
        counted tokens' losses. Its gradients for ``hidden`` and ``weight`` are exact.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"shift_labels has {labels.shape[0]} tokens but the hidden states {hidden.shape[0]}; pass the "
            f"shift_labels shard_batch gives with this batch"
        )
    grad = torch.is_grad_enabled()
    want = (grad and hidden.requires_grad, grad and weight.requires_grad)
    with gathered([weight]):
        return _TiledCrossEntropySum.apply(hidden, weight, labels, tile_tokens, ignore_index, want)
