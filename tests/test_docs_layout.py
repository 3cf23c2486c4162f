"""docs/design.md's layout lists every module of ``ds_ring/``, one line each (its docstring's first sentence),
and its links resolve: ``python -m tests.test_docs_layout`` rewrites the listing after a module is added. The package's
root holds at most 8 files."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN_PAGE = ROOT / "docs" / "design.md"
BEGIN, END = "<!-- layout: begin (python -m tests.test_docs_layout) -->", "<!-- layout: end -->"


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=\.)\s", first, maxsplit=1)[0].rstrip(".")
    return sentence if len(sentence) <= 110 else sentence[:107].rsplit(" ", 1)[0] + " …"


def layout() -> str:
    """The tree of ``ds_ring/``: one line per package and module, indented by depth."""
    lines = ["```"]
    modules = sorted((ROOT / "ds_ring").rglob("*.py"), key=lambda p: (p.parent.parts, p.name != "__init__.py", p.name))
    for path in modules:
        rel = path.relative_to(ROOT)
        package = path.name == "__init__.py"
        depth = len(rel.parts) - (2 if package else 1)
        name = f"{rel.parent.name}/" if package else path.name
        lines.append(f"{'  ' * depth}{name:<{34 - 2 * depth}} {_summary(path)}".rstrip())
    lines.append("```")
    return "\n".join(lines)


def _listed() -> str:
    text = DESIGN_PAGE.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def test_the_layout_in_the_design_lists_every_module() -> None:
    assert _listed() == layout(), "docs/design.md's layout is stale: run python -m tests.test_docs_layout"


def test_the_package_root_holds_at_most_eight_files() -> None:
    """The public API and what it is made of at the top; everything else in a subpackage named for its job."""
    root = sorted(path.name for path in (ROOT / "ds_ring").glob("*.py"))
    assert len(root) <= 8, f"ds_ring/ has {len(root)} files at its root: {root}; put the new one in a subpackage"


def test_relative_links_in_the_docs_resolve() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


if __name__ == "__main__":
    text = DESIGN_PAGE.read_text()
    DESIGN_PAGE.write_text(text[: text.index(BEGIN) + len(BEGIN)] + "\n" + layout() + "\n" + text[text.index(END) :])
    print(f"{DESIGN_PAGE.relative_to(ROOT)}: layout rewritten", file=sys.stderr)
