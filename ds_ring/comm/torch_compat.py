"""The torch APIs that differ between the lowest release ds_ring supports (2.6) and the newest it is tested on.

One place for every such difference, each resolved by what the installed release has (never by its version
number), each with the release it starts at:

- the single-tensor collectives: torch 2.13 names them ``all_gather_single`` and ``reduce_scatter_single`` and
  deprecates ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` (a ``FutureWarning`` on every call); before
  2.13 only the old names exist. Same arguments and results.

Differences written around rather than switched on, so one spelling works on every release:

- torch 2.6's ``torch.library.custom_op`` infers no schema from ``X | None`` annotations: ds_ring's ops spell
  theirs out (:func:`ds_ring.compiler.custom_ops.differentiable_op`);
- torch 2.6's compiler does not trace ``next(iterator, default)`` nor an ``import`` inside a traced function
  (2.13's does): the code ``torch.compile`` traces uses neither (``engine/gradient_scale.py``, and
  ``integrations/hf/recurrent.py``'s ``recurrent_supported``: run, not traced, a constant to the compiler).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]


def all_gather_single() -> Callable[..., Any]:
    """``dist.all_gather_single`` (torch 2.13 on), else ``dist.all_gather_into_tensor``: ``(output, input, group=,
    async_op=)``, ``output`` the ``group size × input`` elements in rank order."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single() -> Callable[..., Any]:
    """``dist.reduce_scatter_single`` (torch 2.13 on), else ``dist.reduce_scatter_tensor``: ``(output, input, op=,
    group=, async_op=)``, ``input`` the ``group size × output`` elements in rank order."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
