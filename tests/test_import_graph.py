"""The import graph of ds_ring: no cycles among modules, and the lower layers never import the upper ones.

Built from the source with ``ast`` (nothing is imported): an edge for every ``import`` at module level
(``if TYPE_CHECKING:`` blocks and imports inside functions excluded). ``from ds_ring.a import b`` is an
edge to ``ds_ring.a.b`` when that is a module, else to ``ds_ring.a``. Importing a module also runs its
packages' ``__init__``; those implicit edges are left out (``ds_ring/__init__`` imports the whole API).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ds_ring"
LOWER = ("ds_ring.parallel", "ds_ring.comm", "ds_ring.kernels")
UPPER = ("ds_ring.strategies", "ds_ring.integrations")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _type_checking(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and not _type_checking(node):
            found += _module_level(node.body) + _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            found += _module_level(node.body) + _module_level(node.orelse) + _module_level(node.finalbody)
            for handler in node.handlers:
                found += _module_level(handler.body)
    return found


def _everywhere(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def import_graph(everywhere: bool = False) -> dict[str, set[str]]:
    """Module → the ds_ring modules it imports at module level (``everywhere``: also inside functions and
    ``if TYPE_CHECKING:`` blocks, the imports that hide a cycle from the interpreter but not from a reader)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node in _everywhere(tree) if everywhere else _module_level(tree.body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_no_cycles_through_deferred_imports() -> None:
    assert cycles(import_graph(everywhere=True)) == []


def test_lower_layers_never_import_strategies_or_integrations() -> None:
    graph = import_graph(everywhere=True)
    upward = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith(LOWER)
        for target in targets
        if target.startswith(UPPER)
    )
    assert upward == []


def test_strategies_never_import_auto() -> None:
    """``auto`` ranks what every registered strategy offers, so it sits above them and registers itself."""
    graph = import_graph(everywhere=True)
    upward = sorted((m, t) for m, ts in graph.items() if m.startswith("ds_ring.strategies") for t in ts
                    if t.startswith("ds_ring.auto"))  # fmt: skip
    assert upward == []


def test_the_graph_sees_known_edges() -> None:
    graph = import_graph()
    assert "ds_ring.comm.collectives" in graph["ds_ring.comm.agree"]
    assert "ds_ring.parallel.topology" in graph["ds_ring.parallel.order"]


def test_integrations_import_the_public_api_and_the_declared_interface() -> None:
    """An integration imports ``ds_ring`` (the public API), other integration modules and the one declared internal
    interface, ``ds_ring.integrations.internal`` (which imports what it declares from where it lives)."""
    graph = import_graph(everywhere=True)
    beyond = sorted(
        (module, target)
        for module, targets in graph.items()
        if module.startswith("ds_ring.integrations") and module != "ds_ring.integrations.internal"
        for target in targets
        if target != "ds_ring" and not target.startswith("ds_ring.integrations")
    )
    assert beyond == []
