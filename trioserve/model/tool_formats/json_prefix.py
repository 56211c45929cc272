"""The certain prefix of a JSON value's canonical form while its text is still being written.

A call's ``arguments`` are sent as ``json.dumps(value, ensure_ascii=False)`` of the decoded
object (``base.make_tool_call``), not as the model wrote them (whitespace, escapes and number
spellings differ). To stream them as they are written, :class:`CanonicalPrefix` reads the raw
text piece by piece and returns, after each piece, the canonical text that is now certain:
punctuation with the encoder's separators (``", "``, ``": "``), each string character as the
encoder escapes it as soon as it is decoded, a number once it has ended (``1E2`` → ``100.0``,
``-0`` → ``0``), a literal once complete. Whatever the rest of the text turns out to be, if the
whole decodes to a value ``v`` then everything returned so far is a prefix of
``json.dumps(v, ensure_ascii=False)``, with one exception the caller must rule out: an object
that repeats a key (the decoder keeps the last value at the first key's place). A repeated key
makes :attr:`CanonicalPrefix.failed` true and nothing more is returned.

Syntax errors also set ``failed`` (the caller stops streaming; the parser decides about the
call as always). Linear in the text; no recursion (a stack of containers).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["CanonicalPrefix", "JsonCallPreview"]

_escape = json.encoder.encode_basestring
_WS = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                   "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class CanonicalPrefix:
    """Incremental canonical prefix of one JSON object (module docstring). Feed raw text
    with :meth:`feed`; each call returns the newly certain canonical text ("" if none).
    ``done``: the object is complete (later text is not read)."""

    def __init__(self) -> None:
        self.failed = False
        self.done = False
        self._stack: list[set[str]] = []  # per open container: an object's keys, or None-like
        self._kinds: list[str] = []  # "{" or "["
        self._expect = "top"  # top | value | value_or_close | key | key_or_close | colon | comma_or_close
        self._pending = ""  # raw text of an unfinished token (number, literal, escape)
        self._string: str | None = None  # "key" or "value" while inside a string
        self._key: list[str] = []

    def feed(self, text: str) -> str:
        if self.failed or self.done:
            return ""
        buf = self._pending + text
        self._pending = ""
        out: list[str] = []
        i, n = 0, len(buf)
        while i < n and not (self.failed or self.done):
            if self._string is not None:
                i = self._in_string(buf, i, out)
                if i < 0:
                    break
                continue
            c = buf[i]
            if c in _WS:
                i += 1
            elif c == '"':
                self._open_string(out)
                i += 1
            elif c in "{[":
                self._value(out)
                if not self.failed:
                    out.append(c)
                    self._kinds.append(c)
                    self._stack.append(set())
                    self._expect = "key_or_close" if c == "{" else "value_or_close"
                i += 1
            elif c in "}]":
                self._close(c, out)
                i += 1
            elif c == ",":
                if self._expect != "comma_or_close":
                    self.failed = True
                    break
                out.append(", ")
                self._expect = "key" if self._kinds[-1] == "{" else "value"
                i += 1
            elif c == ":":
                if self._expect != "colon":
                    self.failed = True
                    break
                out.append(": ")
                self._expect = "value"
                i += 1
            elif c in _NUMBER_CHARS or c in _LITERALS:
                j = i
                chars = _NUMBER_CHARS if c in _NUMBER_CHARS else frozenset("truefalsn")
                while j < n and buf[j] in chars:
                    j += 1
                if j == n:  # the token may go on in the next piece
                    self._pending = buf[i:]
                    break
                self._scalar(buf[i:j], out)
                i = j
            else:
                self.failed = True
        return "".join(out)

    # -- helpers ----------------------------------------------------------------------------

    def _value(self, out: list[str]) -> None:
        """A value begins: legal only where one is expected (the top: an object only)."""
        if self._expect == "top":
            return
        if self._expect not in ("value", "value_or_close"):
            self.failed = True

    def _after_value(self) -> None:
        if not self._kinds:
            self.done = True
        else:
            self._expect = "comma_or_close"

    def _close(self, c: str, out: list[str]) -> None:
        kind = "{" if c == "}" else "["
        if (not self._kinds or self._kinds[-1] != kind
                or self._expect not in ("comma_or_close", "key_or_close" if kind == "{" else "value_or_close")):
            self.failed = True
            return
        self._kinds.pop()
        self._stack.pop()
        out.append(c)
        self._after_value()

    def _open_string(self, out: list[str]) -> None:
        if self._expect in ("key", "key_or_close"):
            self._string = "key"
            self._key = []
        elif self._expect in ("value", "value_or_close"):
            self._string = "value"
            out.append('"')
        else:
            self.failed = True

    def _scalar(self, raw: str, out: list[str]) -> None:
        self._value(out)
        if self.failed or self._expect == "top":
            self.failed = True  # the top level must be an object
            return
        if raw in ("true", "false", "null"):
            out.append(raw)
        else:
            text = _number_text(raw)
            if text is None:
                self.failed = True
                return
            out.append(text)
        self._after_value()

    def _in_string(self, buf: str, i: int, out: list[str]) -> int:
        """Consume string text from ``i``; the index to go on from, or -1 when the rest of
        ``buf`` (an unfinished escape) was kept for the next piece."""
        n = len(buf)
        chars: list[str] = []
        while i < n:
            c = buf[i]
            if c == '"':
                self._end_string(chars, out)
                return i + 1
            if c == "\\":
                decoded, used = _escape_at(buf, i)
                if used == 0:  # incomplete
                    self._emit_chars(chars, out)
                    self._pending = buf[i:]
                    return -1
                if decoded is None:
                    self.failed = True
                    return n
                chars.append(decoded)
                i += used
                continue
            if c < " ":  # the decoder refuses raw control characters
                self.failed = True
                return n
            chars.append(c)
            i += 1
        self._emit_chars(chars, out)
        return n

    def _emit_chars(self, chars: list[str], out: list[str]) -> None:
        if self._string == "key":
            self._key.extend(chars)
        elif chars:
            out.append(_escape("".join(chars))[1:-1])
        chars.clear()

    def _end_string(self, chars: list[str], out: list[str]) -> None:
        kind = self._string
        self._emit_chars(chars, out)
        self._string = None
        if kind == "key":
            key = "".join(self._key)
            if key in self._stack[-1]:
                self.failed = True  # the decoder would move this value to the first key's place
                return
            self._stack[-1].add(key)
            out.append(_escape(key))
            self._expect = "colon"
        else:
            out.append('"')
            self._after_value()


def _escape_at(buf: str, i: int) -> tuple[str | None, int]:
    """The character the escape at ``buf[i]`` (a backslash) decodes to and its length; length
    0 when the escape is not complete in ``buf`` yet; None for an invalid escape. A high
    surrogate followed by a low-surrogate escape decodes to the pair's character, as the
    decoder does; alone, it stays a lone surrogate (as the decoder keeps it)."""
    n = len(buf)
    if i + 1 >= n:
        return None, 0
    c = buf[i + 1]
    if c in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[c], 2
    if c != "u":
        return None, 2
    if i + 6 > n:
        return None, 0
    digits = buf[i + 2:i + 6]
    if not all(d in _HEX for d in digits):
        return None, 6
    code = int(digits, 16)
    if 0xD800 <= code <= 0xDBFF:
        rest = buf[i + 6:i + 12]
        if len(rest) < 6 and ("\\u".startswith(rest[:2]) if rest else True):
            return None, 0  # a low surrogate may still follow
        if (len(rest) == 6 and rest[:2] == "\\u" and all(d in _HEX for d in rest[2:])
                and 0xDC00 <= int(rest[2:], 16) <= 0xDFFF):
            low = int(rest[2:], 16)
            return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
    return chr(code), 6


def _number_text(raw: str) -> str | None:
    """The encoder's spelling of a JSON number, or None when ``raw`` is not one (or overflows)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return json.dumps(value)


# The head of a JSON call object up to its arguments object, after the format's marker (and
# an opening "[" of a list of calls): what the grammars write (tool_formats.*.constrain).
_CALL_HEAD = re.compile(r'\s*\[?\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.:-]*)"\s*,\s*'
                        r'"(?:arguments|parameters)"\s*:\s*(?=\{)')


class JsonCallPreview:
    """``ToolCallParser.preview`` for formats whose calls are ``{"name": …, "arguments"|
    "parameters": {…}}`` objects after a start marker: once the head up to the arguments
    object has arrived and names a declared tool, the canonical prefix of the arguments
    (:class:`CanonicalPrefix`) as it grows. One instance per parser; it follows the block."""

    def __init__(self, tools: Mapping[str, Any]) -> None:
        self._tools = tools
        self._block: object = None
        self._name: str | None = None
        self._fed = -1  # buf offset read so far; -1: head not seen yet; -2: no preview
        self._prefix = ""
        self._canonical = CanonicalPrefix()

    def preview(self, block: object, buf: str, marker_len: int) -> tuple[str, str] | None:
        if block is not self._block:
            self._block, self._name, self._fed, self._prefix = block, None, -1, ""
            self._canonical = CanonicalPrefix()
        if self._fed == -2:
            return None
        if self._fed == -1:
            head = _CALL_HEAD.match(buf, marker_len)
            if head is None:
                return None
            if head.group(1) not in self._tools:
                self._fed = -2
                return None
            self._name, self._fed = head.group(1), head.end()
        self._prefix += self._canonical.feed(buf[self._fed:])
        self._fed = len(buf)
        assert self._name is not None
        return self._name, self._prefix
