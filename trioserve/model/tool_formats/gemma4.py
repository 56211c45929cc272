"""Gemma 4 tool calls: ``<|tool_call>call:NAME{key:value,…}<tool_call|>``.

Grammar (``WS`` is any whitespace, possibly empty; no whitespace inside ``call:NAME{``)::

    call    := "<|tool_call>" "call:" NAME object ( WS "<tool_call|>" )?
    object  := "{" WS ( member ( WS "," WS member )* )? WS "}"
    member  := key WS ":" WS value
    key     := BARE | string
    value   := string | NUMBER | "true" | "false" | "null" | object | array
    array   := "[" WS ( value ( WS "," WS value )* )? WS "]"
    string  := '<|"|>' any text without '<|"|>' '<|"|>'

- ``NAME``: a declared tool (letters, digits, ``_``, ``.``, ``-``).
- ``BARE``: a run of characters other than whitespace, ``{}[],:`` and the string delimiter.
- ``NUMBER``: a JSON number (finite). A bare value that is not a number, ``true``,
  ``false`` or ``null`` makes the call malformed.
- Strings have no escapes and may contain anything but the delimiter, including
  ``<tool_call|>``, brackets and newlines.
- The call is complete at its object's closing brace; the ``<tool_call|>`` after it is
  dropped if it comes next, and may be missing (e.g. at the end of the output). A malformed
  call, one cut off before its closing brace, or one to an undeclared tool is content,
  markup included. Several calls are several ``<|tool_call>`` blocks.

Cost: linear; the object is converted to JSON text and decoded once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from trioserve.model.tool_formats._json import loads
from trioserve.model.tool_formats.json_prefix import CanonicalPrefix
from trioserve.model.tool_formats.grammar import CallRules, GrammarPart, UnsupportedInFormat, literal, sequence, text_without
from trioserve.model.tool_formats.base import PENDING, Accept, BlockScanner, Reject, StepResult, ToolCallParser, ToolSchemas, build_call

__all__ = ["Gemma4Parser", "gemma_to_json"]

_OPEN = "<|tool_call>"
_CLOSE = "<tool_call|>"
_QUOTE = '<|"|>'
_CALL = "call:"

_NAME_CHARS = re.compile(r"[\w.\-]*")
_MAX_NAME = 256  # longer is prose, not a name (and bounds rescans)
_OUTSIDE = re.compile(r'<\|"\|>|[{}\[\]]')
_BARE = r'(?:(?!<\|"\|>)[^{}\[\],:\s])+'
_TOKEN = re.compile(
    r'(?P<string><\|"\|>.*?<\|"\|>)'
    rf"|(?P<key>{_BARE})\s*:"  # a bare key, with its colon
    r"|(?P<punct>[{}\[\],:])"
    r"|(?P<space>\s+)"
    rf"|(?P<bare>{_BARE})"
    r"|(?P<bad>.)",  # e.g. a string delimiter never closed
    re.DOTALL,
)
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")


class Gemma4Parser(ToolCallParser):
    """``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>``; grammar in the module
    doc."""

    format_name: ClassVar[str] = "gemma4"
    call_start_markers: ClassVar[tuple[str, ...]] = (_OPEN,)
    markers: ClassVar[tuple[str, ...]] = (_OPEN, _CLOSE, _QUOTE)
    call_suffixes: ClassVar[tuple[str, ...]] = (_CLOSE,)

    def _open_block(self, marker: str) -> BlockScanner:
        return _GemmaBlock(self.tools)

    def _preview(self, block: BlockScanner, buf: str) -> tuple[str, str] | None:
        """The call's name and the canonical prefix of its arguments: the object written so
        far translated to JSON as :func:`gemma_to_json` would (token by token; a string's
        characters as they arrive), through :class:`CanonicalPrefix`."""
        assert isinstance(block, _GemmaBlock)
        if block._extent is None:
            return None
        if block._preview is None:
            block._preview = _GemmaPreview(block._body_start)
        prefix = block._preview.advance(buf)
        return (block._name, prefix) if prefix is not None else None

    @classmethod
    def constrain(cls, calls: Sequence[CallRules], parallel: bool) -> GrammarPart:
        """``<|tool_call>call:NAME{key:value,…}<tool_call|>`` with the declared properties in
        order (required ones always); several blocks back to back when ``parallel``. Strings
        are ``<|"|>text<|"|>``; numbers, booleans and null are as in JSON. Nested objects and
        arrays, constrained strings and mixed types cannot be enforced in this syntax:
        UnsupportedInFormat. Free-form arguments get string values."""
        quote = literal(_QUOTE)
        rules: dict[str, str] = {"gemma-string": f"{quote} {text_without(_QUOTE)} {quote}"}
        alternatives = []
        for i, call in enumerate(calls):
            members = []
            for prop in call.properties:
                if prop.kind == "string":
                    value = "gemma-string"
                elif prop.kind == "choices" and all(_QUOTE not in c for c in prop.choices):
                    value = "(" + " | ".join(literal(_QUOTE + c + _QUOTE) for c in prop.choices) + ")"
                elif prop.kind == "json" and prop.scalar:
                    value = prop.json
                else:
                    raise UnsupportedInFormat(
                        "nested objects or arrays, constrained strings and mixed types cannot be "
                        "enforced in the gemma4 call format", f"{call.param}.properties.{prop.key}")
                members.append((f"{literal(_gemma_key(prop.key) + ':')} {value}", prop.key in call.required))
            body, more = sequence(f"gemma-p{i}", members, literal(","))
            rules.update(more)
            if call.open:
                member = f"[^{{}}\\[\\],:<| \\t\\n]+ {literal(':')} gemma-string"
                body = f"({member} ({literal(',')} {member})*)?"
            alternatives.append(f"{literal(_OPEN + _CALL + call.name + '{')} {body} "
                                f"{literal('}' + _CLOSE)}")
        rules["gemma-call"] = " | ".join(alternatives)
        return GrammarPart("gemma-call+" if parallel else "gemma-call", rules)


def _gemma_key(key: str) -> str:
    """A property name as Gemma writes it: bare when it can be, else a delimited string."""
    if key and re.fullmatch(_BARE, key) and not re.fullmatch(_SCALAR, key):
        return key
    return _QUOTE + key + _QUOTE


def gemma_to_json(text: str) -> str | None:
    """The JSON text of a Gemma value (``object`` or ``array`` in the module grammar): bare
    keys and delimited strings become JSON strings, the rest is copied. None if a token is
    not allowed (an unterminated string, a bare value that is not a JSON scalar); structure
    (brackets, commas, colons) is left for the JSON decoder to check. Iterative: nesting
    depth costs no stack here."""
    parts: list[str] = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "string":
            parts.append(json.dumps(m.group()[len(_QUOTE) : -len(_QUOTE)], ensure_ascii=False))
        elif kind == "key":
            parts.append(json.dumps(m.group("key"), ensure_ascii=False) + ":")
        elif kind == "punct":
            parts.append(m.group())
        elif kind == "bare" and _SCALAR.fullmatch(m.group()):
            parts.append(m.group())
        elif kind != "space":
            return None
    # Spaces keep adjacent bare tokens apart ("1 2" must not become 12).
    return " ".join(parts)


class _GemmaExtent:
    """End of the object starting at ``start``: brackets counted outside delimited strings.
    Resumable on a growing buffer; a delimiter split across deltas is re-examined.

    The same bracket count as ``_json.JsonExtent`` but not the same scanner: a Gemma string
    opens and closes with the five-character ``<|"|>`` and has no escapes, so its end is a
    substring search and a partly arrived delimiter must be looked at again, where a JSON
    string ends at an unescaped ``"`` and only a split escape waits. One scanner taking both
    string rules would put a strategy call on the JSON scanner's hot path for no shared
    line of logic but the depth counter."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._in_string = False

    def advance(self, buf: str) -> int | None:
        pos = self._pos
        while True:
            if self._in_string:
                i = buf.find(_QUOTE, pos)
                if i < 0:
                    break
                self._in_string, pos = False, i + len(_QUOTE)
                continue
            m = _OUTSIDE.search(buf, pos)
            if m is None:
                break
            pos = m.end()
            token = m.group()
            if token == _QUOTE:
                self._in_string = True
            elif token in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = pos
                    return pos
        # Not found: only the last few characters could begin a delimiter. Brackets are
        # never part of one, so none of them is counted twice.
        self._pos = max(pos, len(buf) - len(_QUOTE) + 1)
        return None


class _GemmaPreview:
    """Translates a growing Gemma object into JSON text piece by piece (the tokens of
    :data:`_TOKEN`, a string's text as it arrives) and keeps its canonical prefix."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._in_string = False
        self._canonical = CanonicalPrefix()
        self._prefix = ""

    def advance(self, buf: str) -> str | None:
        raw: list[str] = []
        pos, n = self._pos, len(buf)
        while pos < n and not self._canonical.failed:
            if self._in_string:
                end = buf.find(_QUOTE, pos)
                stop = end if end >= 0 else max(pos, n - len(_QUOTE) + 1)
                raw.append(json.dumps(buf[pos:stop], ensure_ascii=False)[1:-1])
                pos = stop
                if end < 0:
                    break
                raw.append('"')
                self._in_string, pos = False, end + len(_QUOTE)
                continue
            if buf.startswith(_QUOTE, pos):
                raw.append('"')
                self._in_string, pos = True, pos + len(_QUOTE)
                continue
            if _QUOTE.startswith(buf[pos:]):  # a delimiter may be arriving
                break
            c = buf[pos]
            if c in "{}[],:":
                raw.append(c)
                pos += 1
                continue
            if c.isspace():
                pos += 1
                continue
            bare = re.compile(_BARE).match(buf, pos)
            if bare is None:
                raw.append(c)  # the decoder refuses it: CanonicalPrefix stops
                pos += 1
                continue
            after = bare.end()
            while after < n and buf[after].isspace():
                after += 1
            if after >= n or (bare.end() == n):
                break  # the token, or what follows it, is still being written
            token = bare.group()
            raw.append(json.dumps(token, ensure_ascii=False) if buf[after] == ":" else
                       token if _SCALAR.fullmatch(token) else "\x00")
            pos = bare.end()
        self._pos = pos
        self._prefix += self._canonical.feed("".join(raw))
        return None if self._canonical.failed and not self._prefix else self._prefix


class _GemmaBlock:
    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        self._preview: _GemmaPreview | None = None
        self._name = ""
        self._extent: _GemmaExtent | None = None
        self._body_start = 0

    def step(self, buf: str, eof: bool) -> StepResult:
        if self._extent is None:
            head = buf[len(_OPEN) : len(_OPEN) + len(_CALL)]
            if not _CALL.startswith(head):
                return Reject(len(_OPEN))
            if len(head) < len(_CALL):
                return Reject(len(buf)) if eof else PENDING
            name_start = len(_OPEN) + len(_CALL)
            j = buf.find("{", name_start)
            name = buf[name_start : len(buf) if j < 0 else j]
            if len(name) > _MAX_NAME or not _NAME_CHARS.fullmatch(name):
                return Reject(len(_OPEN))
            if j < 0:
                return Reject(len(buf)) if eof else PENDING
            if name not in self._tools:
                return Reject(j)
            self._name, self._body_start = name, j
            self._extent = _GemmaExtent(j)
        end = self._extent.advance(buf)
        if end is None:
            return Reject(len(buf)) if eof else PENDING
        arguments = _decode(buf[self._body_start : end])
        call = build_call(self._name, arguments) if arguments is not None else None
        return Accept(end, [call]) if call is not None else Reject(end)


def _decode(body: str) -> dict[str, Any] | None:
    text = gemma_to_json(body)
    if text is None:
        return None
    value = loads(text)
    return value if isinstance(value, dict) else None
