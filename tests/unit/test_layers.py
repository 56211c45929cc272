"""The control plane's layers (trioserve/__init__.py) and what each may import.

Every ``import`` in every module under trioserve/, including the ones inside functions, is
checked against its layer's rule, so a module that reaches across a layer fails here with the
offending line named.

Inside the API layer the four API packages (``api/chat``, ``api/responses``, ``api/messages``,
``api/completions``) are peers: none imports another, and the shared modules at ``api/``'s top
level (body types and validation, the stream skeleton, the answer types) import none of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trioserve"

LAYERS = ("http", "api", "core", "model", "worker")
LEAVES = ("config", "errors", "hub", "limits", "machine", "registry", "strict_json")
ENTRY_POINTS = ("cli", "app", "testing")

# What each layer may import from trioserve ("leaf" = the leaves; dotted names = one module).
ALLOWED: dict[str, set[str]] = {
    "leaf": {"leaf"},
    "model": {"model", "leaf"},
    "worker": {"worker", "leaf"},
    "core": {"core", "model", "leaf", "worker.protocol", "worker.runtime", "worker.tokenize_gate"},
    "api": {"api", "core", "model", "leaf"},
    "http": {"http", "api", "core", "model", "worker", "leaf"},
    "entry": {"http", "worker", "leaf"},
}
# The web framework and server belong to the HTTP layer (and the entry points that run it).
WEB = ("quart", "quart_trio", "hypercorn", "werkzeug", "h11", "h2")


def layer_of(module: str) -> str:
    """``trioserve.api.chat.adapter`` → ``api``; leaves → ``leaf``; cli/app/testing → ``entry``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "entry"  # the package itself
    if parts[1] in LAYERS:
        return parts[1]
    if parts[1] in LEAVES:
        return "leaf"
    if parts[1] in ENTRY_POINTS:
        return "entry"
    raise AssertionError(f"{module} is in no layer: add it to one (trioserve/__init__.py)")


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found.append((name, path))
    return found


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import in ``path`` (relative ones resolved; for
    ``from pkg import name`` the name when it is a module of the package, else ``pkg``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = list(parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() or \
                    (PACKAGE.parent / candidate.replace(".", "/")).is_dir()
                out.append((node.lineno, candidate if is_module else base))
    return out


def allowed(importer_layer: str, target: str) -> bool:
    target_layer = layer_of(target)
    rules = ALLOWED[importer_layer]
    if target_layer in rules:
        return True
    return any(target == f"trioserve.{rule}" or target.startswith(f"trioserve.{rule}.")
               for rule in rules if "." in rule)


def api_package(module: str) -> str | None:
    """``trioserve.api.chat.adapter`` → ``chat``; None for a module outside the API packages
    (the shared ``trioserve.api.*`` modules included)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "api" and (PACKAGE / "api" / parts[2]).is_dir():
        return parts[2]
    return None


def violations() -> list[str]:
    found = []
    for name, path in modules():
        layer = layer_of(name)
        own_api = api_package(name)
        for line, target in imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target.split(".")[0] == "trioserve":
                if target == "trioserve":
                    continue
                if not allowed(layer, target):
                    found.append(f"{where}: {name} ({layer}) imports {target} ({layer_of(target)})")
                elif layer == "api" and api_package(target) not in (None, own_api):
                    # Peers: what two APIs share lives at api/'s top level.
                    found.append(f"{where}: {name} ({own_api or 'shared'}) imports the "
                                 f"{api_package(target)} API ({target})")
            elif target.split(".")[0] in WEB and layer not in ("http", "entry"):
                found.append(f"{where}: {name} ({layer}) imports the web stack ({target})")
    return found


def test_every_module_belongs_to_a_layer():
    for name, _ in modules():
        layer_of(name)


def test_no_module_imports_against_its_layer():
    assert violations() == []


def test_the_check_catches_an_import_against_the_rule(tmp_path, monkeypatch):
    """The rule check itself: a model module that imports the worker is reported."""
    fake = tmp_path / "trioserve"
    (fake / "model").mkdir(parents=True)
    (fake / "worker").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "model" / "__init__.py").write_text("")
    (fake / "worker" / "__init__.py").write_text("")
    (fake / "worker" / "client.py").write_text("")
    (fake / "model" / "bad.py").write_text("def f():\n    from trioserve.worker import client\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    found = violations()
    assert found == ["trioserve/model/bad.py:2: trioserve.model.bad (model) imports "
                     "trioserve.worker.client (worker)"]


def test_the_check_catches_an_api_package_importing_another(tmp_path, monkeypatch):
    """API packages are peers: one that imports another, or a shared api module that imports
    one, is reported; an API package importing the shared modules is not."""
    fake = tmp_path / "trioserve"
    for folder in ("api", "api/chat", "api/messages"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "api" / "body.py").write_text("")
    (fake / "api" / "chat" / "models.py").write_text("from trioserve.api import body\n")
    (fake / "api" / "messages" / "adapter.py").write_text(
        "from trioserve.api.body import x\nfrom trioserve.api.chat.models import y\n")
    (fake / "api" / "shared.py").write_text("def f():\n    from trioserve.api.chat import models\n")
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    assert violations() == [
        "trioserve/api/messages/adapter.py:2: trioserve.api.messages.adapter (messages) imports "
        "the chat API (trioserve.api.chat.models)",
        "trioserve/api/shared.py:2: trioserve.api.shared (shared) imports the chat API "
        "(trioserve.api.chat.models)"]
