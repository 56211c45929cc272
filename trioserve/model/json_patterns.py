"""JSON Schema ``pattern`` → a GBNF-safe regular expression for strings inside JSON.

The schema converter turns a pattern into grammar rules over the characters of a JSON string.
A pattern written for decoded text must not let the model write what a JSON string cannot hold
unescaped (control characters, ``"``, ``\\``), so :func:`rewrite_pattern` rewrites classes,
escapes and the ``.`` wildcard into explicit code-point ranges without those, and counts the
repetition it implies (the caller bounds it: ``schema_subset.REPEAT_BUDGET``). Pure: no I/O.
"""

from __future__ import annotations

import re
from typing import Iterable

__all__ = ["rewrite_pattern", "MAX_REPEAT"]

# minItems/maxItems/minLength/maxLength and {m,n} bounds. The converter writes a bound n as n
# nested optional groups; llama.cpp's grammar parser refuses more than 1000 of them.
MAX_REPEAT = 1000

# Code points a JSON string cannot hold unescaped: control characters, '"' and '\'. (DEL is
# legal JSON but excluded as llama.cpp's own string rule does.)
_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)]
_MAX_CP = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
# ECMA-262 \s (JSON Schema patterns are ECMA-262 regular expressions).
_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
_SHORTHANDS = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_LINE_BREAKS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_CONTROL_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B}
_REGEX_SPECIAL = set(".^$*+?()[]{}|\\")
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for lo, hi in _merge(ranges + [_SURROGATES]):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CP:
        out.append((start, _MAX_CP))
    return out


def _minus(ranges: list[tuple[int, int]], remove: list[tuple[int, int]]) -> list[tuple[int, int]]:
    keep = _complement(remove)
    out = []
    for lo, hi in _merge(ranges):
        for klo, khi in keep:
            a, b = max(lo, klo), min(hi, khi)
            if a <= b:
                out.append((a, b))
    return _merge(out)


def _gbnf_char(cp: int) -> str:
    if cp <= 0xFF:
        return f"\\x{cp:02X}"
    if cp <= 0xFFFF:
        return f"\\u{cp:04X}"
    return f"\\U{cp:08X}"


def _class_text(ranges: list[tuple[int, int]]) -> str:
    """A character class of JSON-safe characters, in syntax that the converter copies as is
    and GBNF reads (every character hex-escaped, so no regex/GBNF metacharacter remains)."""
    safe = _minus(ranges, _UNSAFE)
    if not safe:
        raise ValueError("a character class whose characters all need JSON escapes "
                         "(quote, backslash, control characters) cannot be enforced")
    items = (_gbnf_char(lo) if lo == hi else f"{_gbnf_char(lo)}-{_gbnf_char(hi)}" for lo, hi in safe)
    return "[" + "".join(items) + "]"


def _literal_text(cp: int) -> str:
    """One literal character in the converter's regex dialect, producing its JSON encoding."""
    if cp == 0x22:
        return '(\\\\")'  # regex \\ then " : the converter writes GBNF "\\\"" = JSON \"
    if cp == 0x5C:
        return "(\\\\\\\\)"  # JSON \\
    if cp < 0x20 or cp == 0x7F:
        return f"(\\\\u{cp:04x})"  # JSON \u00XX
    if chr(cp) in _REGEX_SPECIAL:
        return f"[{_gbnf_char(cp)}]"
    return chr(cp)


def _parse_escape(pattern: str, i: int, in_class: bool) -> tuple[list[tuple[int, int]], int]:
    """The characters of the escape at ``pattern[i] == '\\\\'`` and the index after it."""
    if i + 1 >= len(pattern):
        raise ValueError("the pattern ends with a lone backslash")
    c = pattern[i + 1]
    if c in _SHORTHANDS:
        return _SHORTHANDS[c], i + 2
    if c.lower() in _SHORTHANDS:  # \D \W \S
        return _complement(_SHORTHANDS[c.lower()]), i + 2
    if c in _CONTROL_ESCAPES:
        cp = _CONTROL_ESCAPES[c]
        return [(cp, cp)], i + 2
    if c in "xu":
        width = 2 if c == "x" else 4
        digits = pattern[i + 2:i + 2 + width]
        if len(digits) != width or not all(ch in "0123456789abcdefABCDEF" for ch in digits):
            raise ValueError(f"\\{c} needs {width} hex digits")
        cp = int(digits, 16)
        return [(cp, cp)], i + 2 + width
    if c == "b" and in_class:  # backspace inside a class
        return [(0x08, 0x08)], i + 2
    if c.isalnum():
        raise ValueError(f"the escape \\{c} is not supported (word boundaries, back-references "
                         "and character properties cannot be enforced)")
    return [(ord(c), ord(c))], i + 2  # an escaped punctuation character stands for itself


def _parse_class(pattern: str, i: int) -> tuple[list[tuple[int, int]], int]:
    """The characters of the class starting at ``pattern[i] == '['`` and the index after it."""
    i += 1
    negated = i < len(pattern) and pattern[i] == "^"
    if negated:
        i += 1
    items: list[tuple[int, int]] = []
    first = True
    while True:
        if i >= len(pattern):
            raise ValueError("an unterminated character class")
        c = pattern[i]
        if c == "]" and not first:
            i += 1
            break
        first = False
        if c == "\\":
            chars, i = _parse_escape(pattern, i, in_class=True)
        else:
            chars, i = [(ord(c), ord(c))], i + 1
        single = len(chars) == 1 and chars[0][0] == chars[0][1]
        if single and i + 1 < len(pattern) and pattern[i] == "-" and pattern[i + 1] != "]":
            if pattern[i + 1] == "\\":
                end, i = _parse_escape(pattern, i + 1, in_class=True)
            else:
                end, i = [(ord(pattern[i + 1]),) * 2], i + 2
            if len(end) != 1 or end[0][0] != end[0][1] or end[0][0] < chars[0][0]:
                raise ValueError("an invalid range in a character class")
            chars = [(chars[0][0], end[0][0])]
        items.extend(chars)
    return (_complement(items) if negated else _merge(items)), i


def _quantifier(body: str, i: int) -> tuple[str, int, int]:
    """The quantifier at ``body[i]`` (``*``, ``+``, ``?`` or ``{m,n}``): its text in the
    converter's dialect, the index after it, and its largest bound (0 for the unbounded
    ones). A lazy ``?`` after it is dropped (it matches the same strings)."""
    bound = 0
    if body[i] == "{":
        m = _QUANTIFIER.match(body, i)
        assert m is not None
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        bound = max(lo, hi or 0)
        if bound > MAX_REPEAT:
            raise ValueError(f"repetition bounds above {MAX_REPEAT} cannot be enforced")
        text, i = m.group(0), m.end()
    else:
        text, i = body[i], i + 1
    if i < len(body) and body[i] == "?":
        i += 1  # lazy: matches the same strings
    elif i < len(body) and body[i] == "+":
        raise ValueError("possessive quantifiers are not supported")
    return text, i, bound


def rewrite_pattern(pattern: str) -> tuple[str, int]:
    """Rewrite a JSON Schema ``pattern`` into the converter's regex dialect.

    Returns ``(rewritten, repeats)``: a pattern anchored as ``^(...)$`` that the converter
    translates into a grammar for the *JSON text* of matching strings, and the sum of its
    ``{m,n}`` bounds (for the size budget). Exact, except that ``.``, classes and shorthand
    escapes lose their quote/backslash/control members (narrower, still matching).

    What the converter cannot do and this does: ``\\d``/``\\w``/``\\s`` (and negations),
    escaped punctuation (``\\.``), ``(?:``, lazy quantifiers, unanchored patterns (JSON Schema
    patterns search: ``.*`` is added on a free side), JSON escaping of literal ``"``, ``\\`` and
    control characters, and a top-level ``|`` (grouped). Raises ValueError, saying why, for
    lookarounds, back-references, word boundaries, inner anchors and invalid patterns.
    """
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a valid regular expression: {exc}") from None
    body = pattern
    start_anchored = body.startswith("^")
    if start_anchored:
        body = body[1:]
    trailing_backslashes = len(body[:-1]) - len(body[:-1].rstrip("\\")) if body.endswith("$") else 0
    end_anchored = body.endswith("$") and trailing_backslashes % 2 == 0
    if end_anchored:
        body = body[:-1]
    dot = _class_text(_complement(_LINE_BREAKS))
    out: list[str] = []
    repeats = 0
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            chars, i = _parse_escape(body, i, in_class=False)
            single = len(chars) == 1 and chars[0][0] == chars[0][1]
            out.append(_literal_text(chars[0][0]) if single else _class_text(chars))
        elif c == "[":
            chars, i = _parse_class(body, i)
            out.append(_class_text(chars))
        elif c == "(":
            if body.startswith("(?:", i):
                i += 3
            elif body.startswith("(?", i):
                raise ValueError("lookarounds, named groups and inline flags are not supported")
            else:
                i += 1
            out.append("(")
        elif c in ")|":
            out.append(c)
            i += 1
        elif c == "{" and body.startswith("{,", i):
            raise ValueError("'{,n}' means different things in different regex dialects; "
                             "write '{0,n}'")
        elif c in "*+?" or (c == "{" and _QUANTIFIER.match(body, i)):
            text, i, bound = _quantifier(body, i)
            out.append(text)
            repeats += bound
        elif c == ".":
            out.append(dot)
            i += 1
        elif c in "^$":
            raise ValueError("anchors are supported only at the very start and end")
        else:
            out.append(_literal_text(ord(c)))
            i += 1
    free = f"{dot}*"
    rewritten = "^" + ("" if start_anchored else free) + "(" + "".join(out) + ")" + (
        "" if end_anchored else free) + "$"
    return rewritten, repeats
