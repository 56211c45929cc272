"""No module of trioserve/ touches another module's underscored names.

An underscored name (``_queue``, ``_fail``, ``_size``; not a dunder) is its module's own: other
modules go through public names, so an object's state has one owner. The check is an AST scan
of every module under trioserve/:

* A module *defines* ``_x`` when it has a function or class ``_x`` (at any depth), binds a
  plain name ``_x`` (an assignment, an import ``as _x``, a loop target), or assigns
  ``self._x`` / ``cls._x`` (an import of another module's ``_x`` defines nothing).
* A module *uses* ``_x`` in ``obj._x`` where ``obj`` is not ``self``, ``cls`` or ``super()``
  (those are the object's own, inherited names included), and in
  ``from trioserve.<other> import _x``.
* A use is a violation when ``_x`` is defined by another trioserve module and not by the
  using module.

Why this is precise enough to have no false positives on legitimate code: a module may reach
the underscored names of objects of its own classes (a parser comparing two of its blocks),
and those names are defined in the module itself; names defined nowhere in trioserve belong to
third-party libraries (hypercorn's and h11's internals, which the HTTP layer patches on
purpose, each with a comment) and are outside this rule. What it cannot see: a module that
defines ``_x`` itself and also reaches another module's ``_x`` (the check is by name, not by
type).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trioserve"

OWN = ("self", "cls")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _from_trioserve(node: ast.ImportFrom) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] == "trioserve"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def defined(tree: ast.AST) -> set[str]:
    """The underscored names a module defines (module docstring)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not _from_trioserve(node):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):  # taking another module's _x defines nothing
            names.update(alias.asname for alias in node.names if alias.asname)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in OWN):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def _own_object(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in OWN
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """``(line, name, how)`` for every reach for an underscored name (module docstring)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own_object(node.value):
            found.append((node.lineno, node.attr, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and _from_trioserve(node):
            found += [(node.lineno, alias.name, f"from {node.module} import {alias.name}")
                      for alias in node.names if _private(alias.name)]
    return found


def violations() -> list[str]:
    trees = {path: ast.parse(path.read_text(encoding="utf-8"))
             for path in sorted(PACKAGE.rglob("*.py"))}
    definitions = {path: defined(tree) for path, tree in trees.items()}
    owners: dict[str, set[Path]] = {}
    for path, names in definitions.items():
        for name in names:
            owners.setdefault(name, set()).add(path)
    found = []
    for path, tree in trees.items():
        for line, name, how in uses(tree):
            others = owners.get(name, set()) - {path}
            if name not in definitions[path] and others:
                where = ", ".join(sorted(_module_name(p) for p in others))
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {how} "
                             f"(defined in {where})")
    return sorted(found)


def test_no_module_touches_another_modules_private_names():
    assert violations() == []


def test_the_check_catches_a_reach_into_another_module(tmp_path, monkeypatch):
    """A planted reach is reported; an object of the module's own class, ``self``, a base
    class through ``super()`` and a third-party name are not."""
    fake = tmp_path / "trioserve"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "owner.py").write_text(
        "class Box:\n"
        "    def __init__(self):\n"
        "        self._items = []\n"
        "    def _drop(self, item):\n"
        "        self._items.remove(item)\n"
        "    def same(self, other):\n"
        "        return self._items == other._items\n"
        "_LIMIT = 3\n")
    (fake / "user.py").write_text(
        "import os\n"
        "from trioserve.owner import Box, _LIMIT\n"
        "class Sub(Box):\n"
        "    def drop(self, item):\n"
        "        super()._drop(item)\n"
        "        self._drop(item)\n"
        "def use(box):\n"
        "    os._exit(0)\n"
        "    return box._items\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert violations() == [
        "trioserve/user.py:2: from trioserve.owner import _LIMIT (defined in trioserve.owner)",
        "trioserve/user.py:9: box._items (defined in trioserve.owner)"]
