"""Implementations chosen by name: the table behind ``strategy=`` and ``communication=``.

Pure bookkeeping (no torch, no other ds_ring module), so every layer may hold one.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Implementations selectable as ``<what>=name``, in registration order.

    ``entries`` is the table itself (tests may patch it); an unknown name raises ``ValueError``
    ``"<what> must be one of [sorted names], got 'name'"``.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.entries: dict[str, T] = {}

    def register(self, name: str, item: T) -> None:
        """Make ``item`` selectable as ``<what>=name`` (replacing whatever was registered under it)."""
        self.entries[name] = item

    def names(self) -> tuple[str, ...]:
        """Names registered, in registration order."""
        return tuple(self.entries)

    def get(self, name: str) -> T:
        """The item registered as ``name``; ``ValueError`` listing the choices otherwise."""
        try:
            return self.entries[name]
        except KeyError:
            raise ValueError(f"{self.what} must be one of {sorted(self.entries)}, got {name!r}") from None

    def name_of(self, item: T, default: str) -> str:
        """The name ``item`` is registered under (the first, if several), else ``default``."""
        return next((name for name, known in self.entries.items() if known is item), default)
