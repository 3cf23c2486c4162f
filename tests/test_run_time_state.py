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
    "ds_ring/strategies/base.py": {"_STRATEGIES"},  # the registry of strategies
    "ds_ring/strategies/sharded.py": {"_REGISTRY"},  # the registry of K/V exchanges
}


def _root(node: ast.expr) -> str | None:
    """``name`` of ``name``, ``name.attr``, ``name[i].attr``...: the module-level object an expression reaches."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _thread_local(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and ast.unparse(value.func) in ("threading.local", "local")


def changed_at_run_time(source: str) -> set[str]:
    """Module-level names that a function of ``source`` rebinds (``global``) or changes in place: assigns an item
    or an attribute of, deletes one, or calls a mutating method (:data:`MUTATORS`) on (or on an attribute of).
    A ``threading.local()`` is left out: each thread's own values, not the process's."""
    tree = ast.parse(source)
    bound = [n for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign) and not _thread_local(n.value)]
    top = {t.id for node in bound for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(t, ast.Name)}  # fmt: skip
    found: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        args = fn.args
        local = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
        rebound = {name for node in ast.walk(fn) if isinstance(node, ast.Global) for name in node.names}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id in rebound:
                        found.add(target.id)
                    elif isinstance(target, ast.Attribute | ast.Subscript) and (name := _root(target)) in top:
                        found.add(name)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                found.add(_root(node.func.value)) if _root(node.func.value) in top else None
        found -= local - rebound
    return found


def count(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Per file of ``package`` (relative to its parent), the names :func:`changed_at_run_time` finds."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        names = changed_at_run_time(path.read_text())
        if names:
            found[str(path.relative_to(package.parent))] = names
    return found


def test_module_state_is_the_registries_and_the_jobs() -> None:
    found = count()
    assert found == EXPECTED, f"module-level names changed at run time: {found}; give new state an owner (a Job)"
    assert sum(map(len, found.values())) == 4


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
