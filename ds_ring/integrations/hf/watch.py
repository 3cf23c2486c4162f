"""Hooks around a registered model instance's forward, for what must know the batch while the model runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["ForwardWatch"]


class ForwardWatch(ABC):
    """Hooks around the registered model instance's forward: ``_enter(module, args, kwargs)`` before it runs,
    ``_leave(module, args, output)`` after it (also when it raised); :meth:`remove` takes both off."""

    def __init__(self, model: nn.Module) -> None:
        self._handles = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @abstractmethod
    def _enter(self, _module: nn.Module, _args: tuple, kwargs: Mapping[str, Any]) -> None: ...

    @abstractmethod
    def _leave(self, _module: nn.Module, _args: Any, _out: Any) -> None: ...
