"""What a block kernel is: a named forward/backward pair over one query block and one key block.

Layout: ``[batch, heads, rows, head_dim]`` (strided views are fine); ``k``/``v`` have as many heads as
``q`` (callers expand GQA heads). ``v`` may have its own head dim ``Dv`` (multi-head latent attention):
``out``/``dout`` then have ``Dv``, ``q``/``k`` keep ``D``. ``lse`` is ``[batch, heads, rows]`` in float32
(float64 for float64 inputs). ``causal`` blocks are square (``m == n``) and aligned at their first row: the
diagonal block of a ring or of a dilated segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

__all__ = ["BlockKernel", "BlockForward", "BlockBackward"]

BlockForward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
"""``(q, k, v, causal, scale[, softcap]) -> (out, lse)``: ``out`` in ``q.dtype``; ``softcap`` only for a
kernel whose :attr:`BlockKernel.softcap` is true."""
BlockBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]
"""``(dout, q, k, v, out, lse, causal, scale[, softcap]) -> (dq, dk, dv)`` given the final merged
``out``/``lse``, in the input dtypes."""


@dataclass(frozen=True)
class BlockKernel:
    """A named forward/backward pair; ``name`` is what ``DS_RING_KERNEL`` and reports use; ``softcap``: whether
    both take a trailing ``softcap`` (scores ``c·tanh(s / c)``, Gemma 2)."""

    name: str
    forward: BlockForward
    backward: BlockBackward
    softcap: bool = False
