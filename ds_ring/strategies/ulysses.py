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

Memory: one all-to-all per tensor, each buffer freed as soon as consumed; a rank attends its heads in groups
(:func:`head_chunks`), each group's output exchanged back as soon as it exists; the backward computes
``Delta = rowsum(dout ∘ out)`` on the sequence shards and exchanges a group's ``dout`` only when that group's
backward runs (:class:`_AttendGroup`); dense attention writes a group's gradients over its head shards
(:mod:`ds_ring.kernels.overwrite`), and they go back to sequence shards in :data:`EXCHANGE_PARTS` parts. So it holds
the head-sharded ``q``, ``k``, ``v`` (or their gradients), one group's ``dout`` and one kernel call's pieces
(docs/auto.md, "Ulysses and hybrid memory").

Why not ``deepspeed.sequence.layer.DistributedAttention`` (which wraps a local attention the same
way): strategies do not import DeepSpeed (docs/design.md §Import rules); its ``_SeqAllToAll`` waits only on the
process-group timeout and a hang names no peer, while every wait here is bounded and names the
rank, op and peers (:func:`ds_ring.comm.all_to_all`); it rejects fewer K/V heads than ranks; it
sends every tensor whole (here the output and ``dout`` go per head group); and the local
attention here needs its global head offset and, for ``zigzag``, the gathered rows reordered.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.collectives import all_to_all
from ds_ring.comm.group_ranks import group_rank
from ds_ring.hooks import current_labels, emit_attention, hooks_active, labelled
from ds_ring.kernels.delta import OutputByDelta, row_delta
from ds_ring.kernels.dilated import dilated_forward, plan_dilated
from ds_ring.kernels.merge import accum_dtype
from ds_ring.kernels.overwrite import BLOCK_ROWS, dilated_backward_over_inputs
from ds_ring.parallel.order import ORDERS as LAYOUTS
from ds_ring.strategies.base import AttentionCall, Bound, Degrees, Shape, Strategy, Target, check_missing_dimension
from ds_ring.strategies.cost import Cost, Link, Option, Problem, branches, flops, kv_heads_sent, pairs

__all__ = [
    "Ulysses",
    "HeadSplit",
    "split_heads",
    "check_layout",
    "to_heads",
    "GroupAttention",
    "attend_head_groups",
    "dilated_jobs",
    "group_job",
    "group_sinks",
    "head_chunks",
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


def _shard_rows(x: torch.Tensor, degree: int, zigzag: bool, part: slice) -> torch.Tensor:
    """Rows ``part`` of every rank's shard in ``x [B, p·L, h, D]`` (true sequence order, any strides): ``[p, B,
    rows, h, D]``, a view (zigzag's second half: a copy, reversed); with ``zigzag`` the part lies in one half."""
    rows = x.shape[1] // degree
    if not zigzag:
        return x.unflatten(1, (degree, rows))[:, :, part].transpose(0, 1)
    half, (start, stop, _) = rows // 2, part.indices(rows)
    halves = x.unflatten(1, (2, degree, half))  # shard j: chunk j of the first half, chunk p-1-j of the second
    if stop <= half:
        return halves[:, 0, :, start:stop].transpose(0, 1)
    return halves[:, 1, :, start - half : stop - half].flip(1).transpose(0, 1)


def _source_chunks_into(dst: torch.Tensor, x: torch.Tensor, zigzag: bool) -> None:
    """Write ``x [B, p·L, h, D]`` (any strides) into ``dst [p, B, L, h, D]`` (a view): the rows each rank sends
    back to shard ``j`` (inverse of :func:`_kernel_rows`'s order)."""
    for part in _row_parts(dst.shape[2], zigzag, 2 if zigzag else 1):
        dst[:, :, part].copy_(_shard_rows(x, dst.shape[0], zigzag, part))


def _row_parts(rows: int, zigzag: bool, count: int) -> list[slice]:
    """``rows`` cut into at most ``count`` consecutive parts, none empty; with ``zigzag`` none crosses the middle."""
    if zigzag:
        half = rows // 2
        firsts = _row_parts(half, False, count // 2)
        return [*firsts, *(slice(half + p.start, half + p.stop) for p in firsts)]
    count = max(1, min(count, rows))
    return [slice(rows * i // count, rows * (i + 1) // count) for i in range(count)]


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


EXCHANGE_PARTS = 4
"""Parts of the shard's rows the gradients go back in, one all-to-all each: next to the head-sharded gradients
and the result, the buffers in flight are a quarter of a tensor instead of two whole ones."""


class _ToHeads(torch.autograd.Function):
    """One tensor, sequence shards → head shards: ``[B, L, p·h, D]`` → ``chunks`` tensors ``[B, p·L, h/chunks, D]``,
    each a view of its own contiguous ``[B, h/chunks, p·L, D]`` (the block kernels read it without a copy; a
    chunk's memory is freed as soon as its attention backward has run). Every buffer is freed as soon as it is
    consumed: the send buffer once the exchange returns, the received one once reordered; the backward is the
    inverse, all chunks at once, in :data:`EXCHANGE_PARTS` parts of the shard's rows."""

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
        rows = seq // degree
        out = grads[0].new_empty((b, rows, degree, h * chunks, d))
        for part in _row_parts(rows, zigzag, EXCHANGE_PARTS):
            send = grads[0].new_empty((degree, b, part.stop - part.start, h * chunks, d))
            for columns, grad in zip(_slices(h * chunks, chunks), grads, strict=True):
                send[:, :, :, columns].copy_(_shard_rows(grad, degree, zigzag, part))
            recv = _exchange(send, group, op + "_grad", timeout_s)
            del send
            out[:, part].copy_(recv.permute(1, 2, 0, 3, 4))
            del recv
        return out.flatten(2, 3), None, None, None, None, None, None


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


def _group_columns(x: torch.Tensor, degree: int, heads: int, columns: slice) -> torch.Tensor:
    """``[B, L, p·heads, D]`` → the view ``[B, L, p, w, D]`` of each rank's heads ``columns`` (``w`` of them)."""
    return x.unflatten(2, (degree, heads))[:, :, :, columns]


@dataclass(frozen=True)
class GroupAttention:
    """How one head group attends on its head shards, without autograd.

    ``forward(q, k, v, sinks) -> (out, lse)``: ``q [B, S, w, D]``, ``k``/``v`` ``[B, S, wkv, D|Dv]``, ``sinks [w]`` or
    ``None`` → ``out [B, S, w, Dv]`` (``q``'s dtype), ``lse [B, S, w]``. ``backward(saved, sinks, sinks_wanted=...) ->
    (dq, dk, dv, dsinks)`` from ``saved = (dout, q, k, v, out, lse)``, where ``out`` is an
    :class:`~ds_ring.kernels.delta.OutputByDelta` and ``q``, ``k``, ``v`` are the group's own head shards, which it may
    overwrite with their gradients. ``columns``: the group's heads among the rank's ``heads``.
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor | None, ...]]
    columns: slice
    heads: int
    degree: int
    group: ProcessGroup | None
    zigzag: bool
    timeout_s: float | None


def _out_to_sequence_(out: torch.Tensor, head_out: torch.Tensor, job: GroupAttention) -> None:
    """Write the group's ``head_out [B, S, w, Dv]`` into its heads of the sequence shard ``out [B, L, p·h, Dv]``."""
    send = head_out.new_empty((job.degree, out.shape[0], out.shape[1], head_out.shape[2], head_out.shape[3]))
    _source_chunks_into(send, head_out, job.zigzag)
    recv = _exchange(send, job.group, "ulysses_out", job.timeout_s)
    del send
    _group_columns(out, job.degree, job.heads, job.columns).copy_(recv.permute(1, 2, 0, 3, 4))


def _dout_to_heads(dout: torch.Tensor, out: torch.Tensor, job: GroupAttention) -> OutputByDelta:
    """The group's ``dout`` and ``Delta`` on head shards, from the sequence shards ``dout``/``out [B, L, p·h, Dv]``.

    ``Delta = rowsum(dout ∘ out)`` is taken here, before the exchange, so the head-sharded ``out`` is never needed.
    Returns them as the output the kernels read (:class:`~ds_ring.kernels.delta.OutputByDelta`): ``dout [B, S, w,
    Dv]`` (a view of a contiguous ``[B, w, S, Dv]``: the kernels' layout) and ``Delta [B, S, w]`` (accumulation dtype).
    """
    douts, outs = (_group_columns(x, job.degree, job.heads, job.columns) for x in (dout, out))
    delta = row_delta(douts, outs, accum_dtype(out.dtype)).permute(2, 0, 1, 3).contiguous()
    send = douts.permute(2, 0, 1, 3, 4).contiguous()
    recv = _exchange(send, job.group, "ulysses_dout", job.timeout_s)
    del send
    head_dout = _kernel_rows(recv, job.zigzag).transpose(1, 2)
    del recv
    delta = _exchange(delta, job.group, "ulysses_delta", job.timeout_s).unsqueeze(-1)
    return OutputByDelta(head_dout, _kernel_rows(delta, job.zigzag).squeeze(-1).transpose(1, 2))


class _Output:
    """The sequence-shard output the groups write, as the backward reads it (``Delta``): set once every group has
    written it, with its version then, so a later in-place change is an error rather than a wrong gradient."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.version = 0

    def set(self, out: torch.Tensor) -> None:
        self.tensor, self.version = out.detach(), out._version

    def get(self) -> torch.Tensor:
        if self.tensor is None or self.tensor._version != self.version:
            raise RuntimeError(
                "ds_ring: the output of a Ulysses/hybrid attention call was modified in place after the call; its "
                "backward needs it as it was: clone it before changing it"
            )
        return self.tensor


class _AttendGroup(torch.autograd.Function):
    """One head group: attention on its head shards, its output exchanged into its heads of the sequence-shard ``out``
    (in place), and back: the group's ``dout`` exchanged only when its backward runs.

    The groups are chained through ``out`` (each takes the previous one's), so autograd runs them last to first, one
    at a time: a group's ``dout`` and running gradients exist only during its own backward. The gradient
    passed on to the previous group is ``dout`` as it came: each group reads only its own heads of it. Saves the
    head-sharded ``q``, ``k``, ``v`` and ``lse``, not the output: the backward takes ``Delta`` from the sequence shards.
    """

    @staticmethod
    def forward(ctx, out, q, k, v, sinks, job: GroupAttention, output: _Output):
        head_out, lse = job.forward(q, k, v, sinks)
        _out_to_sequence_(out, head_out, job)
        ctx.save_for_backward(q, k, v, lse, sinks)
        ctx.output, ctx.job, ctx.labels = output, job, current_labels()
        ctx.mark_dirty(out)
        ctx.mark_non_differentiable(lse, head_out)
        ctx.set_materialize_grads(False)  # no zero gradients made for lse and head_out
        return out, lse, head_out

    @staticmethod
    def backward(ctx, dout, _dlse, _dhead_out):
        if getattr(ctx, "overwritten", False):
            raise RuntimeError(
                "ds_ring: a second backward through a Ulysses/hybrid attention call (retain_graph=True): its first "
                "backward wrote the gradients over its head shards to save memory. Run the forward again for "
                "another backward"
            )
        q, k, v, lse, sinks = ctx.saved_tensors
        job, q_ptr = ctx.job, q.data_ptr()
        with labelled(**ctx.labels):
            head_out = _dout_to_heads(dout, ctx.output.get(), job)
            saved = (head_out.dout, q, k, v, head_out, lse)
            del q, k, v, head_out
            grads = job.backward(saved, sinks, sinks_wanted=ctx.needs_input_grad[4])
        ctx.overwritten = grads[0].data_ptr() == q_ptr
        return dout, *grads, None, None


def _lse_to_sequence(lses: Sequence[torch.Tensor], job: GroupAttention) -> torch.Tensor:
    """The groups' ``lse [B, S, w]`` → the sequence shard's ``[B, L, p·h]`` (no gradient: the LSE carries none)."""
    b, seq, width = lses[0].shape
    send = lses[0].new_empty((job.degree, b, seq // job.degree, width * len(lses), 1))
    for part, lse in zip(_slices(width * len(lses), len(lses)), lses, strict=True):
        _source_chunks_into(send[:, :, :, part], lse.unsqueeze(-1), job.zigzag)
    recv = _exchange(send, job.group, "ulysses_lse", job.timeout_s)
    del send
    return _rows_to_heads(recv).squeeze(-1)


def attend_head_groups(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    sinks: Sequence[torch.Tensor | None],
    jobs: Sequence[GroupAttention],
    *,
    return_lse: bool,
    strategy: str | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attend the head groups in turn and return the output to sequence shards (differentiable).

    Group ``i``: ``qs[i] [B, S, w, D]``, ``ks[i]``/``vs[i]`` ``[B, S, wkv, D|Dv]`` (from :func:`to_heads`), ``sinks[i]
    [w]`` or ``None``, attended by ``jobs[i]``. Returns ``out [B, L, p·h, Dv]`` and, with ``return_lse``, ``lse [B, L,
    p·h]``. ``strategy``: the name one pair of attention events carries for the whole call (start, then end with the
    head-sharded ``out`` and ``lse`` concatenated over the groups, only while a hook listens); ``None``: the jobs emit
    their own.
    """
    rank, started, job = group_rank(None), time.perf_counter(), jobs[0]
    if strategy is not None and hooks_active("start"):
        emit_attention(strategy, "forward", "start", rank)
    b, seq = qs[0].shape[:2]
    out = qs[0].new_empty((b, seq // job.degree, job.degree * job.heads, vs[0].shape[-1]))
    lses, head_outs, output = [], [], _Output()
    for q, k, v, sink, job in zip(qs, ks, vs, sinks, jobs, strict=True):
        out, lse, head_out = _AttendGroup.apply(out, q, k, v, sink, job, output)
        lses.append(lse)
        if strategy is not None and hooks_active():
            head_outs.append(head_out)
        del head_out
    output.set(out)
    if head_outs:
        event_out, event_lse = (torch.cat(x, dim=2) if len(x) > 1 else x[0] for x in (head_outs, lses))
        emit_attention(strategy, "forward", "end", rank, started, out=event_out, lse=event_lse.transpose(1, 2))
    return out, _lse_to_sequence(lses, job) if return_lse else None


def dilated_jobs(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    sinks: Sequence[torch.Tensor | None],
    call: AttentionCall,
    split: HeadSplit,
    group: ProcessGroup | None,
    *,
    head_offset: int,
    documents: tuple[int, ...] | None,
) -> list[GroupAttention]:
    """One :class:`GroupAttention` per head group for dilated attention over the whole sequence on this rank's heads
    (rows in sequence order after the all-to-all, so ``documents`` — checked ``call.cu_seqlens`` — apply as they are;
    group ``i``'s global heads start at ``head_offset + i·w``). Shapes as in :func:`attend_head_groups`."""
    jobs, start = [], 0
    for q, k, v, sink in zip(qs, ks, vs, sinks, strict=True):
        width = q.shape[2]
        regions, opts = plan_dilated(
            q, k, v, call.segment_lengths, call.dilation_rates, causal=call.causal, scale=call.scale,
            head_offset=head_offset + start, cu_seqlens=documents, window=call.window, sinks=sink, softcap=call.softcap,
            spans=call.bidirectional_spans,
        )  # fmt: skip
        jobs.append(group_job(
            functools.partial(dilated_forward, regions=regions, opts=opts),
            # The head shards are this call's own (made by the all-to-all): dense attention may overwrite them.
            functools.partial(dilated_backward_over_inputs, regions=regions, opts=opts),
            slice(start, start + width), split, group, call,
        ))  # fmt: skip
        start += width
    return jobs


def group_job(
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    backward: Callable[..., tuple[torch.Tensor | None, ...]],
    columns: slice,
    split: HeadSplit,
    group: ProcessGroup | None,
    call: AttentionCall,
) -> GroupAttention:
    """The :class:`GroupAttention` of heads ``columns`` of a rank's ``split.heads``, exchanged over ``group``."""
    return GroupAttention(forward, backward, columns, split.heads, split.degree, group, call.layout == "zigzag",
                          call.timeout_s)  # fmt: skip


def group_sinks(sinks: torch.Tensor | None, widths: Sequence[int]) -> list[torch.Tensor | None]:
    """This rank's ``sinks [h]`` (or ``None``) cut per head group of ``widths`` heads."""
    if sinks is None:
        return [None] * len(widths)
    return list(sinks.split(list(widths)))


BLOCKED_GROUP = 3.0
"""The cost model's group in a blocked backward (dense attention over more than ``BLOCK_ROWS`` rows written over the
head shards), in units of its ``dout``: ``dout`` itself, the ``dq`` of unfinished query blocks, one key block's dK/dV
and one call's pieces (census at 4K rows per rank: 3.3; RSS slope: less)."""

EXCHANGE_BACK = 1.5
"""The gradients' way back to sequence shards, in q-shards over the head shards: the tensor's result (1) and one of
:data:`EXCHANGE_PARTS` parts in flight both ways."""


def all_to_all_cost(p: Problem, degree: int, bandwidth: float, link: Link) -> tuple[float, float]:
    """The cost model's all-to-alls of q, k, v and back over ``degree`` ranks (K/V heads replicated when they do not
    split): bytes sent, seconds (all exposed)."""
    if degree <= 1:
        return 0.0, 0.0
    rows = p.batch * p.local
    q = rows * p.heads * p.head_dim
    kv = rows * kv_heads_sent(p, degree) * (p.head_dim + p.dv)
    out = rows * p.heads * p.dv
    elements = (q + kv + out) * (2 if p.backward else 1)
    sent = elements * p.itemsize * (degree - 1) / degree
    messages = (8 if p.backward else 4) * (degree - 1)  # one exchange per tensor: q, k, v, out (and back)
    return sent, sent / bandwidth + messages * link.latency_s


def head_groups_of(kv_heads: int) -> int:
    """Head groups of a rank with ``kv_heads`` K/V heads (:func:`head_chunks`)."""
    return max(c for c in range(1, min(HEAD_GROUPS, kv_heads) + 1) if kv_heads % c == 0)


def head_group_peak(heads_kv: float, out: float, groups: int, backward: bool, blocked: bool) -> float:
    """The memory model's head shards at the peak, in q-shards: the saved q, k, v (``1 + heads_kv``; in the backward
    the groups already done hold their gradients instead) and the group in its backward. ``blocked`` (dense attention
    over more than ``BLOCK_ROWS`` rows, written over the head shards): its ``dout``, the ``dq`` of unfinished blocks
    and one call's pieces (``BLOCKED_GROUP·out/groups``) or the gradients' way back (:data:`EXCHANGE_BACK`),
    whichever is larger; else one call's dq, dk, dv, the group's ``dout`` and the call's stand-in output, each a
    ``1/groups`` share. Forward only: the q, k, v and one group's output."""
    if not backward:
        return 1 + heads_kv + out / groups
    if blocked:
        return 1 + heads_kv + max(BLOCKED_GROUP * out / groups, EXCHANGE_BACK)
    return (1 + heads_kv) * (1 + 1 / groups) + 2 * out / groups


def head_sharded_memory(p: Problem, degree: int, rows: int, ring: int, buffers: dict[str, float]) -> float:
    """The memory model of attention on head shards after an all-to-all over ``degree`` ranks (Ulysses; the hybrid
    adds its ring's block), ``rows`` rows a rank attends over, in q-shards: the output and the head-group peak."""
    out = p.dv / p.head_dim
    heads_kv = kv_heads_sent(p, degree) * (p.head_dim + p.dv) / (p.heads * p.head_dim)
    groups = head_groups_of(kv_heads_sent(p, degree) // degree)
    dense = p.segment_lengths is None and p.window is None and p.documents is None
    blocked = dense and rows > BLOCK_ROWS and ring == 1
    return out + head_group_peak(heads_kv, out, groups, p.backward, blocked) + buffers["ulysses"]


class Ulysses(Strategy):
    """``strategy="ulysses"``: all-to-all over the whole sequence-parallel group (``heads % (U·R) == 0``);
    every rank attends over the whole sequence on its heads, with any branches and either layout."""

    name = "ulysses"
    buffers = {"ulysses": 0.0}
    """Memory beyond the head-group peak (:func:`head_sharded_memory`), in q-shards."""

    def default_communication(self) -> None:
        return None

    def check_degrees(self, ulysses_degree: int | None, ring_degree: int | None) -> None:
        check_missing_dimension(self.name, "ring", "ring_degree", ring_degree)

    def options(self, problem: Problem) -> list[Option]:
        """Every layout, all-to-all over the whole group; none when the call names an exchange."""
        if problem.communication is not None:
            return []
        return [Option(self.name, None, layout, problem.world, 1, problem.seq) for layout in problem.layouts]

    def cost(self, problem: Problem, option: Option, link: Link) -> Cost:
        work = sum(flops(problem, pairs(problem, w, r)) for w, r in branches(problem))
        spans = (problem.ranks_per_host or problem.world) < problem.world
        sent, comm = all_to_all_cost(problem, problem.world, link.bandwidth if spans else link.within_host(), link)
        return Cost(work / problem.world / link.flops, sent, comm, comm)

    def memory_q_shards(self, problem: Problem, option: Option, buffers: dict[str, float] | None = None) -> float:
        b = {**self.buffers, **(buffers or {})}
        return head_sharded_memory(problem, problem.world, problem.seq, 1, b)

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
            local = group_sinks(None if sinks is None else sinks[heads], [x.shape[2] for x in qs])
            jobs = dilated_jobs(qs, ks, vs, local, call, split, group, head_offset=offset, documents=documents)
            return attend_head_groups(qs, ks, vs, local, jobs, return_lse=call.return_lse, strategy=self.name)

        return run
