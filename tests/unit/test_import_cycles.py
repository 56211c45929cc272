"""The import graph of trioserve/ has no cycle.

Nodes are the modules under trioserve/ (a package is its ``__init__``); there is an edge
``a → b`` for every ``import`` in ``a`` that names ``b`` (``from pkg import name`` names the
module ``pkg.name`` when there is one, else ``pkg``). What counts, and why:

* **module-level imports**, of course;
* **imports inside functions count too**: a lazy import that closes a circle only moves the
  failure from import time to the first call, and hides that two modules own each other's
  parts (it is how ``tokenize_gate`` once took ``GenerationError`` from the runtime that
  imports it);
* **imports under ``if TYPE_CHECKING:`` count too**: they are no run-time dependency, but an
  annotation that needs a circle says the same about the design.

So the rule is simply: no module reaches, through any chain of imports, back to itself.
Implicit parent packages (importing ``a.b.c`` also runs ``a/__init__``) are not edges: only
what a module names.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trioserve"

# Circles being broken elsewhere, each with the issue that removes it (remove the entry when
# its move lands). Keep this empty otherwise.
KNOWN_CYCLES: list[frozenset[str]] = []


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def graph() -> dict[str, set[str]]:
    """Every module's imported trioserve modules (module docstring)."""
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            named: list[str] = []
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                         for alias in node.names]
            for target in named:
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != name:
                    targets.add(target)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's
    algorithm, iterative: the graph is deep enough to matter for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_import_graph_has_no_cycle():
    found = [c for c in cycles(graph()) if frozenset(c) not in KNOWN_CYCLES]
    assert found == [], "modules that import each other, directly or through others: " \
        "move what they share into a module both import"


def test_the_check_catches_a_cycle_closed_by_a_lazy_import(tmp_path, monkeypatch):
    """A circle of three modules whose last edge is an import inside a function, and one
    closed under TYPE_CHECKING, are each reported; a chain is not."""
    fake = tmp_path / "trioserve"
    (fake / "worker").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "worker" / "__init__.py").write_text("")
    (fake / "worker" / "a.py").write_text("from trioserve.worker import b\n")
    (fake / "worker" / "b.py").write_text("from . import c\n")
    (fake / "worker" / "c.py").write_text("def f():\n    from trioserve.worker.a import thing\n")
    (fake / "worker" / "d.py").write_text("from typing import TYPE_CHECKING\n"
                                          "if TYPE_CHECKING:\n    from trioserve.worker.e import E\n")
    (fake / "worker" / "e.py").write_text("from trioserve.worker.d import D\n")
    (fake / "worker" / "f.py").write_text("from trioserve.worker import a, d\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert cycles(graph()) == [["trioserve.worker.a", "trioserve.worker.b", "trioserve.worker.c"],
                               ["trioserve.worker.d", "trioserve.worker.e"]]
