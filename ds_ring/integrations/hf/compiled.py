"""ds_ring's Hugging Face attention as one custom op, so ``torch.compile(model, fullgraph=True)`` holds it whole.

Under ``torch.compile`` :class:`~ds_ring.integrations.hf.attention.SequenceParallelAttention` checks its module's
features while tracing (plain Python on constants) and hands the rest of the call to ``ds_ring::hf_attention``: the
documents, positions and mask checks, the ranks' agreement, the prepared-call cache and the strategy's
communication all run inside the op, as in eager mode, and the compiler sees one node with a known output shape.
Its backward, ``ds_ring::hf_attention_backward`` (:func:`ds_ring.compiler.custom_ops.differentiable_op`), runs the
same call again with autograd and differentiates it (one more attention forward per layer, its communication
included, its events muted; nothing but the inputs is kept between them).

The call site's settings (module and config names, the mask the model asked for, ``scaling``, ``softcap``) are
constants of the traced call: they reach the op as one ``int`` handle (:mod:`ds_ring.compiler.custom_ops`),
made while tracing.
The documents of a packed batch reach it as the batch's ``cu_seq_lens_q`` tensor when it has one, else as Python ints
(constants of the graph). A batch of other documents may still compile a new graph (docs/hf.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ds_ring.integrations.hf.documents import DOCUMENTS_KEY, Documents
from ds_ring.integrations.hf.masks import MaskSpec
from ds_ring.integrations.internal import differentiable_op, lookup, register

__all__ = ["Site", "compiled_attention", "attention_handle"]


class Site(NamedTuple):
    """What the attention of one call needs of its module and mask: the module's and its config's class names (for
    errors), the :class:`~ds_ring.integrations.hf.masks.MaskSpec` (``None``: a mask tensor or none) and the window."""

    module: str
    config: str
    spec: MaskSpec | None
    window: int | None


def compiled_attention(
    attention: Any,
    site: Site,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None,
    softcap: float | None,
    kwargs: Mapping[str, Any],
) -> torch.Tensor:
    """``attention.attend(...)`` (a :class:`~ds_ring.integrations.hf.attention.SequenceParallelAttention`) through
    ``ds_ring::hf_attention``: ``query [b, heads, s/p, d]``, ``key``/``value``
    ``[b, kv_heads, s/p, d|dv]`` → ``out [b, s/p, heads, dv]`` (contiguous)."""
    spec = site.spec
    handle = _call_handle(
        attention.handle, site.module, site.config, spec is not None, spec is not None and spec.causal,
        None if spec is None else spec.window, None if spec is None else spec.unsupported, site.window, scaling,
        softcap,
    )  # fmt: skip
    # Python-int documents are constants of a graph (a new set: a new graph); the tensor, when the batch has it, is
    # an input (read on the host inside the op, as eager reads it)
    documents = None if kwargs.get("cu_seq_lens_q") is not None else kwargs.get(DOCUMENTS_KEY)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    return torch.ops.ds_ring.hf_attention(
        query, key, value, kwargs.get("s_aux"), kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"),
        kwargs.get("cu_seq_lens_k"), mask, None if documents is None else list(documents.bounds), handle,
    )  # fmt: skip


@torch.compiler.assume_constant_result
def _call_handle(
    attention: int,
    module: str,
    config: str,
    has_spec: bool,
    causal: bool,
    spec_window: int | None,
    unsupported: str | None,
    window: int | None,
    scaling: float | None,
    softcap: float | None,
) -> int:
    """The handle of one call site's settings (called while tracing, its result a constant of the graph)."""
    spec = MaskSpec(causal, spec_window, unsupported) if has_spec else None
    key = ("hf_attention", attention, module, config, spec, window, scaling, softcap)
    return register((attention, Site(module, config, spec, window), scaling, softcap), key)


def attention_handle(attention: Any) -> int:
    """A handle for ``attention`` that does not keep it alive (taken once, when it is built)."""
    return register(weakref.ref(attention))


def _run(
    handle: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
    mask: torch.Tensor | None,
    documents: list[int] | None,
) -> torch.Tensor:
    attention_handle_, site, scaling, softcap = lookup(handle)
    attention = lookup(attention_handle_)()
    if attention is None:
        raise ValueError(
            "a compiled model called ds_ring's attention after its session was closed and dropped; compile the "
            "model again after register_with_transformers (torch._dynamo.reset() drops the old graphs)"
        )
    kwargs: dict[str, Any] = {
        "position_ids": position_ids, "cu_seq_lens_q": cu_seq_lens_q, "cu_seq_lens_k": cu_seq_lens_k, "s_aux": sinks,
    }  # fmt: skip
    kwargs = {name: x for name, x in kwargs.items() if x is not None}
    if documents is not None:
        kwargs[DOCUMENTS_KEY] = Documents(tuple(documents))
    return attention.attend(site, query, key, value, site.spec if mask is None else mask, scaling, softcap, kwargs)


_ARGS = (
    "Tensor query, Tensor key, Tensor value, Tensor? sinks, Tensor? position_ids, Tensor? cu_seq_lens_q, "
    "Tensor? cu_seq_lens_k, Tensor? mask, int[]? documents, int handle"
)


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *rest: Any) -> tuple[torch.Tensor]:
    return (_run(rest[-1], query, key, value, *rest[:-1]),)


def _fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any) -> tuple[torch.Tensor]:
    batch, heads, rows, _ = query.shape
    return (query.new_empty((batch, rows, heads, value.shape[-1])),)


# query, key, value and the sinks get gradients
differentiable_op("ds_ring::hf_attention", _ARGS, outputs=1, differentiable=4, run=_forward, fake=_fake)
