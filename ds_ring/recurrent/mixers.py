"""The sequence-mixing kernels of state-space layers, run on a shard: each segment by the layer's own code.

Each function takes what transformers' function of the same role takes, plus the shard's :class:`ShardPieces`, the
group and the layer's own implementation (``run``: its torch fallback or kernel). ``run`` computes every segment
from a zero state and returns its end state; what is written here is only the decay of a segment (from the same
``dt`` and ``A`` the layer discretises with) and the carried state's contribution to the outputs.

* :func:`ssd_scan`: Mamba2's state-space duality scan (Mamba2, Bamba, Falcon-H1, Granite-MoE-hybrid, Nemotron-H,
  Zamba2): one decay ``exp(A_h dt_t)`` per head.
* :func:`selective_scan`: Mamba1's selective scan (Mamba, Falcon-Mamba, Jamba): an elementwise decay
  ``exp(A[d, n] dt[d, t])``.
* :func:`delta_rule_scan`: the gated delta rule (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear, ...): a matrix
  per step, ``(I - β_t k_t k_tᵀ) diag(e^{g_t})``, whose product over a segment comes out of the same ``run``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ds_ring.recurrent.pieces import ShardPieces
from ds_ring.recurrent.scan import SegmentScan, run_chunks

__all__ = ["ssd_scan", "selective_scan", "delta_rule_scan"]


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

        return SegmentScan(output, final, torch.exp(cumulative[:, -1])[:, :, None, None], correct)

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

        return SegmentScan(output, final, torch.exp(cumulative[:, :, -1]), correct)

    return run_chunks(pieces, segment, group, time_dim=2, op="recurrent_selective", timeout_s=timeout_s)


def delta_rule_scan(
    run: Callable[..., Any],
    pieces: ShardPieces,
    group: ProcessGroup | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    timeout_s: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The gated delta rule over this rank's shard, exact over the whole sequence.

    Per value head the state ``S [d_k, d_v]`` steps as ``S_t = M_t S_{t-1} + β_t k_t v_tᵀ`` with
    ``M_t = (I - β_t k_t k_tᵀ) diag(e^{g_t})`` (``g_t`` one log decay per head, or per key channel: Kimi's), and
    ``o_t = S_tᵀ q_t``. A segment's transition is the product
    ``P = M_e ⋯ M_b`` and a state ``S_in`` entering it adds ``S_inᵀ P_{b..t}ᵀ q_t`` to ``o_t``. Both come from one
    call of ``run``: its values widened by ``d_k`` zero columns and its initial state by an identity, those columns
    carry ``P_{b..t}`` (their end state is ``P``, their outputs ``P_{b..t}ᵀ q_t``), with ``q`` and ``k`` normalised
    and scaled by ``run`` itself.

    Args:
        query, key: ``[b, t, k_heads, d_k]``; value: ``[b, t, v_heads, d_v]``; g (log decay): ``[b, t, v_heads]``
            or ``[b, t, v_heads, d_k]``; beta: ``[b, t, v_heads]``; the rest as transformers'
            ``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention`` (which ``run`` is).
    Returns:
        ``[b, t, v_heads, d_v]``, what ``run`` outputs for the whole sequence, this rank's tokens.
    """
    batch, _, heads, d_v = value.shape
    d_k = key.shape[-1]
    eye = torch.eye(d_k, dtype=torch.promote_types(value.dtype, torch.float32), device=value.device)
    initial = torch.cat([eye.new_zeros(batch, heads, d_k, d_v), eye.expand(batch, heads, d_k, d_k)], dim=-1)

    def segment(start: int, stop: int) -> SegmentScan:
        values = value[:, start:stop]
        widened = torch.cat([values, values.new_zeros(*values.shape[:-1], d_k)], dim=-1)
        out, final = run(
            query[:, start:stop], key[:, start:stop], widened, g=g[:, start:stop], beta=beta[:, start:stop],
            initial_state=initial, output_final_state=True, **kwargs,
        )  # fmt: skip
        output, probes = out.split([d_v, d_k], dim=-1)  # probes [b, s, heads, d_k]: P_{b..t}ᵀ q_t
        state, transition = final.split([d_v, d_k], dim=-1)

        def correct(h_in: torch.Tensor) -> torch.Tensor:  # h_in [b, heads, d_k, d_v]
            return torch.einsum("bshk,bhkv->bshv", probes.to(h_in.dtype), h_in)

        return SegmentScan(output, state, transition, correct)

    return run_chunks(pieces, segment, group, time_dim=1, op="recurrent_delta", apply=torch.matmul, timeout_s=timeout_s)
