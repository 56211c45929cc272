"""JSON pieces shared by the formats: strict decoding that never raises, finding where a JSON
value ends in a growing buffer, and reading ``{"name", "arguments"}`` call objects."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

from trioserve.model.tool_formats.base import ToolCall, ToolSchemas, build_call


class _Invalid:
    __slots__ = ()

    def __repr__(self) -> str:
        return "INVALID"


INVALID: Final = _Invalid()
"""What :func:`loads` returns for text that is not one strict JSON value."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: OpenAI's arguments must stay valid JSON
        raise ValueError("number out of range")
    return value


def loads(text: str) -> Any:
    """``json.loads`` restricted to standard JSON (no ``NaN``/``Infinity``, no overflowing
    numbers), returning :data:`INVALID` instead of raising, also on ``RecursionError``
    (deep nesting) and on integers too long to convert."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return INVALID


def unterminated_string(text: str) -> bool:
    """Whether ``text`` fails to decode only because it ends inside a JSON string (so more
    text could complete it)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return exc.msg.startswith("Unterminated string")
    except (ValueError, RecursionError):
        return False
    return False


_OUTSIDE = re.compile(r'[{}\[\]"]')
_INSIDE = re.compile(r'["\\]')


class JsonExtent:
    """Finds the end of the JSON object or array that starts at ``start`` in a buffer that
    grows between calls, counting brackets outside strings (escapes honoured). It does not
    validate: decode the extent with :func:`loads`. Linear overall: each call resumes where
    the previous one stopped; the depth is a counter, so nesting costs nothing here."""

    def __init__(self, start: int) -> None:
        self._pos = start  # next index to examine; buf[start] must be "{" or "["
        self._depth = 0
        self._in_string = False

    def advance(self, buf: str) -> int | None:
        """The index just past the value's closing bracket, or None if not there yet."""
        pos = self._pos
        while True:
            if self._in_string:
                m = _INSIDE.search(buf, pos)
                if m is None:
                    pos = len(buf)
                    break
                if m.group() == "\\":
                    if m.end() >= len(buf):  # the escaped character has not arrived
                        pos = m.start()
                        break
                    pos = m.end() + 1
                    continue
                self._in_string = False
                pos = m.end()
                continue
            m = _OUTSIDE.search(buf, pos)
            if m is None:
                pos = len(buf)
                break
            pos = m.end()
            char = m.group()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = pos
                    return pos
        self._pos = pos
        return None


def arguments_object(value: Any) -> dict[str, Any] | None:
    """Call arguments as given in a call object: an object, a string holding a JSON object,
    or absent/null (``{}``). None for anything else."""
    if value is None:
        return {}
    if isinstance(value, str):
        value = loads(value)
    return value if isinstance(value, dict) else None


def call_from_object(item: Any, tools: ToolSchemas) -> ToolCall | None:
    """The call described by ``{"name": <declared tool>, "arguments"|"parameters": ...}``
    (``arguments`` wins when both are present and not null), or None."""
    if not isinstance(item, dict):
        return None
    name = item.get("name")
    if not isinstance(name, str) or name not in tools:
        return None
    raw = item.get("arguments")
    if raw is None:
        raw = item.get("parameters")
    arguments = arguments_object(raw)
    if arguments is None:
        return None
    return build_call(name, arguments)


def calls_from_value(value: Any, tools: ToolSchemas) -> list[ToolCall] | None:
    """The calls in one decoded JSON value: a call object or a non-empty array of them; None
    unless every element is a valid call (a block counts as a whole or not at all)."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls: list[ToolCall] = []
    for item in items:
        call = call_from_object(item, tools)
        if call is None:
            return None
        calls.append(call)
    return calls
