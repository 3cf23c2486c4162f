"""The handles and the autograd that ds_ring's ``torch.compile`` custom ops share.

A custom op (``torch.library.custom_op``) takes tensors and plain values only, and the compiler neither traces nor
splits it: ds_ring's attention runs inside one, its communication, agreement and caches as in eager mode. The
objects a call needs (the attention function with its topology, the settings of one call site) reach the op as
an ``int`` handle into a process-wide table (:func:`register` once, :func:`lookup` in the op).

:func:`differentiable_op` defines such an op and its backward: the backward op recomputes the forward with
autograd and differentiates it (:func:`autograd_inside`: a custom op runs below the autograd dispatch keys, so the
autograd graph of ds_ring's ``autograd.Function``\\ s is built only once those keys are let through again). The
recompute emits no events (:func:`ds_ring.hooks.muted`): the step's forward already did; its backward's do.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ds_ring.comm.job import process
from ds_ring.hooks import muted

__all__ = ["register", "lookup", "autograd_inside", "differentiable_op"]

_lock = threading.Lock()


class _Handles:
    """The process's table of handles (owned by its :func:`~ds_ring.comm.job.process` job)."""

    def __init__(self) -> None:
        self.table: dict[int, Any] = {}
        self.keys: dict[Any, int] = {}
        self.counter = itertools.count(1)


def _handles() -> _Handles:
    owner = process()
    return owner.owned(owner, "custom op handles", _Handles)


def register(value: Any, key: Any = None) -> int:
    """The handle of ``value`` (kept for the life of the process); ``key``: a hashable that names it, so the
    same ``key`` gives the same handle (``None``: a new handle every call)."""
    handles = _handles()
    with _lock:
        if key is not None and key in handles.keys:
            return handles.keys[key]
        handle = next(handles.counter)
        handles.table[handle] = value
        if key is not None:
            handles.keys[key] = handle
        return handle


def lookup(handle: int) -> Any:
    """What :func:`register` gave ``handle`` for."""
    return _handles().table[handle]


_AUTOGRAD = (
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor)
)


@contextlib.contextmanager
def autograd_inside() -> Iterator[None]:
    """Grad mode on and the autograd dispatch keys no longer excluded (a custom op's kernel runs with them
    excluded): operations record their graph again. Everything else excluded (autocast, ...) stays excluded."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with (
        torch.enable_grad(),
        torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude - _AUTOGRAD),
    ):
        yield


def differentiable_op(
    name: str,
    args: str,
    outputs: int,
    differentiable: int,
    run: Callable[..., Sequence[torch.Tensor]],
    fake: Callable[..., Sequence[torch.Tensor]],
) -> Callable[..., Any]:
    """The custom op ``name`` (``"ds_ring::..."``) and its backward op ``name + "_backward"``.

    ``args``: the schema's arguments (spelled out: torch 2.6 cannot infer a schema from ``X | None``
    annotations), the first ``differentiable`` of them (optional) floating-point tensors that get gradients.
    ``run(*args)``: the ``outputs`` tensors, differentiable with autograd; ``fake(*args)``: empty tensors of their
    shapes, dtypes and devices. The op returns a tensor (``outputs == 1``) or a tuple, each contiguous.
    """
    returns = "Tensor" if outputs == 1 else f"({', '.join(['Tensor'] * outputs)})"

    def forward(*inputs: Any) -> Any:
        with torch.no_grad():
            got = tuple(x.contiguous() for x in run(*inputs))
        return got[0] if outputs == 1 else got

    def forward_fake(*inputs: Any) -> Any:
        got = tuple(fake(*inputs))
        return got[0] if outputs == 1 else got

    def backward_kernel(grads: list[torch.Tensor], *inputs: Any) -> list[torch.Tensor]:
        wanted = [x for x in inputs[:differentiable] if x is not None]
        with autograd_inside():
            leaves = iter([x.detach().requires_grad_(True) for x in wanted])
            again = [next(leaves) if x is not None else None for x in inputs[:differentiable]]
            with muted():  # the forward's events were emitted by the forward op; the backward's are emitted below
                got = run(*again, *inputs[differentiable:])
            pairs = [(out, grad) for out, grad in zip(got, grads, strict=True) if out.requires_grad]
            leaf_list = [x for x in again if x is not None]
            found = torch.autograd.grad([o for o, _ in pairs], leaf_list, [g for _, g in pairs], allow_unused=True)
        # the layout the fake promises: each gradient strided like its input
        pairs_in = zip(wanted, found, strict=True)
        return [torch.zeros_like(x) if g is None else torch.empty_like(x).copy_(g) for x, g in pairs_in]

    def backward_fake(grads: list[torch.Tensor], *inputs: Any) -> list[torch.Tensor]:
        return [torch.empty_like(x) for x in inputs[:differentiable] if x is not None]

    op = torch.library.custom_op(name, forward, mutates_args=(), schema=f"({args}) -> {returns}")
    op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(
        f"{name}_backward", backward_kernel, mutates_args=(), schema=f"(Tensor[] grads, {args}) -> Tensor[]"
    )
    backward_op.register_fake(backward_fake)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.tensors = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensors))
        ctx.others = [None if isinstance(x, torch.Tensor) else x for x in inputs]

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        inputs = list(ctx.others)
        for i, x in zip(ctx.tensors, ctx.saved_tensors, strict=True):
            inputs[i] = x
        found = iter(backward_op(list(grads), *inputs))
        present = [i < differentiable and x is not None for i, x in enumerate(inputs)]
        return tuple(next(found) if p else None for p in present)

    op.register_autograd(backward, setup_context=setup_context)
    return op
