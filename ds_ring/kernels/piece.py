"""How one *piece* of attention is computed: one query run over one key run, in token layout.

Every layer that computes a piece (:func:`~ds_ring.kernels.dilated.attend_into` and
:func:`~ds_ring.kernels.dilated.attend_backward`, the band kernels of :mod:`ds_ring.kernels.window`) takes its
options as one :class:`Piece`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

__all__ = ["Grads", "Piece"]

Grads = tuple[Tensor, Tensor, Tensor]
"""``(dq, dk, dv)`` of one piece, shaped like ``q``, ``k``, ``v``."""


@dataclass(frozen=True)
class Piece:
    """The options of one piece's kernel call.

    causal: the diagonal block (``m == n`` rows, same first position); otherwise unmasked (ignored with
        ``window``, which is causal).
    scale: softmax scale (``None``: ``1/sqrt(head_dim)``).
    softcap: scores ``s`` capped to ``softcap·tanh(s / softcap)`` (``None``: uncapped).
    window: a causal sliding window in rows (``None``: none); ``d``: how many positions the queries are ahead
        of the keys (with ``window``).
    """

    causal: bool = False
    scale: float | None = None
    softcap: float | None = None
    window: int | None = None
    d: int = 0
