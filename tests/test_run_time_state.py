"""One owner for run-time state (docs/design.md §Layout): the module-level names of ``ds_ring`` that its functions
change at run time are the registries and the job registry, nothing else; everything else a run learns or prepares
(hosts, CPU places, prepared calls, agreed calls, probed links, ``auto``'s decisions, control twins, exit flushes,
the CPU heap setting, the interruptible waits' helper) is held by a :class:`ds_ring.comm.job.Job`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds_ring"

MUTATORS = frozenset(
    {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "insert", "remove", "discard",
     "move_to_end", "appendleft", "register"}
)  # fmt: skip
"""Methods that change the object they are called on (``register``: a :class:`ds_ring.strategies.registry.Registry`)."""

EXPECTED = {
    "ds_ring/comm/job.py": {"_JOBS"},  # the jobs of this process (one per default process group)
    "ds_ring/hooks.py": {"_HOOKS"},  # the registry of hooks
    "ds_ring/strategies/registry.py": {"PLUGINS"},  # the registry of plug-ins: strategies and K/V exchanges
}


def _root(node: ast.expr) -> str | None:
    """``name`` of ``name``, ``name.attr``, ``name[i].attr``...: the module-level object an expression reaches."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _thread_local(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and ast.unparse(value.func) in ("threading.local", "local")


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound at module level by an assignment (a ``threading.local()`` left out)."""
    bound = [n for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign) and not _thread_local(n.value)]
    return {t.id for node in bound for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)}  # fmt: skip


def _writes(tree: ast.Module) -> tuple[set[str], set[str]]:
    """``(rebound, changed)``: the names functions of ``tree`` rebind through ``global``, and the names whose
    object they change in place (assign an item or attribute of, delete one, call a :data:`MUTATORS` method on),
    each function's parameters left out."""
    rebound_all: set[str] = set()
    changed_all: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        args = fn.args
        local = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        rebound = {name for node in ast.walk(fn) if isinstance(node, ast.Global) for name in node.names}
        changed: set[str | None] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id in rebound:
                        rebound_all.add(target.id)
                    elif isinstance(target, ast.Attribute | ast.Subscript):
                        changed.add(_root(target))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                changed.add(_root(node.func.value))
        changed_all |= {name for name in changed if name is not None} - (local - rebound)
    return rebound_all, changed_all


def changed_at_run_time(source: str) -> set[str]:
    """Module-level names that a function of ``source`` rebinds (``global``) or changes in place: assigns an item
    or an attribute of, deletes one, or calls a mutating method (:data:`MUTATORS`) on (or on an attribute of).
    A ``threading.local()`` is left out: each thread's own values, not the process's."""
    tree = ast.parse(source)
    rebound, changed = _writes(tree)
    return rebound | (changed & _module_names(tree))


def _imported(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """``alias -> (module, name)`` for each ``from ds_ring.<module> import name [as alias]`` in ``tree``."""
    found = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0]
    return {alias.asname or alias.name: (node.module or "", alias.name)
            for node in found if (node.module or "").startswith("ds_ring") for alias in node.names}  # fmt: skip


def count_sources(sources: dict[str, str]) -> dict[str, set[str]]:
    """Per module (dotted name -> source), the names :func:`changed_at_run_time` finds, plus the module-level
    names of a module that another module changes in place through ``from <module> import name`` (counted
    where they are defined). Not followed: re-exports, and writes through ``import <module>``'s attributes."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    found = {module: changed_at_run_time(source) for module, source in sources.items()}
    for tree in trees.values():
        changed = _writes(tree)[1]
        for alias, (module, name) in _imported(tree).items():
            if alias in changed and module in trees and name in _module_names(trees[module]):
                found[module].add(name)
    return {module: names for module, names in found.items() if names}


def count(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Per file of ``package`` (relative to its parent), the names :func:`count_sources` finds."""
    paths = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    found = count_sources({module: path.read_text() for module, path in paths.items()})
    return {str(paths[module].relative_to(package.parent)): names for module, names in found.items()}


def test_module_state_is_the_registries_and_the_jobs() -> None:
    found = count()
    assert found == EXPECTED, f"module-level names changed at run time: {found}; give new state an owner (a Job)"
    assert sum(map(len, found.values())) == 3


def test_the_counter_sees_every_kind_of_change() -> None:
    source = """
_a = {}
_b = []
_c = None
_d = Thing()
_e = Registry()
_kept = {}
_mine = threading.local()
def f(x):
    global _c
    _a[x] = 1
    _b.append(x)
    _c = x
    _d.attr = x
    _e.register(x, x)
    _kept.get(x)
    _mine.labels = x
    local = {}
    local[x] = 1
"""
    assert changed_at_run_time(source) == {"_a", "_b", "_c", "_d", "_e"}


def test_the_counter_sees_a_change_through_an_import() -> None:
    sources = {
        "ds_ring.table": "TABLE = Registry()\nNAMES = ()\n",
        "ds_ring.user": (
            "from ds_ring.table import NAMES, TABLE as t\ndef f(x):\n    t.register(x, x)\n    NAMES.index(x)"
        ),
    }
    assert count_sources(sources) == {"ds_ring.table": {"TABLE"}}
