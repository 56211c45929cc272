"""Llama 3.x JSON tool calls: a bare JSON object, optionally after ``<|python_tag|>``.

Grammar (``WS`` is JSON whitespace)::

    call    := ( "<|python_tag|>" WS )? object ( WS ";" )?
    object  := "{" WS ( '"type"' WS ":" WS '"function"' WS "," WS )? '"name"' …  "}"
               (one JSON object; keys: "name", "parameters" or "arguments", "type")

- A call may start at any ``{`` whose first key is ``"name"`` (or ``"type": "function"``
  then ``"name"``); there is no other marker, so text is held back only while it could
  still be such a start (``{``, ``{"na`` …). Any other ``{`` is content at once.
- The object must decode as strict JSON with a declared tool as ``"name"``, arguments as
  in Hermes (``"parameters"``, or ``"arguments"``: an object, a string holding one, or
  null/absent for ``{}``), ``"type"`` (if present) equal to ``"function"``, and no other
  keys (with no marker to go by, a stray key means the JSON is data, not a call).
- Calls may follow each other separated by ``;`` and/or whitespace: a ``;`` right after a
  call (whitespace aside) is dropped. ``<|python_tag|>`` is dropped with the call it
  introduces; not followed by a call (e.g. Llama 3.1's built-in ``tool.call(...)`` syntax,
  which this parser does not read), it stays content.
- A JSON string may contain braces, ``;`` or ``<|python_tag|>``. An object that is cut off,
  malformed, or names an undeclared tool is content.

Limitation (no marker to go by): a call-shaped object nested inside other JSON the model
writes as content is taken as a call if it names a declared tool.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from trioserve.model.tool_formats._json import JsonExtent, arguments_object, loads
from trioserve.model.tool_formats._text import skip_ws
from trioserve.model.tool_formats.grammar import CallRules, GrammarPart, literal
from trioserve.model.tool_formats.json_prefix import JsonCallPreview
from trioserve.model.tool_formats.base import (
    PENDING,
    Accept,
    BlockScanner,
    Reject,
    StepResult,
    ToolCall,
    ToolCallParser,
    ToolSchemas,
    build_call,
)

__all__ = ["Llama3JsonParser"]

_PYTHON_TAG = "<|python_tag|>"
_ALLOWED_KEYS = frozenset({"name", "parameters", "arguments", "type"})
# The token sequences a call object may begin with (after "{"), whitespace allowed between.
_CALL_HEADS = (('"name"',), ('"type"', ":", '"function"', ",", '"name"'))

_MATCH, _PARTIAL, _FAIL = "match", "partial", "fail"


class Llama3JsonParser(ToolCallParser):
    """``{"name": …, "parameters": {…}}`` (also after ``<|python_tag|>``, several separated
    by ``;``); grammar in the module doc."""

    format_name: ClassVar[str] = "llama3_json"
    constrained_calls_are_json: ClassVar[bool] = True
    call_start_markers: ClassVar[tuple[str, ...]] = (_PYTHON_TAG, "{")
    markers: ClassVar[tuple[str, ...]] = (_PYTHON_TAG,)
    call_suffixes: ClassVar[tuple[str, ...]] = (";",)

    @classmethod
    def constrain(cls, calls: Sequence[CallRules], parallel: bool) -> GrammarPart:
        """``{"name": …, "parameters": {…}}``; several separated by ``"; "`` when
        ``parallel`` (the parser drops a ``;`` after a call)."""
        one = " | ".join(_json_call(c, "parameters") for c in calls)
        return GrammarPart(f'llama3-call ({literal("; ")} llama3-call)*' if parallel else "llama3-call",
                           {"llama3-call": one})

    _json_preview: JsonCallPreview | None = None

    def _open_block(self, marker: str) -> BlockScanner:
        if marker == _PYTHON_TAG:
            return _PythonTagBlock(self.tools)
        return _ObjectBlock(self.tools, 0)

    def _preview(self, block: BlockScanner, buf: str) -> tuple[str, str] | None:
        if self._json_preview is None:
            self._json_preview = JsonCallPreview(self.tools)
        # A "{" marker is the call object's own first character.
        return self._json_preview.preview(block, buf, len(_PYTHON_TAG) if buf.startswith(_PYTHON_TAG) else 0)


def _head_state(buf: str, pos: int, tokens: tuple[str, ...]) -> str:
    """Whether ``buf[pos:]`` begins with ``tokens`` (whitespace allowed before each one)."""
    for token in tokens:
        pos = skip_ws(buf, pos)
        chunk = buf[pos : pos + len(token)]
        if chunk == token:
            pos += len(token)
        elif token.startswith(chunk) and pos + len(chunk) == len(buf):
            return _PARTIAL
        else:
            return _FAIL
    return _MATCH


def _call_from(value: Any, tools: ToolSchemas) -> ToolCall | None:
    if not isinstance(value, dict) or not value.keys() <= _ALLOWED_KEYS:
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in tools:
        return None
    if value.get("type", "function") != "function":
        return None
    raw = value.get("arguments")
    if raw is None:
        raw = value.get("parameters")
    arguments = arguments_object(raw)
    return build_call(name, arguments) if arguments is not None else None


class _ObjectBlock:
    """A candidate call object whose ``{`` is at ``start``."""

    def __init__(self, tools: ToolSchemas, start: int) -> None:
        self._tools = tools
        self._start = start
        self._extent: JsonExtent | None = None

    def step(self, buf: str, eof: bool) -> StepResult:
        if self._extent is None:
            states = {_head_state(buf, self._start + 1, head) for head in _CALL_HEADS}
            if _MATCH not in states:
                if _PARTIAL not in states:
                    return Reject(self._start + 1)
                return Reject(len(buf)) if eof else PENDING
            self._extent = JsonExtent(self._start)
        end = self._extent.advance(buf)
        if end is None:
            return Reject(len(buf)) if eof else PENDING
        call = _call_from(loads(buf[self._start : end]), self._tools)
        return Accept(end, [call]) if call is not None else Reject(end)


class _PythonTagBlock:
    """``<|python_tag|>`` then a call object; if none follows, the tag alone is content (the
    text after it is scanned on its own)."""

    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        self._object: _ObjectBlock | None = None

    def step(self, buf: str, eof: bool) -> StepResult:
        if self._object is None:
            i = skip_ws(buf, len(_PYTHON_TAG))
            if i == len(buf):
                return Reject(len(_PYTHON_TAG)) if eof else PENDING
            if buf[i] != "{":
                return Reject(len(_PYTHON_TAG))
            self._object = _ObjectBlock(self._tools, i)
        result = self._object.step(buf, eof)
        return Reject(len(_PYTHON_TAG)) if isinstance(result, Reject) else result

def _json_call(call: CallRules, arguments_key: str) -> str:
    """``{"name": "NAME", "<arguments_key>": ARGS}`` in compact JSON."""
    return (literal('{"name": ' + json.dumps(call.name, ensure_ascii=False) + ', "' + arguments_key + '": ')
            + f" {call.arguments} " + literal("}"))
