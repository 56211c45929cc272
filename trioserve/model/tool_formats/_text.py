"""Small text matchers shared by the tag-based formats."""

from __future__ import annotations

from typing import Final


class _More:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MORE"


MORE: Final = _More()
"""The text ends before it can tell: wait for more (or, at the end of output, give up)."""

_WS = " \t\r\n"


def skip_ws(buf: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not whitespace (``len(buf)`` if none)."""
    n = len(buf)
    while pos < n and buf[pos] in _WS:
        pos += 1
    return pos


def match_literal(buf: str, pos: int, literals: tuple[str, ...]) -> tuple[str | _More | None, int]:
    """Which of ``literals`` starts at the first non-blank index ``i`` at or after ``pos``.

    Returns ``(literal, i + len(literal))`` on a match, ``(MORE, i)`` when the text ends in
    a proper prefix of one of them (or right at ``i``), ``(None, i)`` when none can start
    there.
    """
    i = skip_ws(buf, pos)
    rest = buf[i : i + max(len(lit) for lit in literals)]
    for lit in literals:
        if rest.startswith(lit):
            return lit, i + len(lit)
    if any(lit.startswith(rest) for lit in literals):
        return MORE, i
    return None, i
