"""Hermes tool calls (Hermes 2/3, Qwen 2.5/3 and other ChatML models).

Grammar (``WS`` is JSON whitespace)::

    block   := "<tool_call>" WS body WS ( "</tool_call>" | END-OF-OUTPUT )
    body    := call | "[" call ( "," call )* "]"              (one JSON value)
    call    := {"name": NAME, "arguments": ARGS}              (other keys ignored)
    ARGS    := JSON object | JSON string holding a JSON object | null | absent
               ("parameters" is read when "arguments" is absent or null)

``NAME`` must be a declared tool. A JSON string inside the body may contain
``</tool_call>``: a closing tag is the block's end only where the text before it decodes (or
fails for another reason than an unterminated string). A block whose first non-blank
character is not ``{`` or ``[`` is released at once (the model merely *mentions* the tag),
so it never stalls the stream. A block counts only if every call in it is valid; otherwise
its text, tags included, is content. A block left unclosed at the end of the output counts if
it holds complete, valid calls (models often stop right after the JSON).

Cost: linear, plus one JSON decode per closing tag seen inside an open block.
"""

from __future__ import annotations

from typing import ClassVar

import json
from collections.abc import Sequence

from trioserve.model.tool_formats._json import calls_from_value, loads, unterminated_string
from trioserve.model.tool_formats.json_prefix import JsonCallPreview
from trioserve.model.tool_formats.base import PENDING, Accept, BlockScanner, Reject, StepResult, ToolCallParser, ToolSchemas
from trioserve.model.tool_formats.grammar import CallRules, GrammarPart, literal

__all__ = ["HermesParser", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>``; grammar in the module doc."""

    format_name: ClassVar[str] = "hermes"
    constrained_calls_are_json: ClassVar[bool] = True
    call_start_markers: ClassVar[tuple[str, ...]] = (TOOL_CALL_OPEN,)
    markers: ClassVar[tuple[str, ...]] = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)

    _json_preview: JsonCallPreview | None = None

    def _open_block(self, marker: str) -> BlockScanner:
        return _HermesBlock(self.tools)

    def _preview(self, block: BlockScanner, buf: str) -> tuple[str, str] | None:
        if self._json_preview is None:
            self._json_preview = JsonCallPreview(self.tools)
        return self._json_preview.preview(block, buf, len(TOOL_CALL_OPEN))

    @classmethod
    def constrain(cls, calls: Sequence[CallRules], parallel: bool) -> GrammarPart:
        """``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``; several blocks
        separated by a newline when ``parallel``."""
        body = " | ".join(_json_call(c, "arguments") for c in calls)
        one = f'{literal(TOOL_CALL_OPEN + chr(10))} ({body}) {literal(chr(10) + TOOL_CALL_CLOSE)}'
        return GrammarPart(f'hermes-call ({literal(chr(10))} hermes-call)*' if parallel else "hermes-call",
                           {"hermes-call": one})


class _HermesBlock:
    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        self._scan_from = len(TOOL_CALL_OPEN)  # closing tags before this failed to decode
        self._json_seen = False  # the body's first non-blank character is "{" or "["

    def step(self, buf: str, eof: bool) -> StepResult:
        body_start = len(TOOL_CALL_OPEN)
        if not self._json_seen:
            head = buf[body_start:].lstrip()
            if head and head[0] not in "{[":
                return Reject(body_start)
            self._json_seen = bool(head)
        while (j := buf.find(TOOL_CALL_CLOSE, self._scan_from)) >= 0:
            body = buf[body_start:j].strip()
            end = j + len(TOOL_CALL_CLOSE)
            calls = calls_from_value(loads(body), self._tools)
            if calls is not None:
                return Accept(end, calls)
            if not unterminated_string(body):
                return Reject(end)
            self._scan_from = j + 1  # this tag was inside a string; try the next one
        # No closing tag after _scan_from; only its last few characters could begin one.
        self._scan_from = max(self._scan_from, len(buf) - len(TOOL_CALL_CLOSE) + 1)
        if not eof:
            return PENDING
        calls = calls_from_value(loads(buf[body_start:].strip()), self._tools)
        return Accept(len(buf), calls) if calls is not None else Reject(len(buf))

def _json_call(call: CallRules, arguments_key: str) -> str:
    """``{"name": "NAME", "<arguments_key>": ARGS}`` in compact JSON."""
    return (literal('{"name": ' + json.dumps(call.name, ensure_ascii=False) + ', "' + arguments_key + '": ')
            + f" {call.arguments} " + literal("}"))
