"""K/V blocks of a span: packing for transport, and the compute of one visiting block.

A member's *block* for a spanning branch is the kept (dilated) K/V rows of its runs that another
member attends to, for every head group, with only the K/V heads that group needs (GQA heads travel
as they are), packed K-then-V into one contiguous 1-D buffer so a single send moves it. Sizes differ
between members (dilation offsets, documents); every member computes every other's size from the
plan, so nothing is padded. A rank's own runs meet each other straight from its ``k``/``v``
(:func:`forward_own_`), never through its block.

The gradient of a block (dK, dV) uses the same packing in the accumulation dtype: the travelling
accumulator of the ring backward, or a contribution to the all-gather's reduce-scatter.
"""

from __future__ import annotations

import torch

from ds_ring.kernels.dilated import attend_backward, attend_into
from ds_ring.kernels.dilation import add_heads_, select_heads
from ds_ring.kernels.merge import accum_dtype
from ds_ring.strategies.plan import SpanPlan, pieces

__all__ = [
    "pack_block",
    "unpack_block",
    "new_grad_block",
    "forward_block_",
    "backward_block_",
    "forward_own_",
    "backward_own_",
    "add_home_grads_",
    "block_has_work",
]

KV = tuple[torch.Tensor, torch.Tensor]


def pack_block(span: SpanPlan, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """This member's block: kept rows and travelling heads of ``k``/``v`` ``[B, L, Hkv, D]``, flat.

    Per head group the runs are laid side by side along the rows (``[B, count, heads, D]``).
    """
    parts = []
    for x in (k, v):
        for held, travel in zip(span.held[span.index], span.travel, strict=True):
            runs = [select_heads(x[:, run.rows], travel.select) for run in held.runs]
            if runs:
                parts.append((runs[0] if len(runs) == 1 else torch.cat(runs, dim=1)).reshape(-1))
    return torch.cat(parts) if parts else k.new_empty(0)


def unpack_block(span: SpanPlan, member: int, flat: torch.Tensor, batch: int, head_dim: int) -> list[KV]:
    """Views ``(k_g, v_g)`` ``[B, rows, travelled heads, D]`` per head group into member's flat block."""
    shapes = [
        (batch, held.count, travel.num_heads, head_dim)
        for held, travel in zip(span.held[member], span.travel, strict=True)
    ]
    sizes = [b * m * h * d for b, m, h, d in shapes]
    parts = flat.split(sizes + sizes)
    n = len(shapes)
    return [(parts[g].view(shapes[g]), parts[n + g].view(shapes[g])) for g in range(n)]


def new_grad_block(span: SpanPlan, member: int, like: torch.Tensor, batch: int, head_dim: int) -> torch.Tensor:
    """A zero gradient block for member's K/V, flat, in the accumulation dtype of ``like``."""
    numel = span.block_numel(member, batch, head_dim)
    return torch.zeros(numel, dtype=accum_dtype(like.dtype), device=like.device)


def _expand(x: torch.Tensor, span: SpanPlan, g: int) -> torch.Tensor:
    expand = span.travel[g].expand
    return x if expand is None else x.index_select(2, expand)


def block_has_work(span: SpanPlan, member: int, causal: bool) -> bool:
    """Whether this rank's queries attend to any key of member's block (its own runs for itself)."""
    keys = span.queries if member == span.index else span.held[member]
    return any(pieces(mine, theirs, causal) for mine, theirs in zip(span.queries, keys, strict=True))


def forward_block_(
    span: SpanPlan,
    member: int,
    kv: list[KV],
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
) -> None:
    """Merge attention of local ``q [B, L, H, D]`` over another member's block into ``out``/``lse`` (in place)."""
    for g, group in enumerate(span.groups):
        work = pieces(span.queries[g], span.held[member][g], causal)
        if not work:
            continue
        h = group.q_heads
        kg, vg = (_expand(x, span, g) for x in kv[g])
        for a, b, _ in work:
            ks = b.packed
            attend_into(
                q[:, a.rows, h], kg[:, ks], vg[:, ks], out[:, a.rows, h], lse[:, a.rows, h], causal=False, scale=scale
            )


def backward_block_(
    span: SpanPlan,
    member: int,
    kv: list[KV],
    dkv: list[KV],
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
) -> None:
    """Accumulate the gradient of another member's block into ``dq [B, L, H, D]`` and its ``dkv`` views."""
    for g, group in enumerate(span.groups):
        work = pieces(span.queries[g], span.held[member][g], causal)
        if not work:
            continue
        h = group.q_heads
        kg, vg = (_expand(x, span, g) for x in kv[g])
        dkg, dvg = dkv[g]
        expand = span.travel[g].expand
        for a, b, _ in work:
            qs, ks = a.rows, b.packed
            dq_piece, dk_piece, dv_piece = attend_backward(
                dout[:, qs, h], q[:, qs, h], kg[:, ks], vg[:, ks], out[:, qs, h], lse[:, qs, h],
                causal=False, scale=scale,
            )  # fmt: skip
            dq[:, qs, h] += dq_piece
            if expand is None:
                dkg[:, ks] += dk_piece
                dvg[:, ks] += dv_piece
            else:
                dkg[:, ks].index_add_(2, expand, dk_piece.to(dkg.dtype))
                dvg[:, ks].index_add_(2, expand, dv_piece.to(dvg.dtype))


def forward_own_(
    span: SpanPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
) -> None:
    """Merge attention among this rank's own runs (``q [B, L, H, D]``, ``k``/``v`` ``[B, L, Hkv, D]``)."""
    for g, group in enumerate(span.groups):
        h, kv_heads = group.q_heads, group.kv_heads
        for a, b, diagonal in pieces(span.queries[g], span.queries[g], causal):
            attend_into(
                q[:, a.rows, h], select_heads(k[:, b.rows], kv_heads), select_heads(v[:, b.rows], kv_heads),
                out[:, a.rows, h], lse[:, a.rows, h], causal=diagonal, scale=scale,
            )  # fmt: skip


def backward_own_(
    span: SpanPlan,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
) -> None:
    """Accumulate the gradients among this rank's own runs straight into ``dq``, ``dk``, ``dv``."""
    for g, group in enumerate(span.groups):
        h, kv_heads = group.q_heads, group.kv_heads
        for a, b, diagonal in pieces(span.queries[g], span.queries[g], causal):
            qs, ks = a.rows, b.rows
            dq_piece, dk_piece, dv_piece = attend_backward(
                dout[:, qs, h], q[:, qs, h], select_heads(k[:, ks], kv_heads), select_heads(v[:, ks], kv_heads),
                out[:, qs, h], lse[:, qs, h], causal=diagonal, scale=scale,
            )  # fmt: skip
            dq[:, qs, h] += dq_piece
            add_heads_(dk[:, ks], kv_heads, dk_piece)
            add_heads_(dv[:, ks], kv_heads, dv_piece)


def add_home_grads_(span: SpanPlan, dkv: list[KV], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add this member's own block gradient (home after its trip) into ``dk``/``dv`` ``[B, L, Hkv, D]``."""
    for held, travel, (dkg, dvg) in zip(span.held[span.index], span.travel, dkv, strict=True):
        for run in held.runs:
            add_heads_(dk[:, run.rows], travel.select, dkg[:, run.packed], dim=2)
            add_heads_(dv[:, run.rows], travel.select, dvg[:, run.packed], dim=2)
