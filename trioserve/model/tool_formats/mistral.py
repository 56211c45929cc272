"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON list, or the newer name/``[ARGS]`` form.

Grammar (``WS`` is JSON whitespace)::

    block     := "[TOOL_CALLS]" WS ( list | named )
    list      := a JSON array of call objects, or one call object
                 call object: {"name": NAME, "arguments": ARGS, …}   (other keys, e.g. "id",
                 ignored; "parameters" is read when "arguments" is absent or null)
    named     := NAME ( "[CALL_ID]" ID )? "[ARGS]" WS object
    object    := one JSON object (the arguments)

- ``NAME``: a declared tool (letters, digits, ``_``, ``.``, ``-``). ``ID``: letters,
  digits, ``_``, ``-``; read and dropped (calls get fresh ids).
- ``ARGS`` in the list form: an object, a string holding one, or null/absent for ``{}``.
- The block ends where its JSON value ends (brackets counted outside strings, so strings may
  contain anything, ``[TOOL_CALLS]`` included). Several named calls are several
  ``[TOOL_CALLS]`` blocks; a list block holds one or more calls and counts only if all are
  valid.
- A block that is cut off, malformed, or names an undeclared tool is content, markers
  included. ``[TOOL_CALLS]`` followed by anything else (prose) is content at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import ClassVar

from trioserve.model.tool_formats._json import JsonExtent, calls_from_value, loads
from trioserve.model.tool_formats._text import skip_ws
from trioserve.model.tool_formats.grammar import CallRules, GrammarPart, literal
from trioserve.model.tool_formats.json_prefix import JsonCallPreview
from trioserve.model.tool_formats.base import PENDING, Accept, BlockScanner, Reject, StepResult, ToolCallParser, ToolSchemas, build_call

__all__ = ["MistralParser"]

_OPEN = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"

_NAME = re.compile(r"[\w.\-]*")
_ID = re.compile(r"[A-Za-z0-9_\-]*")
_MAX_WORD = 256  # longest name or id read; longer is prose (and bounds rescans)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": …, "arguments": {…}}]`` or ``[TOOL_CALLS]NAME[ARGS]{…}``;
    grammar in the module doc."""

    format_name: ClassVar[str] = "mistral"
    constrained_calls_are_json: ClassVar[bool] = True
    call_start_markers: ClassVar[tuple[str, ...]] = (_OPEN,)
    markers: ClassVar[tuple[str, ...]] = (_OPEN, _ARGS, _CALL_ID)

    @classmethod
    def constrain(cls, calls: Sequence[CallRules], parallel: bool) -> GrammarPart:
        """``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``: the list form, one element
        unless ``parallel``."""
        one = " | ".join(_json_call(c, "arguments") for c in calls)
        more = f' ({literal(", ")} mistral-call)*' if parallel else ""
        return GrammarPart(f'{literal("[TOOL_CALLS][")} mistral-call{more} {literal("]")}',
                           {"mistral-call": one})

    _json_preview: JsonCallPreview | None = None

    def _open_block(self, marker: str) -> BlockScanner:
        return _MistralBlock(self.tools)

    def _preview(self, block: BlockScanner, buf: str) -> tuple[str, str] | None:
        if self._json_preview is None:
            self._json_preview = JsonCallPreview(self.tools)
        return self._json_preview.preview(block, buf, len(_OPEN))


class _MistralBlock:
    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        self._form = ""  # "", "list" or "named" once known
        self._name = ""
        self._args_at = -1  # named form: index after "[ARGS]"
        self._value_start = -1
        self._extent: JsonExtent | None = None

    def step(self, buf: str, eof: bool) -> StepResult:
        if self._extent is None:
            result = self._find_value(buf, eof)
            if result is not None:
                return result
        assert self._extent is not None
        end = self._extent.advance(buf)
        if end is None:
            return Reject(len(buf)) if eof else PENDING
        value = loads(buf[self._value_start : end])
        if self._form == "list":
            calls = calls_from_value(value, self._tools)
            return Accept(end, calls) if calls is not None else Reject(end)
        call = build_call(self._name, value) if isinstance(value, dict) else None
        return Accept(end, [call]) if call is not None else Reject(end)

    def _find_value(self, buf: str, eof: bool) -> StepResult | None:
        """Read up to the JSON value and start its extent; a result if it cannot (yet)."""
        wait: StepResult = Reject(len(buf)) if eof else PENDING
        if not self._form:
            i = skip_ws(buf, len(_OPEN))
            if i == len(buf):
                return wait
            if buf[i] in "[{":
                self._form, self._value_start = "list", i
                self._extent = JsonExtent(i)
                return None
            m = _NAME.match(buf, i)
            assert m is not None  # the pattern matches the empty string
            if m.end() == len(buf):
                return wait if m.end() - i <= _MAX_WORD else Reject(len(_OPEN))
            if m.end() == i or m.end() - i > _MAX_WORD or buf[m.end()] != "[":
                return Reject(len(_OPEN))
            if m.group() not in self._tools:
                return Reject(m.end())
            self._form, self._name = "named", m.group()
            self._args_at = m.end()  # provisional: where "[ARGS]" or "[CALL_ID]" begins
        if self._value_start < 0:
            result = self._find_args(buf, eof)
            if result is not None:
                return result
        return None

    def _find_args(self, buf: str, eof: bool) -> StepResult | None:
        """After the name: an optional ``[CALL_ID]ID``, then ``[ARGS]`` and the object."""
        wait: StepResult = Reject(len(buf)) if eof else PENDING
        at = self._args_at
        expected: tuple[str, ...] = (_ARGS, _CALL_ID)
        if buf.startswith(_CALL_ID, at):
            m = _ID.match(buf, at + len(_CALL_ID))
            assert m is not None  # the pattern matches the empty string
            if m.end() - m.start() > _MAX_WORD:
                return Reject(at)
            if m.end() == len(buf):
                return wait
            at, expected = m.end(), (_ARGS,)  # only "[ARGS]" may follow the id
        if not buf.startswith(_ARGS, at):
            head = buf[at : at + len(_CALL_ID)]
            return wait if any(e.startswith(head) for e in expected) else Reject(at)
        i = skip_ws(buf, at + len(_ARGS))
        if i == len(buf):
            return wait
        if buf[i] != "{":
            return Reject(i)
        self._value_start = i
        self._extent = JsonExtent(i)
        return None

def _json_call(call: CallRules, arguments_key: str) -> str:
    """``{"name": "NAME", "<arguments_key>": ARGS}`` in compact JSON."""
    return (literal('{"name": ' + json.dumps(call.name, ensure_ascii=False) + ', "' + arguments_key + '": ')
            + f" {call.arguments} " + literal("}"))
