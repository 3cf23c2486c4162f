"""ds_ring's attention entry points under ``torch.compile``: one custom op, ``ds_ring::attention``.

:func:`~ds_ring.sequence_parallel_attention`, :func:`~ds_ring.ring_dilated_attention` (:func:`compilable`) and
:class:`~ds_ring.RingDilatedAttention` hand their call, while the compiler traces it, to ``ds_ring::attention``: the
eager call runs inside the op (its validation, the ranks' agreement, the prepared-call cache and the strategy's
communication as in eager mode) and the compiler sees one node with its outputs' shapes. Its backward
(:func:`ds_ring.compiler.custom_ops.differentiable_op`) runs the call again with autograd and differentiates it.

What reaches the op: ``q``, ``k``, ``v`` and the tensors among the options (``sinks``, ``cu_seqlens``,
``bidirectional_spans``) as inputs; everything else as one ``int`` handle made while tracing (a constant of the
graph): the entry point (a function, or a module that does not stay alive for it), the topology
(:attr:`ds_ring.Topology.compile_handle`) or process group, and the options' values. Options given as Python values
are constants of the graph: other values compile another graph, as any Python argument does.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ds_ring.compiler.custom_ops import differentiable_op, lookup, register
from ds_ring.parallel.topology import Topology

__all__ = ["compilable", "module_handle", "compiled_module_call"]

_TENSORS = ("sinks", "cu_seqlens", "bidirectional_spans")
"""The options that may be tensors: inputs of the op (the order of its arguments)."""


def compilable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an attention function ``fn(q, k, v, ..., return_lse=False, ...)``) as it is in eager mode, and
    through ``ds_ring::attention`` while ``torch.compile`` traces it."""
    signature = inspect.signature(fn)
    names = tuple(signature.parameters)[3:]
    positional = tuple(
        name for name, p in signature.parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    )[3:]
    defaults = {name: p.default for name, p in signature.parameters.items() if p.default is not p.empty}
    target = register(functools.partial(_run_function, fn), key=("function", fn.__qualname__))

    @functools.wraps(fn)
    def entry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(q, k, v, *args, **kwargs)
        options = {**defaults, **{positional[i]: value for i, value in enumerate(args)}, **kwargs}
        if len(args) > len(positional) or not set(kwargs) <= set(names) or not set(names) <= set(options):
            return fn(q, k, v, *args, **kwargs)  # the TypeError eager mode raises, while tracing
        return _call(target, q, k, v, options)

    return entry


def module_handle(module: Any) -> int:
    """A handle for ``module`` (a :class:`~ds_ring.RingDilatedAttention`) that does not keep it alive, taken once
    when it is built; its op runs ``module.eager_forward(q, k, v, return_lse=True, **options)``."""
    return register(_ModuleTarget(weakref.ref(module)))


def compiled_module_call(handle: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> Any:
    """The module of ``handle`` called through ``ds_ring::attention`` (while ``torch.compile`` traces it)."""
    return _call(handle, q, k, v, {"return_lse": False, **options})


class _ModuleTarget:
    def __init__(self, module: weakref.ref) -> None:
        self.module = module

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> Any:
        module = self.module()
        if module is None:
            raise ValueError(
                "a compiled model called a RingDilatedAttention that no longer exists; compile the model again "
                "(torch._dynamo.reset() drops the old graphs)"
            )
        return module.eager_forward(q, k, v, **options)


def _run_function(fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> Any:
    return fn(q, k, v, **options)


def _call(target: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> Any:
    """Traced: the options split into the op's tensor inputs and a handle for the rest."""
    tensors = [options.pop(name, None) if isinstance(options.get(name), torch.Tensor) else None for name in _TENSORS]
    return_lse = options.pop("return_lse", False)
    constants = []
    for name, value in options.items():
        if isinstance(value, torch.Tensor):
            raise ValueError(
                f"ds_ring under torch.compile takes {name} as Python values, not a tensor (only "
                f"{', '.join(_TENSORS)} may be tensors); pass {name} as ints"
            )
        constants.append((name, value.compile_handle if isinstance(value, Topology) else value))
    handle = _call_handle(target, *constants)
    out, lse = torch.ops.ds_ring.attention(q, k, v, *tensors, handle)
    return (out, lse) if return_lse else out


@torch.compiler.assume_constant_result
def _call_handle(target: int, *constants: tuple[str, Any]) -> int:
    """The handle of one call site's target and Python-valued options (called while tracing: a constant)."""
    options = tuple((name, _frozen(value)) for name, value in constants)
    return register((target, options), key=("attention", target, options))


def _frozen(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_frozen(x) for x in value)
    return value


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    spans: torch.Tensor | None,
    handle: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    target, constants = lookup(handle)
    options = {name: _topology(value) if name == "topology" else value for name, value in constants}
    for name, tensor in zip(_TENSORS, (sinks, cu_seqlens, spans), strict=True):
        if tensor is not None:
            options[name] = tensor
    out, lse = lookup(target)(q, k, v, **{**options, "return_lse": True})
    return out, lse


def _topology(handle: int) -> Topology:
    topology = lookup(handle)()
    if topology is None:
        raise ValueError("a compiled model used a ds_ring.Topology that no longer exists; compile it again")
    return topology


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    batch, rows, heads, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((batch, rows, heads, v.shape[-1])), q.new_empty((batch, heads, rows), dtype=lse_dtype)


# q, k, v and the sinks get gradients
differentiable_op(
    "ds_ring::attention",
    "Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? cu_seqlens, Tensor? bidirectional_spans, int handle",
    outputs=2,
    differentiable=4,
    run=_run,
    fake=_fake,
)
