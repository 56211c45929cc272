"""Small modules and short functions in trioserve/ (the house rules in trioserve/__init__.py):
no module over :data:`MODULE_LINES` lines and no function over :data:`FUNCTION_LINES` lines
unless a ``# long:`` comment in it says why it reads better whole."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trioserve"

MODULE_LINES = 600
FUNCTION_LINES = 80
LONG_REASON = "# long:"

def _sources() -> list[tuple[str, str]]:
    return [(str(path.relative_to(PACKAGE)), path.read_text(encoding="utf-8"))
            for path in sorted(PACKAGE.rglob("*.py"))]


def long_functions(name: str, source: str, limit: int = FUNCTION_LINES) -> list[str]:
    """``module:function (lines)`` for every function in ``source`` longer than ``limit``
    lines (decorators and docstring included) without a ``# long:`` comment inside it."""
    comments: dict[int, str] = {
        tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT}
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        end = node.end_lineno or node.lineno
        lines = end - start + 1
        reasoned = any(comments.get(n, "").startswith(LONG_REASON) for n in range(start, end + 1))
        if lines > limit and not reasoned:
            out.append(f"{name}:{node.name} ({lines} lines)")
    return out


def test_no_module_is_over_the_limit():
    over = [f"{name} ({source.count(chr(10))} lines)" for name, source in _sources()
            if source.count("\n") > MODULE_LINES]
    assert not over, f"split these modules by responsibility: {over}"


def test_no_function_is_over_the_limit_without_a_reason():
    over = [found for name, source in _sources() for found in long_functions(name, source)]
    assert not over, f"split these functions or say why in a '{LONG_REASON}' comment: {over}"


def test_the_function_check_can_fail_and_reads_the_reason():
    body = "".join(f"    x = {i}\n" for i in range(FUNCTION_LINES))
    assert long_functions("m.py", "def f():\n" + body) == [f"m.py:f ({FUNCTION_LINES + 1} lines)"]
    assert long_functions("m.py", "def f():\n    # long: one table\n" + body) == []
    assert long_functions("m.py", "def f():\n" + body[: -len("    x = 0\n")]) == []
