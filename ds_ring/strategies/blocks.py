"""K/V blocks of a span: packing for transport, and the compute of one visiting block.

A member's *block* for a spanning branch is the kept (dilated) K/V rows of its runs that another
member attends to, for every head group, with only the K/V heads that group needs (GQA heads travel
as they are), packed K-then-V into one contiguous 1-D buffer so a single send moves it (V rows may be
shorter or longer than K rows: multi-head latent attention; the V part starts after the K part). Sizes differ
between members (dilation offsets, documents); every member computes every other's size from the
plan, so nothing is padded. A rank's own runs meet each other straight from its ``k``/``v``
(:func:`forward_own_`), never through its block.

The gradient of a block (dK, dV) uses the same packing in the accumulation dtype: the travelling
accumulator of the ring backward, or a contribution to the all-gather's reduce-scatter. The ring keeps
its blocks in :class:`BlockBuffers`, allocated once per call and reused every step.

A dense span's heads are independent, so when its blocks are large they travel one K/V head (and its
query heads) at a time (:func:`head_chunks`): one exchange per chunk, each holding 1/kv_heads of the
blocks, buffers and kernel pieces of a whole-head exchange.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ds_ring.kernels import overwrite
from ds_ring.kernels.dilated import Options, attend_backward, attend_into, span_cuts
from ds_ring.kernels.dilation import HeadGroup, add_heads_, head_groups, select_heads
from ds_ring.kernels.merge import accum_dtype
from ds_ring.kernels.piece import Piece
from ds_ring.strategies.plan import Held, Run, SpanPlan, Travel, pieces

__all__ = [
    "Shard",
    "Options",
    "BlockBuffers",
    "pack_block",
    "unpack_block",
    "new_grad_block",
    "forward_block_",
    "backward_block_",
    "forward_own_",
    "backward_own_",
    "add_home_grads_",
    "block_has_work",
    "block_grad",
    "head_chunks",
    "CHUNK_BYTES",
    "chunk_bytes",
]

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Shard:
    """This rank's tensors of one attention call, as an exchange and the block helpers see them.

    ``q`` ``[B, L, H, D]``, ``out`` ``[B, L, H, Dv]``; ``k`` ``[B, L, Hkv, D]``, ``v`` ``[B, L, Hkv, Dv]``;
    ``lse`` ``[B, L, H]`` (float32, or float64 for float64 inputs). In the forward ``out``/``lse`` are the
    accumulators merged into in place; in the backward they are the saved results.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def v_head_dim(self) -> int:
        return self.v.shape[-1]

    @property
    def dims(self) -> tuple[int, int]:
        """``(head_dim, v_head_dim)``: the K and V row lengths of a packed block."""
        return self.q.shape[-1], self.v.shape[-1]

    def heads(self, q_heads: slice, kv_heads: slice) -> Shard:
        """Views of query heads ``q_heads`` (``q``, ``out``, ``lse``) and K/V heads ``kv_heads``."""
        return Shard(
            self.q[:, :, q_heads], self.k[:, :, kv_heads], self.v[:, :, kv_heads],
            self.out[:, :, q_heads], self.lse[:, :, q_heads],
        )  # fmt: skip


CHUNK_BYTES = {"cpu": 2 * 2**20, "cuda": 256 * 2**20}
"""Per device type: a dense span's blocks travel one K/V head at a time once one head's share of its
largest block reaches this many bytes (a device type not listed: the ``"cuda"`` budget). Below it the
extra steps cost more than the memory is worth. CPU: dense ring, p = 4, 8 heads, fp32, one fwd+bwd
measured +15% time at 1 MiB per head, +2% (noise) at 2 MiB. GPU: each extra ring is ``p - 1`` more
launches and transfers too small to fill NVLink, while a block of 32K tokens × head dim 128 in bf16 is
16 MiB per K/V head — 256 MiB keeps such spans whole (the chunking is for blocks that would crowd the
GPU's memory: 8 K/V heads of 256 MiB are 2 GiB per buffer). Not yet tuned on a GPU."""


def chunk_bytes(device: torch.device) -> int:
    """The per-head block size from which :func:`head_chunks` splits a dense span by K/V head on ``device``."""
    return CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"])


def head_chunks(span: SpanPlan, shard: Shard) -> list[tuple[SpanPlan, slice, slice]]:
    """``(span, q heads, kv heads)`` per exchange: one per K/V head for a large dense span, else the span whole.

    Dense (one head group, rate 1) spans only: their runs do not depend on the heads, so a chunk's
    plan is the span's with the groups of one K/V head. Every member decides from the plan and the
    shapes alone, so all agree.
    """
    q, k = shard.q, shard.k
    heads, kv_heads = q.shape[2], k.shape[2]
    whole = [(span, slice(None), slice(None))]
    if len(span.groups) != 1 or span.groups[0].rate != 1 or kv_heads == 1:
        return whole
    largest = max(span.block_numel(m, shard.batch, *shard.dims) for m in range(len(span.members)))
    if largest * k.element_size() // kv_heads < chunk_bytes(k.device):
        return whole
    per_kv = heads // kv_heads
    (group,) = head_groups(per_kv, 1, 1, 0, q.device)
    if group.kv_index is None:
        travel = Travel(group.q_heads, None, 1)
    else:  # GQA: the chunk's one K/V head serves its per_kv query heads
        travel = Travel(torch.zeros(1, dtype=torch.long, device=q.device), group.kv_list, 1)
    chunk = dataclasses.replace(span, groups=(group,), travel=(travel,))
    return [(chunk, slice(h * per_kv, (h + 1) * per_kv), slice(h, h + 1)) for h in range(kv_heads)]


class LazyGrads:
    """Gradients shaped like ``like`` (each in its accumulation dtype): ``grads`` when given, else zeroed when first
    asked for. A backward asks only when it adds its first piece, so those zeros never exist during the kernel call
    that makes it (whose pieces and stand-in output are the call's peak). :meth:`heads` views some heads (dim 2),
    sharing the one allocation."""

    def __init__(self, like: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None = None) -> None:
        self._like = tuple(like)
        self._grads = [None if grads is None else tuple(grads)]  # shared with the views of :meth:`heads`
        self._heads = slice(None)

    def __call__(self) -> tuple[torch.Tensor, ...]:
        if self._grads[0] is None:
            self._grads[0] = tuple(
                torch.zeros(x.shape, dtype=accum_dtype(x.dtype), device=x.device) for x in self._like
            )
        return tuple(grad[:, :, self._heads] for grad in self._grads[0])

    def heads(self, heads: slice) -> LazyGrads:
        """The same gradients, heads ``heads`` only (allocated by whichever view is called first)."""
        view = copy.copy(self)
        view._heads = heads
        return view


def add_dq_(dq: LazyGrads, rows: slice, heads: slice, piece: torch.Tensor) -> None:
    """``dq[:, rows, heads] += piece`` for a lazily zeroed ``dq`` (:class:`LazyGrads` of ``q`` alone)."""
    (grad,) = dq()
    grad[:, rows, heads] += piece


class BlockBuffers:
    """``count`` flat buffers, each as large as the span's largest block, allocated on first use.

    Blocks differ in size between members, so a step uses a 1-D prefix view (:meth:`view`) of a
    buffer: receive buffers are allocated once per call, never per step.
    """

    def __init__(
        self, span: SpanPlan, batch: int, dims: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> None:
        self._numel = max(span.block_numel(m, batch, *dims) for m in range(len(span.members)))
        self._dtype, self._device = dtype, device
        self._buffers: dict[int, torch.Tensor] = {}

    def view(self, index: int, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of buffer ``index`` (contiguous, 1-D)."""
        if index not in self._buffers:
            self._buffers[index] = torch.empty(self._numel, dtype=self._dtype, device=self._device)
        return self._buffers[index][:numel]

    def release(self, index: int) -> None:
        """Drop buffer ``index`` (freed once no view of it is left); a later :meth:`view` allocates it again."""
        self._buffers.pop(index, None)


def pack_block(span: SpanPlan, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """This member's block: kept rows and travelling heads of ``k [B, L, Hkv, D]`` and ``v [B, L, Hkv, Dv]``, flat.

    Per head group the runs are laid side by side along the rows (``[B, count, heads, D|Dv]``). Written
    into ``out`` (1-D, ``block_numel`` elements) when given, else into a new tensor.
    """
    batch, dims = k.shape[0], (k.shape[-1], v.shape[-1])
    if out is None:
        out = k.new_empty(span.block_numel(span.index, batch, *dims))
    blocks = unpack_block(span, span.index, out, batch, dims)
    for held, travel, kv in zip(span.held[span.index], span.travel, blocks, strict=True):
        for x, packed in zip((k, v), kv, strict=True):
            for run in held.runs:
                packed[:, run.packed].copy_(select_heads(x[:, run.rows], travel.select))
    return out


def unpack_block(span: SpanPlan, member: int, flat: torch.Tensor, batch: int, dims: tuple[int, int]) -> list[KV]:
    """Views ``(k_g [B, rows, travelled heads, D], v_g [B, rows, travelled heads, Dv])`` per head group into
    member's flat block; ``dims``: ``(D, Dv)``."""
    held = list(zip(span.held[member], span.travel, strict=True))
    shapes = [[(batch, h.count, travel.num_heads, dim) for h, travel in held] for dim in dims]
    flat_shapes = shapes[0] + shapes[1]
    parts = flat.split([b * m * h * d for b, m, h, d in flat_shapes])
    views = [part.view(shape) for part, shape in zip(parts, flat_shapes, strict=True)]
    n = len(shapes[0])
    return [(views[g], views[n + g]) for g in range(n)]


def _whole_piece(span: SpanPlan, member: int, causal: bool) -> Run | None:
    """The query run of the one kernel call that meets all of member's block, if there is one.

    Then that call's dK/dV, ``[B, count, heads, D]`` contiguous, are the block's gradient as it is packed.
    """
    if len(span.groups) != 1 or span.travel[0].expand is not None or span.spans is not None:
        return None
    work = pieces(span.queries[0], span.held[member][0], causal)
    if len(work) != 1:
        return None
    a, b, _ = work[0]
    whole = b.packed.start in (0, None) and b.packed.stop == span.held[member][0].count and b.packed.step in (1, None)
    return a if whole else None


def block_grad(
    span: SpanPlan, member: int, kv: list[KV], shard: Shard, dout: torch.Tensor, dq: LazyGrads, opts: Options
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gradient of member's block, as its flat (dK, dV) halves in the accumulation dtype.

    Accumulates into ``dq`` (of ``q [B, L, H, D]``). When one kernel call meets the whole block (dense
    attention) its dK/dV are returned as they are: no zero block, no copy. The dK half has
    :meth:`~ds_ring.strategies.plan.SpanPlan.k_numel` elements, the dV half the rest.
    """
    q, out, lse = shard.q, shard.out, shard.lse
    run = _whole_piece(span, member, opts.causal) if opts.window is None else None
    if run is not None and kv[0][0].dtype == accum_dtype(q.dtype):
        (kb, vb), qs, h = kv[0], run.rows, span.groups[0].q_heads
        dq_piece, dk_piece, dv_piece = attend_backward(
            dout[:, qs, h], q[:, qs, h], kb, vb, out[:, qs, h], lse[:, qs, h], opts.piece(causal=False)
        )
        add_dq_(dq, qs, h, dq_piece)
        return dk_piece.reshape(-1), dv_piece.reshape(-1)
    grad = new_grad_block(span, member, shard)
    if block_has_work(span, member, opts):
        dkv = unpack_block(span, member, grad, shard.batch, shard.dims)
        backward_block_(span, member, kv, dkv, shard, dout, dq, opts)
    half = span.k_numel(member, shard.batch, shard.head_dim)
    return grad[:half], grad[half:]


def new_grad_block(span: SpanPlan, member: int, shard: Shard) -> torch.Tensor:
    """A zero gradient block for member's K/V, flat, in the accumulation dtype of ``shard.q``."""
    numel = span.block_numel(member, shard.batch, *shard.dims)
    return torch.zeros(numel, dtype=accum_dtype(shard.q.dtype), device=shard.q.device)


def _head_calls(q_heads: slice, kv_heads: slice | tuple[int, ...] | None) -> list[tuple[slice, slice]]:
    """``(query heads, their K/V heads)`` of each kernel call of a head group, both as slices (views, no copy).

    ``kv_heads`` a slice: one K/V head per query head, all in one call. Host ints (GQA: each query head's K/V
    head): one call per query head with its one K/V head. The kernels want as many K/V heads as query heads, and
    expanding K/V to every query head would copy them (and make their gradient pieces) once per query head: 2.3x
    the K/V-sized memory a ring or all-gather call predicts at 8/2 heads (docs/auto.md "GQA memory").
    """
    if isinstance(kv_heads, slice):
        return [(q_heads, kv_heads)]
    first, rate = q_heads.start or 0, q_heads.step or 1
    return [(slice(first + i * rate, first + i * rate + 1), slice(j, j + 1)) for i, j in enumerate(kv_heads)]


def _own_heads(group: HeadGroup) -> slice | tuple[int, ...]:
    """The K/V heads of a group's query heads in the shard's own K/V: its strided slice, or its GQA map."""
    return group.q_heads if group.kv_list is None else group.kv_list


def block_has_work(span: SpanPlan, member: int, opts: Options) -> bool:
    """Whether this rank's queries attend to any key of member's block (its own runs for itself)."""
    return any(_pairs(span, g, member, opts) for g in range(len(span.groups)))


def _pairs(span: SpanPlan, g: int, member: int, opts: Options) -> list[tuple[Run, Run, bool]]:
    """The pieces of head group ``g`` between this rank's queries and member's keys: its own runs meet as the mask
    says; another member's block as causal attention does, or with an ``ahead`` plan only where a span reaches
    into it (docs/design.md §Bidirectional spans)."""
    if member == span.index:
        return [] if span.ahead else pieces(span.queries[g], span.queries[g], opts.causal, opts.window, span.spans)
    if span.ahead:
        return pieces(span.queries[g], span.held[member][g], opts.causal, opts.window, span.spans, ahead=True)
    return pieces(span.queries[g], span.held[member][g], opts.causal, opts.window)


def _visits(span: SpanPlan, member: int, opts: Options) -> Iterator[tuple[int, slice, slice, Run, Run]]:
    """``(group, query heads, their heads in the group's travelled K/V, query run, key run)`` for every kernel call
    between the shard's queries and another member's block (:func:`_head_calls`)."""
    for g, group in enumerate(span.groups):
        work = _pairs(span, g, member, opts)
        if work:
            expand = span.travel[g].expand
            calls = _head_calls(group.q_heads, slice(None) if expand is None else expand)
            for a, b, _ in work:
                for h, kvh in calls:
                    yield g, h, kvh, a, b


def _piece(query: Run, key: Run, diagonal: bool, opts: Options) -> Piece:
    """The options of one piece's kernel call: the band of the window between the runs' positions, or a plain
    block (causal when it is a run meeting itself)."""
    return opts.piece(query.position - key.position, diagonal)


def _cuts(query: Run, key: Run, keys: slice, diagonal: bool, opts: Options) -> Iterator[tuple[slice, slice, Piece]]:
    """``(query rows, key rows, piece)`` of one piece: the runs' rows whole (``keys``: the key run's rows in the
    tensor it is read from), or with bidirectional spans the blocks they cut it into (rate-1 runs;
    :func:`~ds_ring.kernels.spans.span_blocks`)."""
    if opts.spans is None:
        yield query.rows, keys, _piece(query, key, diagonal, opts)
        return
    q0, k0 = query.rows.start, keys.start
    for rows, cols, piece in span_cuts(query.position, query.count, key.position, key.count, opts.spans, opts):
        yield slice(q0 + rows.start, q0 + rows.stop), slice(k0 + cols.start, k0 + cols.stop), piece


def forward_block_(span: SpanPlan, member: int, kv: list[KV], shard: Shard, opts: Options) -> None:
    """Merge attention of the shard's queries over another member's block into its ``out``/``lse`` (in place)."""
    q, out, lse = shard.q, shard.out, shard.lse
    for g, h, kvh, a, b in _visits(span, member, opts):
        kg, vg = kv[g]
        for qs, ks, piece in _cuts(a, b, b.packed, False, opts):
            attend_into(q[:, qs, h], kg[:, ks, kvh], vg[:, ks, kvh], out[:, qs, h], lse[:, qs, h], piece)


def backward_block_(
    span: SpanPlan,
    member: int,
    kv: list[KV],
    dkv: list[KV],
    shard: Shard,
    dout: torch.Tensor,
    dq: LazyGrads,
    opts: Options,
) -> None:
    """Accumulate the gradient of another member's block into ``dq`` (of ``q [B, L, H, D]``) and its ``dkv`` views."""
    for g, h, kvh, a, b in _visits(span, member, opts):
        (kg, vg), (dkg, dvg) = kv[g], dkv[g]
        for qs, ks, piece in _cuts(a, b, b.packed, False, opts):
            _backward_piece(shard, dout, (kg, vg), (dq, dkg, dvg), qs, ks, h, kvh, piece)


def _backward_piece(
    shard: Shard,
    dout: torch.Tensor,
    kv: tuple,
    grads: tuple,
    qs: slice,
    ks: slice,
    h: object,
    kvh: object,
    piece: object,
) -> None:
    """One kernel call's gradients: ``dq`` (lazy) of query rows ``qs`` / heads ``h``, and ``dk``, ``dv`` of key rows
    ``ks`` / K/V heads ``kvh`` (``grads = (dq, dk, dv)``, ``kv = (k, v)``), accumulated in place."""
    q, out, lse = shard.q, shard.out, shard.lse
    (k, v), (dq, dk, dv) = kv, grads
    dq_piece, dk_piece, dv_piece = attend_backward(
        dout[:, qs, h], q[:, qs, h], k[:, ks, kvh], v[:, ks, kvh], out[:, qs, h], lse[:, qs, h], piece
    )
    add_dq_(dq, qs, h, dq_piece)
    dk[:, ks, kvh] += dk_piece
    dv[:, ks, kvh] += dv_piece
    del dq_piece, dk_piece, dv_piece  # this call's pieces go before the next call's exist


def forward_own_(span: SpanPlan, shard: Shard, opts: Options) -> None:
    """Merge attention among this rank's own runs into the shard's ``out``/``lse`` (in place)."""
    q, k, v, out, lse = shard.q, shard.k, shard.v, shard.out, shard.lse
    for g, group in enumerate(span.groups):
        calls = _head_calls(group.q_heads, _own_heads(group))
        for a, b, diagonal in _pairs(span, g, span.index, opts):
            for h, kvh in calls:
                for qs, ks, piece in _cuts(a, b, b.rows, diagonal, opts):
                    attend_into(q[:, qs, h], k[:, ks, kvh], v[:, ks, kvh], out[:, qs, h], lse[:, qs, h], piece)


def backward_own_(
    span: SpanPlan,
    shard: Shard,
    dout: torch.Tensor,
    dq: LazyGrads,
    dk: torch.Tensor,
    dv: torch.Tensor,
    opts: Options,
) -> None:
    """Accumulate the gradients among this rank's own runs straight into ``dq`` (of ``q``), ``dk``, ``dv``, in calls
    of at most :data:`~ds_ring.kernels.overwrite.BLOCK_ROWS` rows a side (:func:`_tiled`)."""
    k, v = shard.k, shard.v
    if span.ahead:  # an ahead plan's own runs are its forward twin's
        return
    for g, group in enumerate(span.groups):
        calls, own = _head_calls(group.q_heads, _own_heads(group)), _tiled(span.queries[g], overwrite.BLOCK_ROWS)
        for a, b, diagonal in pieces(own, own, opts.causal, opts.window, span.spans):
            for h, kvh in calls:
                for qs, ks, piece in _cuts(a, b, b.rows, diagonal, opts):
                    _backward_piece(shard, dout, (k, v), (dq, dk, dv), qs, ks, h, kvh, piece)


def _tiled(held: Held, most: int) -> Held:
    """``held`` with every run cut into runs of at most ``most`` kept rows. Used where the shard's gradients already
    exist (the own runs come last): a call's pieces and stand-in output are then the only memory that grows with
    it, so smaller calls lower the backward's peak; a tile of a run meets itself as its causal diagonal."""
    runs = []
    for run in held.runs:
        step, first, packed = run.rows.step or 1, run.rows.start or 0, run.packed.start or 0
        for a in range(0, run.count, most):
            b = min(run.count, a + most)
            runs.append(Run(slice(first + a * step, first + b * step, step), slice(packed + a, packed + b),
                            run.segment, run.position + a * step))  # fmt: skip
    return Held(tuple(runs), held.count)


def add_home_grads_(span: SpanPlan, dkv: list[KV], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add this member's own block gradient (home after its trip) into ``dk``/``dv`` ``[B, L, Hkv, D]``."""
    for held, travel, (dkg, dvg) in zip(span.held[span.index], span.travel, dkv, strict=True):
        for run in held.runs:
            add_heads_(dk[:, run.rows], travel.select, dkg[:, run.packed], dim=2)
            add_heads_(dv[:, run.rows], travel.select, dvg[:, run.packed], dim=2)
