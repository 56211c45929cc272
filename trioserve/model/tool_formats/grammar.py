"""What a tool-call format needs to constrain output to its own call syntax (GBNF).

``core/constraints.py`` compiles the JSON-Schema side (one rule per call's arguments and per
declared property) and hands each format's :meth:`ToolCallParser.constrain` a
:class:`CallRules` per callable tool; the format answers a :class:`GrammarPart`: the GBNF
expression for "the calls" (one, or several when ``parallel``) plus any helper rules. The
format writes exactly the syntax its own parser reads, so a forced call always parses.

A format that cannot enforce a property's schema in its syntax raises
:class:`UnsupportedInFormat` (the caller answers 400 naming the property), never a weaker
constraint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "CallRules",
    "GrammarPart",
    "PropertyRules",
    "UnsupportedInFormat",
    "literal",
    "sequence",
    "text_without",
]


@dataclass(frozen=True)
class PropertyRules:
    """One declared property of a tool's parameters.

    Attributes:
        key: the property name.
        json: GBNF rule name for its value as compact JSON.
        kind: ``"string"`` (any string: raw-text formats write it verbatim), ``"choices"``
            (a fixed set of strings: :attr:`choices`), ``"json"`` (no string is allowed:
            the JSON rule is the value in every format), or ``"mixed"`` (strings with
            constraints, or strings among other types: only JSON formats can enforce it).
        choices: the allowed strings for ``"choices"``.
        scalar: the value can only be a number, boolean or null (no object or array).
    """

    key: str
    json: str
    kind: str
    choices: tuple[str, ...] = ()
    scalar: bool = False


@dataclass(frozen=True)
class CallRules:
    """One tool a constrained call may name.

    Attributes:
        name: the tool's name.
        arguments: GBNF rule name for its arguments as one compact JSON object.
        properties: its declared properties, in declaration order.
        required: the names of the required ones.
        open: no declared properties and extra keys allowed (free-form arguments).
        param: the request path of its parameters schema, for errors.
    """

    name: str
    arguments: str
    properties: tuple[PropertyRules, ...] = ()
    required: frozenset[str] = field(default_factory=frozenset)
    open: bool = False
    param: str = ""


@dataclass(frozen=True)
class GrammarPart:
    """``expression``: GBNF for the calls; ``rules``: helper rules it uses (name → body)."""

    expression: str
    rules: dict[str, str] = field(default_factory=dict)


class UnsupportedInFormat(ValueError):
    """A schema the format's syntax cannot enforce; ``param`` is the request path."""

    def __init__(self, reason: str, param: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.param = param


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    out = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{out}"'


def _char_class_excluding(*chars: str) -> str:
    escapes = {"\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-", "\n": "\\n", "\r": "\\r"}
    return "[^" + "".join(escapes.get(c, c) for c in dict.fromkeys(chars)) + "]"


def text_without(stop: str) -> str:
    """A GBNF expression for any text (possibly empty) that does not contain ``stop``, whose
    first character must not recur in it (true of every delimiter the formats use).

    Built as the usual automaton: any character but the first of ``stop``, or a proper
    prefix of ``stop`` followed by a character that neither continues it nor starts it
    again. A narrowing, never a widening: the text may not end with a proper prefix of
    ``stop`` nor hold one directly followed by the first character of ``stop`` (``"<<"``
    for ``</parameter>``)."""
    assert stop and stop[0] not in stop[1:]
    alternatives = [_char_class_excluding(stop[0])]
    for k in range(1, len(stop)):
        nxt = stop[k]
        alternatives.append(f"{literal(stop[:k])} {_char_class_excluding(nxt, stop[0])}")
    return "(" + " | ".join(alternatives) + ")*"


def sequence(prefix: str, members: list[tuple[str, bool]], separator: str | None
             ) -> tuple[str, dict[str, str]]:
    """Members in the given order, each ``(expression, required)``; optional ones may be left
    out, and ``separator`` (a GBNF expression, or None) goes between the ones written.

    Returns the expression and its helper rules (named ``prefix-n<i>`` / ``prefix-s<i>``:
    "from member i, none written yet" / "some written")."""
    rules: dict[str, str] = {}
    n = len(members)
    if n == 0:
        return '""', rules

    def none_yet(i: int) -> str:
        return f"{prefix}-n{i}" if i < n else '""'

    def some(i: int) -> str:
        return f"{prefix}-s{i}" if i < n else '""'

    sep = f"{separator} " if separator else ""
    for i, (expr, required) in enumerate(members):
        rules[f"{prefix}-s{i}"] = (f"{sep}{expr} {some(i + 1)}" if required
                                   else f"({sep}{expr})? {some(i + 1)}")
        rules[f"{prefix}-n{i}"] = (f"{expr} {some(i + 1)}" if required
                                   else f"{expr} {some(i + 1)} | {none_yet(i + 1)}")
    return none_yet(0), rules
