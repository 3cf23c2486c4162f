"""ds_ring's Hugging Face attention as one custom op, so ``torch.compile(model, fullgraph=True)`` holds it whole.

Under ``torch.compile`` :class:`~ds_ring.integrations.hf.attention.SequenceParallelAttention` checks its module's
features while tracing (plain Python on constants) and hands the rest of the call to ``ds_ring::hf_attention``: the
documents, positions and mask checks, the ranks' agreement, the prepared-call cache and the strategy's
communication all run inside the op, as in eager mode, and the compiler sees one node with a known output shape.
Its backward, ``ds_ring::hf_attention_backward``, runs the same call again with autograd and differentiates it
(one more attention forward per layer, its communication included; nothing but the inputs is kept between them).

The call site's settings (module and config names, the mask the model asked for, ``scaling``, ``softcap``) are
constants of the traced call: they reach the op as one ``int`` handle (:mod:`ds_ring.integrations.hf.opaque`),
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
from ds_ring.integrations.hf.opaque import autograd_inside, lookup, register

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


_ARGS = (
    "Tensor query, Tensor key, Tensor value, Tensor? sinks, Tensor? position_ids, Tensor? cu_seq_lens_q, "
    "Tensor? cu_seq_lens_k, Tensor? mask, int[]? documents, int handle"
)  # spelled out: torch 2.6 cannot infer a schema from ``X | None`` annotations


class _Inputs(NamedTuple):
    """The inputs of ``ds_ring::hf_attention``, in its schema's order (:data:`_ARGS`): the shards, the batch's
    tensors the attention reads (``sinks`` is the module's ``s_aux``), a mask tensor (``None``: the site's
    :class:`MaskSpec`), documents as Python ints, and the call site's handle."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    sinks: torch.Tensor | None
    position_ids: torch.Tensor | None
    cu_seq_lens_q: torch.Tensor | None
    cu_seq_lens_k: torch.Tensor | None
    mask: torch.Tensor | None
    documents: list[int] | None
    handle: int


def _run(inputs: _Inputs) -> torch.Tensor:
    attention_handle_, site, scaling, softcap = lookup(inputs.handle)
    attention = lookup(attention_handle_)()
    if attention is None:
        raise ValueError(
            "a compiled model called ds_ring's attention after its session was closed and dropped; compile the "
            "model again after register_with_transformers (torch._dynamo.reset() drops the old graphs)"
        )
    kwargs: dict[str, Any] = {
        "position_ids": inputs.position_ids, "cu_seq_lens_q": inputs.cu_seq_lens_q,
        "cu_seq_lens_k": inputs.cu_seq_lens_k, "s_aux": inputs.sinks,
    }  # fmt: skip
    kwargs = {name: x for name, x in kwargs.items() if x is not None}
    if inputs.documents is not None:
        kwargs[DOCUMENTS_KEY] = Documents(tuple(inputs.documents))
    mask = site.spec if inputs.mask is None else inputs.mask
    return attention.attend(site, inputs.query, inputs.key, inputs.value, mask, scaling, softcap, kwargs)


@torch.library.custom_op("ds_ring::hf_attention", mutates_args=(), schema=f"({_ARGS}) -> Tensor")
def _hf_attention(*inputs: Any) -> torch.Tensor:
    """The attention of :class:`_Inputs` ``inputs``, without autograd (its gradient: :func:`_hf_attention_backward`)."""
    with torch.no_grad():
        out = _run(_Inputs(*inputs))
    return out.contiguous()


@_hf_attention.register_fake
def _hf_attention_fake(query, key, value, sinks, position_ids, cu_seq_lens_q, cu_seq_lens_k, mask, documents, handle):
    batch, heads, rows, _ = query.shape
    return query.new_empty((batch, rows, heads, value.shape[-1]))


_BACKWARD_SCHEMA = f"(Tensor grad, {_ARGS}) -> Tensor[]"


@torch.library.custom_op("ds_ring::hf_attention_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def _hf_attention_backward(grad: torch.Tensor, *inputs: Any) -> list[torch.Tensor]:
    """The gradients of ``query``, ``key``, ``value`` (and ``sinks`` when given) of :class:`_Inputs` ``inputs``: the
    call run again with autograd and differentiated."""
    given = _Inputs(*inputs)
    tensors = [x for x in (given.query, given.key, given.value, given.sinks) if x is not None]
    with autograd_inside():
        leaves = [x.detach().requires_grad_(True) for x in tensors]
        sinks = leaves[3] if given.sinks is not None else None
        out = _run(given._replace(query=leaves[0], key=leaves[1], value=leaves[2], sinks=sinks))
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    # the layout the fake promises: each gradient strided like its input
    pairs = zip(tensors, grads, strict=True)
    return [torch.zeros_like(x) if g is None else torch.empty_like(x).copy_(g) for x, g in pairs]


@_hf_attention_backward.register_fake
def _hf_attention_backward_fake(grad, query, key, value, sinks, *_):
    return [torch.empty_like(x) for x in (query, key, value, sinks) if x is not None]


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    given = _Inputs(*inputs)
    ctx.save_for_backward(*given[:8])  # the tensors
    ctx.documents, ctx.handle = given.documents, given.handle


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    tensors = ctx.saved_tensors
    grads = torch.ops.ds_ring.hf_attention_backward(grad, *tensors, ctx.documents, ctx.handle)
    sinks = tensors[3]
    return grads[0], grads[1], grads[2], grads[3] if sinks is not None else None, *([None] * 6)


_hf_attention.register_autograd(_backward, setup_context=_setup_context)
