"""Ulysses: all-to-all from sequence shards to head shards, attention on whole sequences, all-to-all back.

With ``p`` ranks of one all-to-all group each holding ``L`` rows of all ``H`` heads, one all-to-all
gives every rank all ``p·L`` rows of ``H/p`` heads: rank ``j`` gets heads ``[j·H/p, (j+1)·H/p)``,
so its dilation offsets use the *global* head indices ``head_offset + j·H/p + h``. A second
all-to-all returns the output (and the LSE) to sequence shards. The ranks' shards must be
consecutive in group-rank order (``contiguous``) or the group's ``zigzag`` shards, which are put
back in true sequence order after the exchange.

GQA: K/V heads travel with the query heads that use them. When the ``kv_heads`` cannot be split
evenly over the ranks (e.g. fewer K/V heads than ranks), the K/V heads a rank needs are
replicated for it before the exchange; their gradients are summed back by autograd.

Why not ``deepspeed.sequence.layer.DistributedAttention`` (which wraps a local attention the same
way): strategies do not import DeepSpeed (DESIGN.md §5); its ``_SeqAllToAll`` waits only on the
process-group timeout and a hang names no peer, while every wait here is bounded and names the
rank, op and peers (:func:`ds_ring.comm.all_to_all`); it rejects fewer K/V heads than ranks; it
sends q, k and v in three all-to-alls (here one packed exchange per direction); and the local
attention here needs its global head offset and, for ``zigzag``, the gathered rows reordered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_to_all
from ds_ring.comm.groups import group_rank
from ds_ring.hooks import emit_attention, hooks_active
from ds_ring.kernels.dilated import check_window_branches, dilated_attention
from ds_ring.kernels.dilation import check_softcap, make_branches
from ds_ring.parallel.order import ORDERS as LAYOUTS
from ds_ring.strategies.base import AttentionCall, Bound, Degrees, Shape, Strategy, Target

__all__ = [
    "Ulysses",
    "HeadSplit",
    "split_heads",
    "check_layout",
    "to_heads",
    "to_sequence",
    "heads_to_sequence",
    "attend_local_heads",
]


@dataclass(frozen=True)
class HeadSplit:
    """How ``heads`` query heads and their K/V heads are split over ``degree`` ranks.

    Each rank gets ``heads`` query heads and ``kv_heads`` K/V heads (local GQA keeps working:
    local query head ``i`` uses local K/V head ``i // (heads / kv_heads)``). ``kv_index`` lists the
    K/V heads sent to ranks ``0, 1, ...`` in turn (``degree · kv_heads`` entries, repeats =
    replication); ``None`` when the K/V heads split evenly and are sent as they are.
    """

    degree: int
    heads: int
    kv_heads: int
    kv_index: torch.Tensor | None


def split_heads(num_heads: int, num_kv_heads: int, degree: int, device: torch.device | str = "cpu") -> HeadSplit:
    """Split the heads over ``degree`` ranks; ``ValueError`` when the query heads do not divide.

    ``num_heads % num_kv_heads == 0`` is assumed (checked by ``validate_qkv``).
    """
    if num_heads % degree:
        raise ValueError(
            f"{num_heads} query heads cannot be split over an all-to-all of {degree} ranks (ulysses degree "
            f"{degree}): the number of heads must be a multiple of {degree}; use a ulysses degree that divides "
            f"{num_heads} and put the rest of the sequence parallelism in the ring degree"
        )
    heads = num_heads // degree
    if num_kv_heads % degree == 0:
        return HeadSplit(degree, heads, num_kv_heads // degree, None)
    per_kv = num_heads // num_kv_heads
    if per_kv % heads == 0:  # all of a rank's query heads share one K/V head: send it to each of them
        index = torch.arange(degree, device=device) * heads // per_kv
        return HeadSplit(degree, heads, 1, index)
    # A rank's query heads straddle K/V heads unevenly: give every query head its own copy.
    return HeadSplit(degree, heads, heads, torch.arange(num_heads, device=device) // per_kv)


def check_layout(layout: str, local_len: int) -> None:
    """``ValueError`` for an unknown layout, or a ``zigzag`` shard that does not split in two halves."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"layout='zigzag' splits each shard into two chunks, so the local sequence length must be even, "
            f"got {local_len}; shard the sequence with ds_ring.shard_sequence(..., layout='zigzag')"
        )


class _AllToAll(torch.autograd.Function):
    """Differentiable equal-split all-to-all along dim 0, every wait bounded (``ds_ring.comm``).

    Sending chunk ``i`` to rank ``i`` twice returns every chunk home, so the backward (the
    reverse all-to-all) is the same exchange applied to the gradient.
    """

    @staticmethod
    def forward(ctx, x, group, ops, timeout_s):
        ctx.args = (group, ops[1], timeout_s)
        return all_to_all(x, group=group, op=ops[0], timeout_s=timeout_s)

    @staticmethod
    def backward(ctx, grad):
        group, op, timeout_s = ctx.args
        return all_to_all(grad, group=group, op=op, timeout_s=timeout_s), None, None, None


def _exchange(x: torch.Tensor, group: ProcessGroup | None, op: str, timeout_s: float | None) -> torch.Tensor:
    """All-to-all of ``x [p, ...]`` over ``group`` (nothing to move for one rank)."""
    return x if x.shape[0] == 1 else _AllToAll.apply(x, group, (op, op + "_grad"), timeout_s)


def _to_rows(x: torch.Tensor, zigzag: bool) -> torch.Tensor:
    """``[p, B, L, ...]`` (chunk of each source rank) → ``[B, p·L, ...]`` in true sequence order.

    Zigzag: source ``s`` holds chunks ``c + s`` and ``c' - s`` (two halves), so the first halves in
    source order followed by the second halves in reverse source order are in order.
    """
    p, b, rows = x.shape[:3]
    if zigzag:
        halves = x.unflatten(2, (2, rows // 2))
        x = torch.cat([halves[:, :, 0], halves[:, :, 1].flip(0)])
    return x.transpose(0, 1).flatten(1, 2)


def _from_rows(x: torch.Tensor, degree: int, zigzag: bool) -> torch.Tensor:
    """Inverse of :func:`_to_rows`: ``[B, p·L, ...]`` → ``[p, B, L, ...]``."""
    x = x.unflatten(1, (2 * degree if zigzag else degree, -1)).transpose(0, 1)
    if zigzag:
        x = torch.stack([x[:degree], x[degree:].flip(0)], dim=2).flatten(2, 3)
    return x


def _by_destination(x: torch.Tensor, degree: int) -> torch.Tensor:
    """``[B, L, degree·h, D]`` → ``[degree, B, L, h, D]``: the heads for each destination rank."""
    return x.unflatten(2, (degree, -1)).permute(2, 0, 1, 3, 4)


def to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: HeadSplit,
    group: ProcessGroup | None,
    *,
    layout: str,
    timeout_s: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence shards → head shards, in one all-to-all (differentiable).

    ``q [B, L, H, D]``, ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]`` → ``q [B, p·L, H/p, D]``, ``k``
    ``[B, p·L, split.kv_heads, D]``, ``v [B, p·L, split.kv_heads, Dv]``, rows in true sequence order. Each
    destination's heads travel flattened with their head dims (``[h·D]``), so ``v``'s heads keep ``Dv``.
    """
    if split.kv_index is not None:
        k, v = k.index_select(2, split.kv_index), v.index_select(2, split.kv_index)
    heads = (split.heads, split.kv_heads, split.kv_heads)
    packed = torch.cat([_by_destination(x, split.degree).flatten(3) for x in (q, k, v)], dim=3)
    received = _exchange(packed, group, "ulysses_qkv", timeout_s)
    parts = received.split([h * x.shape[-1] for h, x in zip(heads, (q, k, v), strict=True)], dim=3)
    zigzag = layout == "zigzag"
    return tuple(_to_rows(x.unflatten(3, (h, -1)), zigzag) for x, h in zip(parts, heads, strict=True))


def to_sequence(
    x: torch.Tensor, degree: int, group: ProcessGroup | None, *, layout: str, op: str, timeout_s: float | None
) -> torch.Tensor:
    """Head shards → sequence shards (differentiable): ``[B, p·L, h, ...]`` → ``[B, L, p·h, ...]``."""
    received = _exchange(_from_rows(x, degree, layout == "zigzag"), group, op, timeout_s)
    return received.movedim(0, 2).flatten(2, 3)


def attend_local_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttentionCall,
    *,
    head_offset: int,
    strategy: str,
    documents: tuple[int, ...] | None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention over the whole sequence on this rank's heads, with attention events.

    ``q [B, S, h, D]``, ``k``/``v`` ``[B, S, hkv, D]`` after the all-to-all (rows in sequence order, so
    ``documents`` — checked ``call.cu_seqlens`` — apply as they are; ``head_offset``: this rank's
    global index of its local head 0; ``sinks [h]``: those heads' sink logits); returns ``out [B, S, h, D]``
    and ``lse [B, S, h]``.
    """
    rank, started = group_rank(None), time.perf_counter()
    if hooks_active("start"):
        emit_attention(strategy, "forward", "start", rank)
    out, lse = dilated_attention(
        q, k, v, call.segment_lengths, call.dilation_rates, causal=call.causal, scale=call.scale,
        head_offset=head_offset, return_lse=True, cu_seqlens=documents, window=call.window, sinks=sinks,
        softcap=call.softcap,
    )  # fmt: skip
    if hooks_active():
        emit_attention(strategy, "forward", "end", rank, started, out=out, lse=lse)
    return out, lse.transpose(1, 2)


class Ulysses(Strategy):
    """``strategy="ulysses"``: all-to-all over the whole sequence-parallel group (``heads % (U·R) == 0``);
    every rank attends over the whole sequence on its heads, with any branches and either layout."""

    name = "ulysses"

    def default_communication(self) -> None:
        return None

    def check(self, call: AttentionCall, shape: Shape | None, degrees: Degrees | None) -> None:
        if call.communication is not None:
            raise ValueError(
                f"strategy 'ulysses' moves heads by all-to-all and has no ring dimension, so communication "
                f"{call.communication!r} would do nothing; remove communication, or use strategy 'hybrid'"
            )
        make_branches(2**62 if shape is None else shape.rows, call.segment_lengths, call.dilation_rates)
        check_window_branches(call.window, call.causal, call.segment_lengths)
        check_softcap(call.softcap)
        if shape is None or degrees is None:
            return
        if shape.heads % degrees.sequence:
            raise ValueError(
                f"strategy 'ulysses' splits the {shape.heads} heads over the whole sequence-parallel group (ulysses "
                f"{degrees.ulysses} × ring {degrees.ring} = {degrees.sequence} ranks), so heads must be a multiple "
                f"of {degrees.sequence}; use strategy 'hybrid' (heads must be a multiple of the ulysses degree "
                f"only) or 'ring'"
            )
        check_layout(call.layout, shape.rows)

    def prepare(self, call: AttentionCall, target: Target) -> Bound:
        shape, placement, device, documents = target
        degree, group = placement.degrees.sequence, placement.sequence
        split = split_heads(shape.heads, shape.kv_heads, degree, device)
        first = placement.degrees.rank * split.heads
        offset, heads = call.head_offset + first, slice(first, first + split.heads)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None):
            qh, kh, vh = to_heads(q, k, v, split, group, layout=call.layout, timeout_s=call.timeout_s)
            local_sinks = None if sinks is None else sinks[heads]
            out, lse = attend_local_heads(
                qh, kh, vh, call, head_offset=offset, strategy=self.name, documents=documents, sinks=local_sinks
            )
            return heads_to_sequence(out, lse, split, group, call, call.timeout_s)

        return run


def heads_to_sequence(
    out: torch.Tensor,
    lse: torch.Tensor,
    split: HeadSplit,
    group: ProcessGroup | None,
    call: AttentionCall,
    timeout_s: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``out [B, p·L, h, D]`` and, with ``call.return_lse``, ``lse [B, p·L, h]`` to sequence shards
    ``[B, L, H, D]`` / ``[B, L, H]`` (``None``: the LSE stays where it is)."""
    layout = call.layout
    out = to_sequence(out, split.degree, group, layout=layout, op="ulysses_out", timeout_s=timeout_s)
    if not call.return_lse:
        return out, None
    lse = to_sequence(lse.unsqueeze(-1), split.degree, group, layout=layout, op="ulysses_lse", timeout_s=timeout_s)
    return out, lse.squeeze(-1)
