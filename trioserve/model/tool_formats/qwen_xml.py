"""Qwen XML tool calls (Qwen3-Coder, Qwen 3.5): parameters as tagged text, typed by schema.

Grammar (``WS`` is any run of spaces, tabs and newlines, possibly empty)::

    block     := "<tool_call>" WS function ( WS function )* WS ( "</tool_call>" | END-OF-OUTPUT )
    function  := "<function=" NAME ">" ( WS parameter )* WS "</function>"
    parameter := "<parameter=" KEY ">" VALUE "</parameter>"

- ``NAME``: a declared tool (letters, digits, ``_``, ``.``, ``-``; surrounding spaces
  ignored). ``KEY``: any text without ``<``, ``>`` or a newline, spaces around it ignored;
  a key may appear once per function.
- ``VALUE`` is raw text, newlines included, and ends at the first ``</parameter>`` that is
  followed (after ``WS``) by ``<parameter=`` or ``</function>``; an earlier
  ``</parameter>`` is part of the value. (So a value may contain ``</tool_call>``,
  ``</function>`` or a lone ``</parameter>``; it cannot contain ``</parameter>`` followed
  by one of those two tags.)
- The format puts a newline after ``>`` and before ``</parameter>``: exactly one leading and
  one trailing newline is removed from every value. The rest is then typed by the tool's
  JSON schema for that key (``parameters.properties[KEY]``), see :func:`coerce_value`.
- A block that is cut off, malformed, or calls an undeclared tool is content, tags
  included. A block left unclosed at the end of the output counts if its functions are
  complete. Whatever the text, parsing never raises.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from trioserve.strict_json import json_type_name
from trioserve.model.tool_formats._json import INVALID, loads
from trioserve.model.tool_formats._text import MORE, match_literal
from trioserve.model.tool_formats.grammar import CallRules, GrammarPart, UnsupportedInFormat, literal, sequence, text_without
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

__all__ = ["QwenXmlParser", "coerce_value"]

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"

_NAME = re.compile(r"\s*[\w.\-]*\s*")
_KEY = re.compile(r"[^<>\n]*")
_escape = json.encoder.encode_basestring
_MAX_HEAD = 256  # longest name or key read; longer is prose, not a tag (and bounds rescans)


class QwenXmlParser(ToolCallParser):
    """``<tool_call><function=NAME><parameter=KEY>value</parameter>…</function></tool_call>``;
    grammar and value typing in the module doc."""

    format_name: ClassVar[str] = "qwen_xml"
    call_start_markers: ClassVar[tuple[str, ...]] = (_OPEN,)
    markers: ClassVar[tuple[str, ...]] = (
        _OPEN, _CLOSE, _FUNCTION, _FUNCTION_END, _PARAMETER, _PARAMETER_END,
    )

    def _open_block(self, marker: str) -> BlockScanner:
        return _QwenBlock(self.tools)

    def _preview(self, block: BlockScanner, buf: str) -> tuple[str, str] | None:
        """The first function's name and the canonical prefix of its arguments: the
        parameters read so far as the encoder writes them, then the value being written
        when its schema makes it verbatim text (a typed value is known only once complete).
        A value's text is certain up to where its end tag could begin, less one newline
        that may turn out to be the one removed before the end tag."""
        assert isinstance(block, _QwenBlock)
        if block._calls or block._state == _EXPECT_FUNCTION or block._state == _IN_NAME:
            return None
        try:
            encoded = json.dumps(block._arguments, ensure_ascii=False)[:-1]
        except (RecursionError, ValueError):  # build_call refuses these arguments too
            return None
        if block._state != _IN_VALUE:
            return block._name, encoded
        schema = _parameter_schema(self.tools[block._name], block._key)
        if _schema_types(schema) - {"string"}:
            return block._name, encoded
        text = buf[block._value_start:max(block._pos, block._value_start)]
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        head = (", " if block._arguments else "") + json.dumps(block._key, ensure_ascii=False)
        return block._name, encoded + head + ': "' + _escape(text)[1:-1]

    @classmethod
    def constrain(cls, calls: Sequence[CallRules], parallel: bool) -> GrammarPart:
        """``<tool_call>\\n<function=NAME>\\n`` then each declared parameter in order
        (required ones always, optional ones or not) as ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``,
        then ``</function>\\n</tool_call>``; several blocks separated by a newline when
        ``parallel``. A string value is raw text without ``</parameter>``; a value whose
        schema allows no string is its JSON (what :func:`coerce_value` reads back). A
        property that allows constrained strings, or strings among other types, cannot be
        enforced in raw text: UnsupportedInFormat."""
        rules: dict[str, str] = {"qwen-text": text_without(_PARAMETER_END)}
        alternatives = []
        for i, call in enumerate(calls):
            members = []
            for prop in call.properties:
                if prop.kind == "string":
                    value = "qwen-text"
                elif prop.kind == "choices" and all(_PARAMETER_END not in c for c in prop.choices):
                    value = "(" + " | ".join(literal(c) for c in prop.choices) + ")"
                elif prop.kind == "json":
                    value = prop.json
                else:
                    raise UnsupportedInFormat(
                        "a string with constraints (or strings among other types) cannot be "
                        "enforced in the qwen_xml call format, whose values are raw text",
                        f"{call.param}.properties.{prop.key}")
                # The newline before </parameter> is optional: a model that writes the tag
                # right after the value must be able to close it (the parser removes one
                # trailing newline only when there is one).
                members.append((f'{literal(_PARAMETER + prop.key + ">" + chr(10))} {value} '
                                f'{literal(chr(10))}? {literal(_PARAMETER_END + chr(10))}',
                                prop.key in call.required))
            params, more = sequence(f"qwen-p{i}", members, None)
            rules.update(more)
            if call.open:
                params = (f'({literal(_PARAMETER)} [^<>\\n]+ {literal(">" + chr(10))} qwen-text '
                          f'{literal(chr(10))}? {literal(_PARAMETER_END + chr(10))})*')
            alternatives.append(f'{literal(_FUNCTION + call.name + ">" + chr(10))} {params} '
                                f'{literal(_FUNCTION_END + chr(10))}')
        rules["qwen-call"] = (f'{literal(_OPEN + chr(10))} ({" | ".join(alternatives)}) '
                              f'{literal(_CLOSE)}')
        return GrammarPart(f'qwen-call ({literal(chr(10))} qwen-call)*' if parallel else "qwen-call",
                           rules)


# --- value typing ----------------------------------------------------------------------------


def _schema_types(schema: Any) -> set[str]:
    """JSON types a schema allows, read from ``type`` (a name or a list), the ``type`` of
    each ``anyOf``/``oneOf`` member (one level: schemas are client input), or else the
    values of ``enum``/``const``. Empty when the schema says nothing usable."""
    if not isinstance(schema, Mapping):
        return set()
    types = _type_names(schema.get("type"))
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list):
            for member in members:
                if isinstance(member, Mapping):
                    types |= _type_names(member.get("type"))
    if not types:
        values = schema.get("enum")
        if not isinstance(values, list):
            values = [schema["const"]] if "const" in schema else []
        types = {_json_type(v) for v in values}
    return types


def _type_names(value: Any) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, str)}
    return set()


_json_type = json_type_name


def _allowed(value: Any, types: set[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def coerce_value(raw: str, schema: Any) -> Any:
    """The argument value of one ``<parameter>``: ``raw`` is the text between the tags.

    One leading and one trailing newline are removed. If the schema allows only strings, or
    says nothing usable about the type (no schema, no ``type``), the text is the value,
    verbatim. Otherwise the text (stripped of surrounding whitespace) is decoded as strict
    JSON and used if its type is one the schema allows (an integer also satisfies
    ``number``); ``True``/``False`` in any letter case count as booleans where booleans are
    allowed. In every other case (does not decode, wrong type, nested too deep) the text is
    kept as a string: a typing mismatch never loses the call or raises.
    """
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    types = _schema_types(schema)
    if not types - {"string"}:
        return text
    stripped = text.strip()
    value = loads(stripped)
    if value is not INVALID and _allowed(value, types):
        return value
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    return text


def _parameter_schema(tool_schema: Mapping[str, Any] | None, key: str) -> Any:
    if not isinstance(tool_schema, Mapping):
        return None
    properties = tool_schema.get("properties")
    return properties.get(key) if isinstance(properties, Mapping) else None


# --- scanner ----------------------------------------------------------------------------------

# States: where the scanner stands in the grammar.
_EXPECT_FUNCTION = 0  # before a function (or, after one, the closing tag)
_IN_NAME = 1  # after "<function=", before ">"
_EXPECT_PARAMETER = 2  # inside a function: a parameter or "</function>"
_IN_KEY = 3  # after "<parameter=", before ">"
_IN_VALUE = 4  # after "<parameter=KEY>", looking for the value's end


class _QwenBlock:
    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools
        self._state = _EXPECT_FUNCTION
        self._pos = len(_OPEN)  # where the current state resumes
        self._calls: list[ToolCall] = []
        self._name = ""
        self._arguments: dict[str, Any] = {}
        self._key = ""
        self._value_start = 0

    def step(self, buf: str, eof: bool) -> StepResult:
        while True:
            result = self._advance(buf, eof)
            if result is not None:
                return result

    def _truncated(self, buf: str, eof: bool) -> StepResult:
        """The text ends inside the grammar: wait, or at the end of output, give up."""
        return Reject(len(buf)) if eof else PENDING

    def _advance(self, buf: str, eof: bool) -> StepResult | None:
        """One grammar step; None when the state changed and scanning should go on."""
        if self._state == _EXPECT_FUNCTION:
            options = (_FUNCTION, _CLOSE) if self._calls else (_FUNCTION,)
            lit, i = match_literal(buf, self._pos, options)
            if lit is MORE:
                self._pos = i
                if eof and self._calls and i == len(buf):  # closing tag never came
                    return Accept(len(buf), self._calls)
                return self._truncated(buf, eof)
            if lit is None:
                return Reject(i)
            if lit == _CLOSE:
                return Accept(i, self._calls)
            self._state, self._pos = _IN_NAME, i
            return None

        if self._state == _IN_NAME:
            j = buf.find(">", self._pos)
            head = buf[self._pos : len(buf) if j < 0 else j]
            if len(head) > _MAX_HEAD or not _NAME.fullmatch(head):
                return Reject(self._pos)
            if j < 0:
                return self._truncated(buf, eof)
            name = head.strip()
            if name not in self._tools:
                return Reject(j + 1)
            self._name, self._arguments = name, {}
            self._state, self._pos = _EXPECT_PARAMETER, j + 1
            return None

        if self._state == _EXPECT_PARAMETER:
            lit, i = match_literal(buf, self._pos, (_PARAMETER, _FUNCTION_END))
            if lit is MORE:
                self._pos = i
                return self._truncated(buf, eof)
            if lit is None:
                return Reject(i)
            if lit == _FUNCTION_END:
                call = build_call(self._name, self._arguments)
                if call is None:
                    return Reject(i)
                self._calls.append(call)
                self._state, self._pos = _EXPECT_FUNCTION, i
                return None
            self._state, self._pos = _IN_KEY, i
            return None

        if self._state == _IN_KEY:
            j = buf.find(">", self._pos)
            head = buf[self._pos : len(buf) if j < 0 else j]
            if len(head) > _MAX_HEAD or not _KEY.fullmatch(head):
                return Reject(self._pos)
            if j < 0:
                return self._truncated(buf, eof)
            key = head.strip()
            if not key or key in self._arguments:
                return Reject(j + 1)
            self._key = key
            self._state = _IN_VALUE
            self._pos = self._value_start = j + 1
            return None

        # _IN_VALUE: self._pos is where to look for the next candidate end tag.
        while (k := buf.find(_PARAMETER_END, self._pos)) >= 0:
            after = k + len(_PARAMETER_END)
            lit, _ = match_literal(buf, after, (_PARAMETER, _FUNCTION_END))
            if lit is None:  # not followed by a tag: this end tag is part of the value
                self._pos = k + 1
                continue
            if lit is MORE:  # cannot tell yet (at the end: the function is cut off)
                self._pos = k
                return self._truncated(buf, eof)
            schema = _parameter_schema(self._tools[self._name], self._key)
            self._arguments[self._key] = coerce_value(buf[self._value_start : k], schema)
            self._state, self._pos = _EXPECT_PARAMETER, after
            return None
        # Only the last few characters could still begin an end tag.
        self._pos = max(self._pos, len(buf) - len(_PARAMETER_END) + 1)
        return self._truncated(buf, eof)
