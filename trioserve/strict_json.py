"""JSON decoding under the request body rules (spec/README.md §4 step 2, limits in §15).

Python's ``json`` is more lenient than the contract and has failure modes a server must not
show: it accepts ``NaN``/``Infinity``, decodes ``1e400`` to infinity, raises RecursionError on
deep nesting and a ValueError about interpreter internals on huge integer literals, and lets
``\\ud800`` escapes put lone surrogates into strings. :func:`loads` applies the rules
(every failure is a :class:`BodyRuleError` or ``json.JSONDecodeError``, both ValueErrors
whose message can be shown to a client); the surrogate helpers find the exact place of a lone
surrogate for the request models. Used for request bodies and for tool-call ``arguments``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trioserve import limits

__all__ = ["BodyRuleError", "TooDeep", "loads", "may_hold_lone_surrogates", "lone_surrogate",
           "first_lone_surrogate", "ascii_digits"]


class BodyRuleError(ValueError):
    """A stage-2 rule beyond JSON's grammar was broken; the message is for the client."""


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity, which are not JSON (RFC 8259) and no client should send.
    raise BodyRuleError(f"{name} is not valid JSON")


class TooDeep(BodyRuleError):
    """JSON nested deeper than ``limits.MAX_JSON_DEPTH``."""


_TOO_DEEP = f"nested deeper than {limits.MAX_JSON_DEPTH} levels"
_INFINITY = float("inf")


def _check_tree(value: Any) -> None:
    """Raise BodyRuleError when a decoded JSON value nests deeper than the limit or holds a
    number beyond double range (``1e400`` decodes to infinity). One pass, one nesting level at
    a time (iterative: any depth is safe), with only C-level work per scalar."""
    level, depth = [value], 1
    while level:
        if depth > limits.MAX_JSON_DEPTH:
            raise TooDeep(_TOO_DEEP)
        deeper = []
        for container in level:
            for child in container.values() if type(container) is dict else container:
                kind = type(child)
                if kind is dict or kind is list:
                    deeper.append(child)
                elif kind is float and (child == _INFINITY or child == -_INFINITY):
                    raise BodyRuleError("a number is out of range (beyond double precision)")
        level, depth = deeper, depth + 1


def loads(text: str) -> Any:
    """``json.loads`` under the body rules: RFC 8259 only, finite numbers, integer literals and
    nesting within ``limits``.

    Raises:
        json.JSONDecodeError: not JSON.
        BodyRuleError: JSON that breaks a rule (TooDeep for nesting).
        Never RecursionError, whatever the text.
    """
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # the C scanner recurses once per nesting level
        raise TooDeep(_TOO_DEEP) from None
    except (json.JSONDecodeError, BodyRuleError):
        raise
    except ValueError:  # int(): over the interpreter's digit limit; its message is about Python
        raise BodyRuleError(
            f"an integer literal has more than {limits.MAX_INTEGER_DIGITS} digits") from None
    if type(value) is dict or type(value) is list:
        _check_tree(value)
    elif type(value) is float and value in (_INFINITY, -_INFINITY):
        raise BodyRuleError("a number is out of range (beyond double precision)")
    return value


# A lone surrogate can only come from a \\uD800-\\uDFFF escape (the body is decoded as UTF-8,
# which has no surrogates), at any level of escaping (an escaped escape inside a tool call's
# arguments still contains the text "\\ud8..").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def may_hold_lone_surrogates(body: bytes) -> bool:
    """False when no string decoded from ``body`` (or from JSON inside its strings) can hold a
    lone surrogate, so the per-string checks can be skipped; True means "check"."""
    return _SURROGATE_ESCAPE.search(body) is not None


def lone_surrogate(text: str) -> str | None:
    """Where the first lone surrogate in ``text`` is (``"U+D800 at offset 3"``), or None when
    ``text`` is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"U+{ord(text[exc.start]):04X} at offset {exc.start}"
    return None


def first_lone_surrogate(value: Any) -> tuple[str, str] | None:
    """``(subpath, problem)`` of the first key or string in a decoded JSON value (document
    order) that is not valid Unicode, or None. Iterative; the body's nesting is bounded."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if (where := lone_surrogate(item)) is not None:
                return path, f"a lone surrogate ({where})"
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if (where := lone_surrogate(key)) is not None:
                    return path, f"a key with a lone surrogate ({where})"
                children.append((child, f"{path}.{key}"))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([(child, f"{path}[{i}]") for i, child in enumerate(item)]))
    return None


# In test order: bool before int (a bool is an int in Python, never a JSON number).
_JSON_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"),
    (str, "string"), (list, "array"), (dict, "object"))


def json_type_name(value: Any) -> str:
    """The JSON Schema type name of a decoded JSON value (``bool`` is never a number)."""
    for cls, name in _JSON_TYPE_NAMES:
        if isinstance(value, cls):
            return name
    return type(value).__name__


def ascii_digits(text: str, *, max_digits: int) -> int | None:
    """The non-negative integer ``text`` spells in ASCII digits only (``0``-``9``, at most
    ``max_digits`` of them: no sign, space or underscore), or None.

    Why not ``str.isdigit()`` + ``int()``: ``isdigit`` is true for ``²`` (which ``int``
    refuses: a ValueError where a 400 was meant) and for ``٣`` and ``５`` (which ``int``
    reads as 3 and 5: a number nobody typed in a URL); ``int`` also accepts ``" 5"`` and
    ``"1_0"``, and a very long digit string costs quadratic time (and past Python's
    ``int_max_str_digits`` raises). Used for query strings, Host ports, JSON Pointer indexes
    and numeric settings (tests/unit/test_strict_numbers.py).
    """
    if not 0 < len(text) <= max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)
