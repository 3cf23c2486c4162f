"""K/V blocks of a span: packing for transport, and the compute of one visiting block.

A member's *block* for a spanning branch is its kept (dilated) K/V rows of every head group, with
only the K/V heads that group needs (GQA heads travel as they are), packed K-then-V into one
contiguous 1-D buffer so a single send moves it. Sizes differ between members when the dilation
offsets fall differently on their shards; every member computes every other's size from the plan,
so nothing is padded.

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
    """Whether this rank's queries attend to any key of member's block."""
    return any(
        pieces(mine, theirs, causal) for mine, theirs in zip(span.held[span.index], span.held[member], strict=True)
    )


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
    """Merge attention of local ``q [B, L, H, D]`` over member's block into ``out``/``lse`` (in place)."""
    for g, group in enumerate(span.groups):
        work = pieces(span.held[span.index][g], span.held[member][g], causal)
        if not work:
            continue
        heads = group.q_heads
        kg, vg = (_expand(x, span, g) for x in kv[g])
        for qs, ks, diagonal in work:
            attend_into(
                q[:, qs, heads],
                kg[:, ks],
                vg[:, ks],
                out[:, qs, heads],
                lse[:, qs, heads],
                causal=diagonal,
                scale=scale,
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
    """Accumulate the gradient of member's block into ``dq [B, L, H, D]`` and its ``dkv`` views."""
    for g, group in enumerate(span.groups):
        work = pieces(span.held[span.index][g], span.held[member][g], causal)
        if not work:
            continue
        h = group.q_heads
        kg, vg = (_expand(x, span, g) for x in kv[g])
        dkg, dvg = dkv[g]
        expand = span.travel[g].expand
        for qs, ks, diagonal in work:
            dq_piece, dk_piece, dv_piece = attend_backward(
                dout[:, qs, h], q[:, qs, h], kg[:, ks], vg[:, ks], out[:, qs, h], lse[:, qs, h],
                causal=diagonal, scale=scale,
            )  # fmt: skip
            dq[:, qs, h] += dq_piece
            if expand is None:
                dkg[:, ks] += dk_piece
                dvg[:, ks] += dv_piece
            else:
                dkg[:, ks].index_add_(2, expand, dk_piece.to(dkg.dtype))
                dvg[:, ks].index_add_(2, expand, dv_piece.to(dvg.dtype))


def add_home_grads_(span: SpanPlan, dkv: list[KV], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add this member's own block gradient (home after its trip) into ``dk``/``dv`` ``[B, L, Hkv, D]``."""
    for held, travel, (dkg, dvg) in zip(span.held[span.index], span.travel, dkv, strict=True):
        for run in held.runs:
            add_heads_(dk[:, run.rows], travel.select, dkg[:, run.packed], dim=2)
            add_heads_(dv[:, run.rows], travel.select, dvg[:, run.packed], dim=2)
