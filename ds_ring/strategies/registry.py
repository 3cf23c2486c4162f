"""Implementations chosen by name: the one table behind ``strategy=`` and ``communication=``.

:data:`PLUGINS` is that table for the process: the strategies, and the K/V exchanges that a strategy's ring
dimension moves blocks with (an exchange is a strategy's plug-in, so it is registered beside them). Pure
bookkeeping (no torch, no other ds_ring module), so every layer may read it; :mod:`ds_ring.strategies.base` and
:mod:`ds_ring.strategies.sharded` write it through their ``register_*`` functions.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["PLUGINS", "Plugins", "Registry"]

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


class Plugins:
    """The registries of the process, one per kind of plug-in: :attr:`strategies` (``strategy=``, holding
    :class:`~ds_ring.strategies.base.Strategy` objects) and :attr:`exchanges` (``communication=``, holding
    :class:`~ds_ring.strategies.sharded.Exchange` objects); each is typed where it is read."""

    def __init__(self) -> None:
        self.strategies: Registry[Any] = Registry("strategy")
        self.exchanges: Registry[Any] = Registry("communication")


PLUGINS = Plugins()
"""ds_ring's one registry of plug-ins (``tests/test_run_time_state.py``: one of the three names changed at run time)."""
