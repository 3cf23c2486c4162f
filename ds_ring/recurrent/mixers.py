"""The sequence-mixing kernels of state-space layers, run on a shard: each segment by the layer's own code.

Each function takes what transformers' function of the same role takes, plus the shard's :class:`ShardPieces`, the
group and the layer's own implementation (``run``: its torch fallback or kernel). ``run`` computes every segment
from a zero state and returns its end state; what is written here is only the decay of a segment (from the same
``dt`` and ``A`` the layer discretises with) and the carried state's contribution to the outputs.

* :func:`ssd_scan`: Mamba2's state-space duality scan (Mamba2, Bamba, Falcon-H1, Granite-MoE-hybrid, Nemotron-H,
  Zamba2): one decay ``exp(A_h dt_t)`` per head.
* :func:`selective_scan`: Mamba1's selective scan (Mamba, Falcon-Mamba, Jamba): an elementwise decay
  ``exp(A[d, n] dt[d, t])``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ds_ring.recurrent.pieces import ShardPieces
from ds_ring.recurrent.scan import SegmentScan, run_chunks

__all__ = ["ssd_scan", "selective_scan"]


def ssd_scan(
    run: Callable[..., Any],
    pieces: ShardPieces,
    group: ProcessGroup | None,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    timeout_s: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Mamba2's chunked scan of this rank's shard, exact over the whole sequence.

    Args:
        hidden_states: ``[b, t, heads, d_head]``; dt: ``[b, t, heads]`` (before ``dt_bias``, softplus, clamp);
        A: ``[heads]``; B, C: ``[b, t, groups, d_state]``; the rest as transformers' ``mamba2_chunk_scan``.
    Returns:
        ``[b, t, heads, d_head]``, what ``run`` returns for the whole sequence, this rank's tokens.
    """
    heads = hidden_states.shape[2]
    step = dt + dt_bias.to(dt.dtype) if dt_bias is not None else dt
    if dt_softplus:
        step = F.softplus(step)
    step = torch.clamp(step, min=dt_limit[0], max=dt_limit[1])
    log_decay = A.to(torch.float32) * step.float()  # [b, t, heads], as the layer discretises
    C_heads = C.float().repeat_interleave(heads // C.shape[2], dim=2, output_size=heads)

    def segment(start: int, stop: int) -> SegmentScan:
        output, final = run(
            hidden_states[:, start:stop], dt[:, start:stop], A, B[:, start:stop], C[:, start:stop],
            chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
            return_final_states=True, **kwargs,
        )  # fmt: skip
        cumulative = torch.cumsum(log_decay[:, start:stop], dim=1)  # [b, s, heads]

        def correct(h_in: torch.Tensor) -> torch.Tensor:  # h_in [b, heads, d_head, d_state]
            carried = torch.einsum("bshn,bhpn->bshp", C_heads[:, start:stop], h_in.to(C_heads.dtype))
            return carried * torch.exp(cumulative)[..., None]

        return SegmentScan(output, final, cumulative[:, -1][:, :, None, None], correct)

    return run_chunks(pieces, segment, group, time_dim=1, op="recurrent_ssd", timeout_s=timeout_s)


def selective_scan(
    run: Callable[..., Any],
    pieces: ShardPieces,
    group: ProcessGroup | None,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Mamba1's selective scan of this rank's shard, exact over the whole sequence.

    Args:
        hidden_states: ``[b, d, t]``; dt: ``[b, d, t]`` (before ``delta_bias`` and softplus); A: ``[d, n]``;
        B, C: ``[b, n, t]``; D: ``[d]``; z: ``[b, d, t]`` (the gate); as transformers' ``mamba_selective_scan``.
    Returns:
        ``[b, d, t]``: ``(C·h + D x) ⊙ silu(z)``, this rank's tokens.
    """
    step = dt + delta_bias.to(dt.dtype)[..., None] if delta_bias is not None else dt
    if delta_softplus:
        step = F.softplus(step)
    log_decay = A[None, :, None, :] * step[..., None]  # [b, d, t, n], as the layer discretises
    gate = F.silu(z) if z is not None else None

    def segment(start: int, stop: int) -> SegmentScan:
        output, final = run(
            hidden_states[..., start:stop], dt[..., start:stop], A, B[..., start:stop], C[..., start:stop], D=D,
            z=None if z is None else z[..., start:stop], delta_bias=delta_bias, delta_softplus=delta_softplus,
            return_last_state=True, **kwargs,
        )  # fmt: skip
        cumulative = torch.cumsum(log_decay[:, :, start:stop], dim=2)  # [b, d, s, n]

        def correct(h_in: torch.Tensor) -> torch.Tensor:  # h_in [b, d, n]
            carried = torch.exp(cumulative) * h_in[:, :, None, :].to(cumulative.dtype)
            out = torch.einsum("bdsn,bns->bds", carried, C[..., start:stop].to(carried.dtype))
            return out * gate[..., start:stop] if gate is not None else out

        return SegmentScan(output, final, cumulative[:, :, -1], correct)

    return run_chunks(pieces, segment, group, time_dim=2, op="recurrent_selective", timeout_s=timeout_s)
