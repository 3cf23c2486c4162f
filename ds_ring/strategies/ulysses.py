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
way): strategies do not import DeepSpeed (docs/design.md §Import rules); its ``_SeqAllToAll`` waits only on the
process-group timeout and a hang names no peer, while every wait here is bounded and names the
rank, op and peers (:func:`ds_ring.comm.all_to_all`); it rejects fewer K/V heads than ranks; it
sends q, k and v in three all-to-alls (here one packed exchange per direction); and the local
attention here needs its global head offset and, for ``zigzag``, the gathered rows reordered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_to_all
from ds_ring.comm.groups import group_rank
from ds_ring.hooks import emit_attention, hooks_active
from ds_ring.kernels.dilated import dilated_attention
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


def _by_destination(x: torch.Tensor, degree: int) -> torch.Tensor:
    """``[B, L, degree·h, D]`` → ``[degree, B, L, h, D]``: the heads for each destination rank."""
    return x.unflatten(2, (degree, -1)).permute(2, 0, 1, 3, 4)


def _kernel_rows(recv: torch.Tensor, zigzag: bool) -> torch.Tensor:
    """``[p, B, L, h, D]`` (chunk of each source rank; any strides) → a new contiguous ``[B, h, p·L, D]``: the
    block kernels' layout, rows in true sequence order. One copy.

    Zigzag: source ``s`` holds chunks ``s`` and ``2p-1-s`` (two halves), so the first halves in source order
    followed by the second halves in reverse source order are in order.
    """
    p, b, rows, h, d = recv.shape
    out = recv.new_empty((b, h, p * rows, d))
    if not zigzag:
        out.view(b, h, p, rows, d).copy_(recv.permute(1, 3, 0, 2, 4))
        return out
    halves, dst = recv.unflatten(2, (2, rows // 2)), out.view(b, h, 2, p, rows // 2, d)
    dst[:, :, 0].copy_(halves[:, :, 0].permute(1, 3, 0, 2, 4))
    dst[:, :, 1].copy_(halves[:, :, 1].flip(0).permute(1, 3, 0, 2, 4))
    return out


def _source_chunks_into(dst: torch.Tensor, x: torch.Tensor, zigzag: bool) -> None:
    """Write ``x [B, p·L, h, D]`` (any strides) into ``dst [p, B, L, h, D]`` (a view): the rows each rank sends
    back to shard ``j`` (inverse of :func:`_kernel_rows`'s order)."""
    degree, b, rows, h, d = dst.shape
    if not zigzag:
        dst.copy_(x.unflatten(1, (degree, rows)).transpose(0, 1))
        return
    halves, out = x.unflatten(1, (2, degree, rows // 2)), dst.unflatten(2, (2, rows // 2))
    out[:, :, 0].copy_(halves[:, 0].transpose(0, 1))
    out[:, :, 1].copy_(halves[:, 1].flip(1).transpose(0, 1))


def _heads_to_rows(x: torch.Tensor, degree: int) -> torch.Tensor:
    """``[B, L, p·h, D]`` (any strides) → a new contiguous ``[p, B, L, h, D]``: the heads for each destination."""
    return _by_destination(x, degree).contiguous()


def _rows_to_heads(recv: torch.Tensor) -> torch.Tensor:
    """``[p, B, L, h, D]`` (chunk of each source) → a new contiguous ``[B, L, p·h, D]``."""
    return recv.movedim(0, 2).flatten(2, 3)


def _exchange(send: torch.Tensor, group: ProcessGroup | None, op: str, timeout_s: float | None) -> torch.Tensor:
    """All-to-all of ``send [p, ...]`` over ``group`` (for one rank nothing moves: ``send`` itself)."""
    return send if send.shape[0] == 1 else all_to_all(send, group=group, op=op, timeout_s=timeout_s)


def _slices(heads: int, chunks: int) -> list[slice]:
    step = heads // chunks
    return [slice(i * step, (i + 1) * step) for i in range(chunks)]


class _ToHeads(torch.autograd.Function):
    """One tensor, sequence shards → head shards: ``[B, L, p·h, D]`` → ``chunks`` tensors ``[B, p·L, h/chunks, D]``,
    each a view of its own contiguous ``[B, h/chunks, p·L, D]`` (the block kernels read it without a copy; a
    chunk's memory is freed as soon as its attention backward has run). Every buffer is freed as soon as it is
    consumed: the send buffer once the exchange returns, the received one once reordered; the backward is the
    inverse (one exchange for all chunks)."""

    @staticmethod
    def forward(ctx, x, degree, group, zigzag, op, timeout_s, chunks):
        ctx.args = (degree, group, zigzag, op, timeout_s, chunks)
        send = _heads_to_rows(x, degree)
        recv = _exchange(send, group, op, timeout_s)
        del send
        return tuple(
            _kernel_rows(recv[:, :, :, part], zigzag).transpose(1, 2) for part in _slices(recv.shape[3], chunks)
        )

    @staticmethod
    def backward(ctx, *grads):
        degree, group, zigzag, op, timeout_s, chunks = ctx.args
        b, seq, h, d = grads[0].shape
        send = grads[0].new_empty((degree, b, seq // degree, h * chunks, d))
        for part, grad in zip(_slices(h * chunks, chunks), grads, strict=True):
            _source_chunks_into(send[:, :, :, part], grad, zigzag)
        del grads
        recv = _exchange(send, group, op + "_grad", timeout_s)
        del send
        return _rows_to_heads(recv), None, None, None, None, None, None


class _ToSequence(torch.autograd.Function):
    """Head shards → sequence shards: ``chunks`` tensors ``[B, p·L, h/chunks, D]`` (any strides) → a new
    ``[B, L, p·h, D]``; the backward returns each chunk's gradient as a view of its own contiguous
    ``[B, h/chunks, p·L, D]`` (kernel layout, no copy there; freed once that chunk's backward has run)."""

    @staticmethod
    def forward(ctx, degree, group, zigzag, op, timeout_s, *xs):
        ctx.args = (degree, group, zigzag, op, timeout_s, len(xs))
        b, seq, h, d = xs[0].shape
        send = xs[0].new_empty((degree, b, seq // degree, h * len(xs), d))
        for part, x in zip(_slices(h * len(xs), len(xs)), xs, strict=True):
            _source_chunks_into(send[:, :, :, part], x, zigzag)
        recv = _exchange(send, group, op, timeout_s)
        del send
        return _rows_to_heads(recv)

    @staticmethod
    def backward(ctx, grad):
        degree, group, zigzag, op, timeout_s, chunks = ctx.args
        send = _heads_to_rows(grad, degree)
        del grad
        recv = _exchange(send, group, op + "_grad", timeout_s)
        del send
        parts = _slices(recv.shape[3], chunks)
        return None, None, None, None, None, *(_kernel_rows(recv[:, :, :, p], zigzag).transpose(1, 2) for p in parts)


HEAD_GROUPS = 4
"""Most head groups a rank attends to in turn (1: all its heads at once, one set of buffers)."""


def head_chunks(split: HeadSplit, limit: int | None = None) -> int:
    """How many groups of whole K/V heads (with their query heads) a rank attends to one after another: the
    largest divisor of its K/V heads up to ``limit`` (``None``: :data:`HEAD_GROUPS`). Each group's head
    shards, output and gradients are separate tensors, so the backward frees one group's saved tensors
    before the next group's gradients exist: the peak holds one group's dq, dk, dv instead of all of them."""
    limit = HEAD_GROUPS if limit is None else limit
    return max(c for c in range(1, min(limit, split.kv_heads) + 1) if split.kv_heads % c == 0)


def to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: HeadSplit,
    group: ProcessGroup | None,
    *,
    layout: str,
    timeout_s: float | None,
    chunks: int = 1,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Sequence shards → head shards (differentiable), one all-to-all per tensor, in ``chunks`` head groups.

    ``q [B, L, H, D]``, ``k [B, L, Hkv, D]``, ``v [B, L, Hkv, Dv]`` → per group ``i < chunks``: ``q [B, p·L,
    H/p/chunks, D]``, ``k [B, p·L, split.kv_heads/chunks, D]``, ``v [B, p·L, split.kv_heads/chunks, Dv]``, rows in
    true sequence order, each a view of its own contiguous ``[B, h, p·L, D]`` (the block kernels' layout:
    attention reads them without a copy); group ``i``'s query heads use its K/V heads (GQA). One exchange per
    tensor keeps only one tensor's send and receive buffers alive at a time, each freed as soon as consumed.
    """
    if split.kv_index is not None:
        k, v = k.index_select(2, split.kv_index), v.index_select(2, split.kv_index)
    zigzag = layout == "zigzag"
    return tuple(
        _ToHeads.apply(x, split.degree, group, zigzag, f"ulysses_{name}", timeout_s, chunks)
        for x, name in zip((q, k, v), "qkv", strict=True)
    )


def to_sequence(
    xs: tuple[torch.Tensor, ...], degree: int, group: ProcessGroup | None, *, layout: str, op: str,
    timeout_s: float | None,
) -> torch.Tensor:  # fmt: skip
    """Head shards → sequence shards (differentiable): head groups ``[B, p·L, h/n, ...]`` → ``[B, L, p·h, ...]``."""
    return _ToSequence.apply(degree, group, layout == "zigzag", op, timeout_s, *xs)


def attend_local_heads(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    call: AttentionCall,
    *,
    head_offset: int,
    strategy: str,
    documents: tuple[int, ...] | None,
    sinks: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Dilated attention over the whole sequence on this rank's heads, group by group, with one pair of
    attention events for the call.

    Group ``i``: ``qs[i] [B, S, h, D]``, ``ks[i]``/``vs[i]`` ``[B, S, hkv, D]`` after the all-to-all (rows in
    sequence order, so ``documents`` — checked ``call.cu_seqlens`` — apply as they are; its global heads start
    at ``head_offset + i·h``; ``sinks [n·h]``: this rank's heads' sink logits); returns every group's
    ``out [B, S, h, D]`` and ``lse [B, S, h]``. The end event carries the call's whole ``out`` and ``lse``
    (concatenated over the groups, only while a hook listens).
    """
    rank, started = group_rank(None), time.perf_counter()
    if hooks_active("start"):
        emit_attention(strategy, "forward", "start", rank)
    outs, lses = [], []
    for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        width = q.shape[2]
        out, lse = dilated_attention(
            q, k, v, call.segment_lengths, call.dilation_rates, causal=call.causal, scale=call.scale,
            head_offset=head_offset + i * width, return_lse=True, cu_seqlens=documents, window=call.window,
            sinks=None if sinks is None else sinks[i * width : (i + 1) * width], softcap=call.softcap,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse.transpose(1, 2))
    if hooks_active():
        out, lse = (torch.cat(x, dim=2) if len(x) > 1 else x[0] for x in (outs, lses))
        emit_attention(strategy, "forward", "end", rank, started, out=out, lse=lse.transpose(1, 2))
    return outs, lses


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
        call.check_options(None if shape is None else shape.rows)
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

        chunks = head_chunks(split)

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None):
            qs, ks, vs = to_heads(q, k, v, split, group, layout=call.layout, timeout_s=call.timeout_s, chunks=chunks)
            outs, lses = attend_local_heads(
                qs, ks, vs, call, head_offset=offset, strategy=self.name, documents=documents,
                sinks=None if sinks is None else sinks[heads],
            )  # fmt: skip
            return heads_to_sequence(outs, lses, split, group, call, call.timeout_s)

        return run


def heads_to_sequence(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    split: HeadSplit,
    group: ProcessGroup | None,
    call: AttentionCall,
    timeout_s: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return the head groups' ``out [B, p·L, h/n, D]`` and, with ``call.return_lse``, ``lse [B, p·L, h/n]`` to
    sequence shards ``[B, L, H, D]`` / ``[B, L, H]`` (``None``: the LSE stays where it is)."""
    layout = call.layout
    out = to_sequence(tuple(outs), split.degree, group, layout=layout, op="ulysses_out", timeout_s=timeout_s)
    if not call.return_lse:
        return out, None
    lse = to_sequence(
        tuple(x.unsqueeze(-1) for x in lses), split.degree, group, layout=layout, op="ulysses_lse", timeout_s=timeout_s
    )
    return out, lse.squeeze(-1)
