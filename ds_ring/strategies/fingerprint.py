"""What the ranks of an attention call agree on before any of its data moves (DESIGN.md §7).

Every entry point (``ring_dilated_attention``, ``sequence_parallel_attention`` and the strategies'
``*_call`` functions they reach) checks its tensors' structure locally, then calls
:func:`agree_on_call` before it plans or communicates: a rank whose call differs (other shapes,
dtype, branches, flags, layout, strategy, documents) makes every rank raise one ``ValueError``
naming the field and each rank's value, instead of an abort inside the backend, a timeout or a
silently wrong answer. The first call of a plan costs one all-gather of a few integers; later
calls with the same fingerprint only hash it locally (``ds_ring.comm.agree`` caches it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ds_ring.comm.agree import agree

__all__ = ["agree_on_call"]


def agree_on_call(
    op: str,
    group: ProcessGroup | None | Sequence[ProcessGroup | None],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    timeout_s: float | None,
    **options: Any,
) -> None:
    """Collective: ``ValueError`` on every rank of ``group`` unless all of them make this call alike.

    ``q [batch, rows, heads, head_dim]``, ``k``/``v`` ``[batch, rows, kv_heads, head_dim]`` (already
    checked by ``validate_qkv``). Compared: those five sizes, the dtype, the device type, whether a
    backward will follow, and ``options`` (segment_lengths, dilation_rates, causal, scale, layout,
    head_offset, return_lse, cu_seqlens, communication, strategy, as the entry point has them).
    ``group`` may be a sequence of groups gathered in turn (see :func:`ds_ring.comm.agree`).
    """
    batch, rows, heads, head_dim = q.shape
    fields = {
        "batch": batch,
        "rows": rows,
        "heads": heads,
        "kv_heads": k.shape[2],
        "head_dim": head_dim,
        "dtype": q.dtype,
        "device": q.device.type,
        "backward": torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        **options,
    }
    if fields.get("scale") is not None:
        fields["scale"] = float(fields["scale"])  # 1 and 1.0 are the same scale
    agree(fields, group=group, op=op, timeout_s=timeout_s)
