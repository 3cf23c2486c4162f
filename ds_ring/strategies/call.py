"""The arguments of one attention call other than tensors and process groups, as one object.

The two public entry points over shards (``ring_dilated_attention``, ``sequence_parallel_attention``)
keep their keyword signatures, build an :class:`AttentionCall` and hand it on; modules hold one
(:class:`ds_ring.RingDilatedAttention`) and the strategies (``ring_attention_call``,
``ulysses_attention_call``, ``hybrid_attention_call``) take one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ds_ring.kernels.dilation import validate_qkv
from ds_ring.strategies.fingerprint import agree_on_call

__all__ = ["AttentionCall", "Output"]

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What an attention call returns: the output shard, or ``(out, lse)`` with ``return_lse``."""


@dataclass(frozen=True)
class AttentionCall:
    """How to attend: everything of a call but the tensors, the groups and the strategy."""

    segment_lengths: Sequence[int] | None = None
    """LongNet segment lengths over the *global* sequence; ``None``: dense."""
    dilation_rates: Sequence[int] | None = None
    """One dilation rate per segment length; ``None``: dense."""
    causal: bool = False
    """Causal mask by global position."""
    scale: float | None = None
    """Softmax scale; ``None``: ``1/sqrt(head_dim)``."""
    communication: str = "ring"
    """How K/V move along a ring dimension: a registered exchange (``"ring"``, ``"allgather"``)."""
    layout: str = "contiguous"
    """How the sequence was sharded: ``"contiguous"`` or ``"zigzag"``."""
    head_offset: int = 0
    """Global index of local head 0 (dilation offsets use global head indices)."""
    return_lse: bool = False
    """Also return ``lse [batch, heads, seq/p]``."""
    timeout_s: float | None = None
    """Bound in seconds on every communication wait; ``None``: the topology's (sequence-parallel strategies) or
    :data:`ds_ring.comm.DEFAULT_TIMEOUT_S` (300 s, plain groups)."""
    cu_seqlens: torch.Tensor | Sequence[int] | None = None
    """Document boundaries ``[0, e1, ..., seq]`` of a packed global sequence; ``None``: one document."""

    def check(
        self,
        op: str,
        group: ProcessGroup | None | Sequence[ProcessGroup | None],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        exclude: tuple[str, ...] = (),
        **first: Any,
    ) -> None:
        """Check the shapes on this rank, then that every rank of ``group`` makes this call alike.

        Compared (:func:`~ds_ring.strategies.fingerprint.agree_on_call`): ``first`` (fields the entry
        point has beyond these, compared first), then every field but ``timeout_s`` and ``exclude``.
        ``ValueError`` on this rank for bad shapes, on every rank for calls that differ.
        """
        validate_qkv(q, k, v, self.head_offset)
        skip = {"timeout_s", *exclude, *first}
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        agree_on_call(op, group, q, k, v, timeout_s=self.timeout_s, **first, **options)
