"""The old name of :mod:`ds_ring.auto.cli` (``python -m ds_ring.plan`` is now ``python -m ds_ring.auto``): kept so
that scripts written against it keep working; it says the new name on stderr."""

from ds_ring.auto.cli import main, problem_from_args

__all__ = ["main", "problem_from_args"]
