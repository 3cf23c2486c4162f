"""Layer labels: events emitted inside an attention module carry its name (``labels["layer"]``)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ds_ring.attention import RingDilatedAttention
from ds_ring.hooks import pop_labels, push_labels

__all__ = ["label_layers"]


def label_layers(model: nn.Module) -> list[RemovableHandle]:
    """Label every :class:`~ds_ring.RingDilatedAttention` of ``model`` with its name in ``model``.

    Returns the module-hook handles (``handle.remove()`` undoes it).
    """
    handles: list[RemovableHandle] = []
    for name, module in model.named_modules():
        if isinstance(module, RingDilatedAttention):
            handles.extend(_label(module, name or type(module).__name__))
    return handles


def _label(module: nn.Module, name: str) -> list[RemovableHandle]:
    tokens: list[Any] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        tokens.append(push_labels(layer=name))

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        if tokens:
            pop_labels(tokens.pop())

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
