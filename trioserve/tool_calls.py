"""Hermes/Qwen-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Owns finding tool calls in model output text (spec/README.md §10), both on a complete text
(:func:`parse_tool_calls`) and on a stream of text deltas (:class:`ToolCallStreamParser`);
the former is the latter fed once, so both modes give the same content and calls. It does not
decide whether to parse at all (only when tools are declared and ``tool_choice`` is ``auto``)
nor how calls are framed on the wire (``sse.py``, the serving layer).

Rules (small models get tool syntax wrong often, so failures degrade, never crash):

- A block holds one JSON object or an array of them, each ``{"name": str, "arguments":
  object}`` (``parameters`` is accepted for ``arguments``; absent or null means ``{}``; a
  string holding a JSON object is decoded). A JSON string value may contain the closing tag.
- A block counts only if every call in it names a declared tool and has object arguments.
  Otherwise (bad JSON, unknown name, odd arguments) the block's text stays in the content,
  markup included: text is never dropped.
- A block left unclosed at the end of the output counts if it holds a complete, valid call
  (models often end the turn right after the JSON).
- Whitespace that only separated content from a recognized call is dropped, so ``"Let me
  check.\\n<tool_call>…"`` gives the content ``"Let me check."``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from typing import Any, Literal, TypedDict

__all__ = [
    "ToolCall",
    "ToolCallFunction",
    "ToolCallStreamParser",
    "parse_tool_calls",
    "make_tool_call",
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class ToolCallFunction(TypedDict):
    name: str
    arguments: str  # a JSON object, serialized (OpenAI's wire format)


class ToolCall(TypedDict):
    """One call in OpenAI's ``message.tool_calls`` shape; a plain dict at runtime, so it can
    be put in a response as is."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


def make_tool_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    """A call with a fresh ``call_<24 hex>`` id and ``arguments`` serialized with non-ASCII
    kept (``ensure_ascii=False``), as OpenAI does."""
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """Split complete model output into content and tool calls.

    Args:
        text: the whole generated text (stop strings already removed).
        tool_names: names of the request's declared tools; calls to other names stay text.

    Returns:
        ``(content, calls)``: the text with recognized call blocks (and the whitespace around
        them) removed, and the calls in output order. ``content`` equals ``text`` when there
        are no calls.
    """
    parser = ToolCallStreamParser(tool_names)
    head = parser.feed(text)
    rest, calls = parser.finish()
    return head + rest, calls


def _decode_block(body: str, tool_names: Collection[str]) -> list[ToolCall] | None:
    """The calls in one block's body, or None if the block does not count (module rules)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls: list[ToolCall] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        if not isinstance(name, str) or name not in tool_names:
            return None
        arguments = item.get("arguments")
        if arguments is None:
            arguments = item.get("parameters")
        if arguments is None:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(make_tool_call(name, arguments))
    return calls


def _could_continue_string(body: str) -> bool:
    """Whether ``body`` fails to parse only because it ends inside a JSON string, so that a
    later closing tag could still complete it (the earlier one being string content)."""
    try:
        json.loads(body)
    except json.JSONDecodeError as exc:
        return exc.msg.startswith("Unterminated string")
    return False


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of the open tag."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStreamParser:
    """Incremental tool-call parser: feed text deltas, get content to send right away.

    Content is held back only while it could still be part of a call: a tail that may be the
    start of ``<tool_call>``, the inside of an open block until it resolves, and trailing
    whitespace (dropped if a call follows, sent with the next text otherwise). Recognized
    calls are collected and returned by :meth:`finish`, so a stream sends them after all
    content and before the finish chunk (spec §7, §10).

    A block whose first non-blank character is not ``{`` or ``[`` is released as text at
    once, so a model merely *mentioning* the tag does not stall the stream. Cost is linear in
    the text except for one JSON parse attempt per closing tag seen inside an open block.
    """

    def __init__(self, tool_names: Collection[str]) -> None:
        self._names = frozenset(tool_names)
        self._in_block = False
        # Invariant: outside a block, _buf is a (possibly empty) proper prefix of the open
        # tag; inside one, it is the text after the open tag.
        self._buf = ""
        self._scan_from = 0  # in a block: closing tags before this index failed to parse
        self._ws = ""  # trailing whitespace of the content, not yet sent
        self._calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> str:
        """Consume a delta; return the content that can be sent now (may be empty)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out: list[str] = []
        self._buf += text
        while True:
            if not self._in_block:
                i = self._buf.find(TOOL_CALL_OPEN)
                if i < 0:
                    keep = _partial_open_len(self._buf)
                    self._emit(self._buf[: len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return "".join(out)
                self._emit(self._buf[:i], out)
                self._buf = self._buf[i + len(TOOL_CALL_OPEN) :]
                self._in_block, self._scan_from = True, 0
            elif not self._step_block(out):
                return "".join(out)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: return the remaining content and every recognized call."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out: list[str] = []
        if self._in_block:
            calls = _decode_block(self._buf.strip(), self._names)
            if calls is not None:  # complete but unclosed block
                self._accept(calls)
            else:
                self._emit(TOOL_CALL_OPEN + self._buf, out)
        else:
            self._emit(self._buf, out)
        self._buf = ""
        if not self._calls:
            out.append(self._ws)  # no call follows: the whitespace was content after all
        self._ws = ""
        return "".join(out), list(self._calls)

    # --- internals -----------------------------------------------------------------------

    def _emit(self, text: str, out: list[str]) -> None:
        """Send content, holding back its trailing whitespace."""
        if not text:
            return
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            out.append(body)

    def _accept(self, calls: list[ToolCall]) -> None:
        self._calls.extend(calls)
        self._ws = ""  # it only separated the content from this call

    def _release_block(self, upto: int, out: list[str]) -> None:
        """The block up to ``upto`` in ``_buf`` is not a call: send it as content."""
        self._emit(TOOL_CALL_OPEN + self._buf[:upto], out)
        self._buf = self._buf[upto:]
        self._in_block = False

    def _step_block(self, out: list[str]) -> bool:
        """Try to resolve the open block; True if it was resolved (parsing continues)."""
        head = self._buf.lstrip()
        if head and head[0] not in "{[":
            self._release_block(0, out)
            return True
        while (j := self._buf.find(TOOL_CALL_CLOSE, self._scan_from)) >= 0:
            body = self._buf[:j].strip()
            end = j + len(TOOL_CALL_CLOSE)
            calls = _decode_block(body, self._names)
            if calls is not None:
                self._accept(calls)
                self._buf = self._buf[end:]
                self._in_block = False
                return True
            if not _could_continue_string(body):
                self._release_block(end, out)
                return True
            self._scan_from = j + 1  # this tag was inside a string; try the next one
        return False
