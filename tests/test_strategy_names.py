"""Strategies own their rules: outside ``ds_ring/strategies/`` the package names a registered strategy in at most
``LIMIT`` string constants (docstrings aside), so ``config.py``, ``auto`` and the entry points iterate the registry
instead of branching on names. The layers below the strategies (``LOWER``: they never import them) have no strategy
to name: their ``"ring"`` / ``"ulysses"`` are the rank layout's dimensions and operation labels, counted apart.

Counted with ``ast`` (nothing but the registry is imported): 64 such constants in all, 49 outside the lower layers,
before the rules moved into the strategies' modules."""

from __future__ import annotations

import ast

import ds_ring.auto  # noqa: F401  (registers "auto")
from ds_ring.strategies import strategy_names
from tests.test_import_graph import LOWER, PACKAGE, ROOT

LIMIT = 5
EXPECTED = {  # where they are, and why: a name that is the strategy's own, or a placeholder that shares it
    "ds_ring/auto/strategy.py": 1,  # name = "auto"
    "ds_ring/config.py": 1,  # Hugging Face's "auto" placeholder (DeepSpeed drops such values), not a strategy
    "ds_ring/integrations/hf/alst.py": 1,  # ALST's drop-in is Ulysses by definition
}


def _docstrings(tree: ast.Module) -> set[int]:
    """Ids of every string statement (module, class, function and attribute docstrings)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def name_constants(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every string constant of ``source`` in ``names``, docstrings aside."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip)  # fmt: skip


def strategy_name_constants() -> dict[str, list[tuple[int, str]]]:
    """Module path → ``(line, name)`` of every string constant equal to a registered strategy name, outside
    ``ds_ring/strategies/`` and docstrings."""
    names = set(strategy_names())
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith("ds_ring/strategies/") and (hits := name_constants(path.read_text(), names)):
            found[relative] = hits
    return found


def _lower(relative: str) -> bool:
    return relative.removesuffix(".py").replace("/", ".").startswith(LOWER)


def test_strategy_names_stay_in_the_strategies() -> None:
    upper = {path: hits for path, hits in strategy_name_constants().items() if not _lower(path)}
    assert sum(map(len, upper.values())) <= LIMIT, upper
    assert {path: len(hits) for path, hits in upper.items()} == EXPECTED, upper


def test_the_count_sees_names_but_not_docstrings() -> None:
    source = '''"""ring"""
class A:
    """hybrid"""
    x: str = "ring"
    """ulysses"""
    def f(self, s="auto"):
        return {"ulysses": s == "allgather"}
'''
    assert name_constants(source, {"ring", "hybrid", "ulysses", "auto", "allgather"}) == [
        (4, "ring"), (6, "auto"), (7, "allgather"), (7, "ulysses")]  # fmt: skip
