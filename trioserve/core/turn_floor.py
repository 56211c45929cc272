"""Refusing a conversation that cannot fit before paying for it message by message.

A request of 110,000 empty chat messages is 3.6 MB of JSON; parsing, validating and rendering
it costs the control plane about 80 µs per message (seconds in all) before the worker's token
count can say it does not fit. Two facts give a *sound* answer in milliseconds instead:

* **The turn floor.** Prompt segments are tokenized separately (worker protocol §4), so a
  prompt's token count is the sum of its segments' counts, and request text is always a
  segment of its own. The template text a conversation turn (a ``user`` or ``assistant``
  message) adds therefore costs a number of tokens that does not depend on the turn's text.
  :func:`measure_turn_floor` renders a few probe conversations of 1 to :data:`PROBE_COUNTS`
  turns (user only, assistant only, alternating, alternating after a system message; empty
  and non-empty text), tokenizes their template text through the worker, and takes the
  least number of tokens one more turn added anywhere. A template that drops, merges or
  windows turns shows an increment of 0 somewhere, and the floor is 0: no early refusal.
  (A template that treats turns differently only beyond the largest probe count, or only for
  texts unlike the probes', is not detected; the chat templates in use render every turn.)
* **Counting turns without decoding them.** :func:`count_turns` finds runs of plain turns
  (``{"role": "user"|"assistant", "content": "<string>"}``, either key order) in the raw body
  with one possessive regular expression (C speed, no Python object per message), replaces
  each run by a fresh random marker string, and parses the rest with the ordinary body rules.
  Only when every marker comes back as an element of the top-level ``messages`` list were the
  runs whole elements of that list (text inside a string, a nested object or an earlier
  duplicate key cannot yield the marker as such an element), so the count is exact for the
  runs; the other elements are counted from the parsed rest.

A request whose ``turns × floor`` reaches the context is then refused with the same
``400 context_length_exceeded`` ("at least N tokens") the worker's own bound gives (Chat
Completions and Anthropic Messages: both bodies hold a top-level ``messages`` list of such
turns; Responses: its ``input`` list, counting user messages only, since consecutive
assistant items are joined into one turn there). Requests with fields that can change what the template renders (Chat Completions'
non-empty ``chat_template_kwargs`` / ``reasoning_effort``, Messages' ``thinking`` /
``output_config``, Responses' ``reasoning.effort``) and anything else :func:`count_turns` is
unsure of skip that bound. Every body is still held, in the same pass (:func:`survey`), to
two bounds that need no template: the elements of its conversation list (plus Messages'
system blocks), ``limits.MAX_CONVERSATION_ITEMS``, and its JSON objects,
``limits.MAX_BODY_OBJECTS`` — what validation costs grows with those, whatever their text.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
import trio.lowlevel

from trioserve import limits, strict_json
from trioserve.core.offload import LARGE_BODY_BYTES, prepare

__all__ = ["CHAT_TEMPLATE_FIELDS", "CONVERSATION_ROLES", "MIN_TURNS", "PROBE_COUNTS",
           "CHAT_TURNS", "RESPONSES_TEMPLATE_FIELDS", "RESPONSES_TURNS", "Survey", "TurnShape",
           "count_turns", "survey",
           "floor_from_counts", "measure_turn_floor", "probe_conversations"]

# The roles whose every message the floor is measured for. System, developer and tool
# messages may be merged or folded by profiles and templates: they count as 0.
CONVERSATION_ROLES = ("user", "assistant")

# Below this many turns the early bound is not worth a regular-expression pass (the worker's
# exact check answers such a request within a step).
MIN_TURNS = 64

# Conversation lengths the probes render (the increments between them are measured).
PROBE_COUNTS = (1, 2, 3, 4, 8)
_PROBE_TEXTS = ("", "x")

_SHORTEST_TURN = '{"role":"user","content":""}'
_WS = r"[ \t\n\r]*+"
# A JSON string: unescaped characters other than '"', '\\' and controls, or a valid escape.
_STRING = r'"[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+"'
# The role key is written with its colon right after it (as every JSON encoder does), so
# that '"role":' occurs in a run exactly once per turn: in a string it would need an
# unescaped '"' followed by ':', which ends the string where no ':' may follow.
_ROLE_KEY = '"role":'
# Possessive throughout: a run is matched once, never backtracked into (linear time). A
# match holds at most _RUN_PIECE turns, so that one C call stays around a millisecond;
# adjacent matches are adjacent runs of the same list.
_RUN_PIECE = 2048


def _alternatives(words: tuple[str, ...]) -> str:
    return "(?:" + "|".join(map(re.escape, words)) + ")"


def _run_patterns(roles: tuple[str, ...], part_types: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """The run patterns for turns of ``roles`` whose content is a string or a list of text
    parts (``{"type": <one of part_types>, "text": <string>}``, keys in that order; every
    API here joins them into the turn's one text): role first (what nearly every client
    sends), then either order (half as fast to match)."""
    role = rf'{_ROLE_KEY}{_WS}"{_alternatives(roles)}"'
    part = (rf'\{{{_WS}"type"{_WS}:{_WS}"{_alternatives(part_types)}"{_WS},{_WS}"text"{_WS}:{_WS}'
            rf'{_STRING}{_WS}\}}')
    content = rf'"content"{_WS}:{_WS}(?>{_STRING}|\[{_WS}{part}(?:{_WS},{_WS}{part})*+{_WS}\])'
    role_first = rf"\{{{_WS}{role}{_WS},{_WS}{content}{_WS}\}}"
    either_order = rf"\{{{_WS}(?>{role}{_WS},{_WS}{content}|{content}{_WS},{_WS}{role}){_WS}\}}"
    return tuple(re.compile(rf"{turn}(?:{_WS},{_WS}{turn}){{0,{_RUN_PIECE - 1}}}+")
                 for turn in (role_first, either_order))


@dataclass(frozen=True)
class TurnShape:
    """Where an API's body holds its turns, which of them are counted, and their run patterns."""
    list_key: str
    roles: tuple[str, ...]
    runs: tuple[re.Pattern[str], ...]


# Chat Completions and Messages: every user/assistant turn, with "text" parts.
CHAT_TURNS = TurnShape("messages", CONVERSATION_ROLES, _run_patterns(CONVERSATION_ROLES, ("text",)))
# Responses: user messages only (consecutive assistant items are joined into one turn there),
# with its three text part types.
RESPONSES_TURNS = TurnShape("input", ("user",), _run_patterns(("user",), ("input_text", "output_text", "text")))
_PIECES_PER_CHECKPOINT = 2
# Runs shorter than 16 of the shortest turns stay in the parsed rest (not worth a marker).
_MIN_RUN_CHARS = 16 * len(_SHORTEST_TURN)


# Chat Completions fields that can change what the template renders (its kwargs).
CHAT_TEMPLATE_FIELDS = ("chat_template_kwargs", "reasoning_effort")


# Responses fields that can change what the template renders (``reasoning.effort`` becomes a
# template variable; ``reasoning.summary``, which Codex always sends, does not).
RESPONSES_TEMPLATE_FIELDS = ("reasoning.effort",)


@dataclass(frozen=True)
class Survey:
    """What :func:`survey` found in a body: ``items``, the elements of its conversation list
    plus those of a top-level ``system`` list (Messages' system blocks); ``turns``, the
    counted turns for the early bound, or None when the bound does not apply (a template
    field was given)."""
    items: int
    turns: int | None
    objects: int = 0  # JSON objects in the whole body (a lower bound: see survey)


async def count_turns(body: bytes, *, served_model: str,
                      template_fields: tuple[str, ...] = CHAT_TEMPLATE_FIELDS,
                      shape: TurnShape = CHAT_TURNS,
                      serves: Callable[[object], bool] | None = None) -> int | None:
    """:func:`survey`'s ``turns`` (None also where the survey is)."""
    found = await survey(body, served_model=served_model, template_fields=template_fields,
                         shape=shape, serves=serves)
    return found.turns if found is not None else None


def _template_field_given(obj: dict[str, Any], name: str) -> bool:
    """Whether ``name`` (``a`` or ``a.b``) is given with a value that can change what the
    template renders: not null, not an empty object (no template variables at all)."""
    head, _, rest = name.partition(".")
    value = obj.get(head)
    if rest:
        value = value.get(rest) if type(value) is dict else None
    return value is not None and value != {}


async def survey(body: bytes, *, served_model: str,
                 template_fields: tuple[str, ...] = CHAT_TEMPLATE_FIELDS,
                 shape: TurnShape = CHAT_TURNS, max_items: int = limits.MAX_CONVERSATION_ITEMS,
                 serves: Callable[[object], bool] | None = None) -> Survey | None:
    """The number of messages of ``shape.roles`` in ``body``'s top-level ``shape.list_key`` list (Chat
    Completions and Messages: ``messages``, every ``user``/``assistant`` turn; Responses:
    ``input``, its ``user`` messages only, because consecutive assistant items become one
    turn there), or None when it cannot be established cheaply or the early bound does not apply.

    Returns a :class:`Survey` (with the body's JSON objects counted too, for the bound on
    them) with ``turns`` None when one of ``template_fields`` is given
    (fields that can change what the template renders: by default Chat Completions'
    ``chat_template_kwargs`` and ``reasoning_effort``; ``a.b`` names a member; null and ``{}``
    are not given) — the items are counted all the same, for the bound on them. None for: a
    body that is not UTF-8 or not JSON under the body rules (the ordinary path names the
    error), no such list, another ``model`` than ``served_model`` (that error comes first;
    ``serves``, when given, decides instead which names are served),
    or a body too small to hold :data:`MIN_TURNS` role keys or more than ``max_items``
    items. Never raises but Cancelled.

    Cost: one regular-expression pass over the body (two when many turns are written
    content first), in pieces of at most
    :data:`_RUN_PIECE` turns with a Trio checkpoint every :data:`_PIECES_PER_CHECKPOINT`
    pieces (the event loop keeps serving other streams), and a parse of what is not in
    plain-turn runs (in a worker thread when that is large: trioserve.core.offload).
    """
    if len(body) < MIN_TURNS * len(_SHORTEST_TURN):
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    role_keys = text.count(_ROLE_KEY)
    # More than max_items items take at least two bytes each ("0,").
    if role_keys < MIN_TURNS and len(body) <= 2 * max_items:
        return None
    marker = "trioserve-turns-" + secrets.token_hex(16)
    rest, runs = text, 0
    for pattern in shape.runs:
        # The role-first pass; the either-order one only over what it left when that still
        # holds many turns.
        if runs and rest.count(_ROLE_KEY) < MIN_TURNS:
            break
        rest, found = await _replace_runs(pattern, rest, f'"{marker}"')
        runs += found
    try:
        # What is not in plain-turn runs may itself be large (turns of other shapes): then it
        # is parsed off the event loop like any large body (trioserve.core.offload).
        # Its objects are counted there too (a walk over every container).
        obj, rest_objects = await prepare(partial(_loads_counting, rest),
                                          large=len(rest) > LARGE_BODY_BYTES)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not (serves(obj.get("model")) if serves is not None
                                         else obj.get("model") == served_model):
        return None
    messages = obj.get(shape.list_key)
    if not isinstance(messages, list):
        return None
    # Each role key of a run is one turn (see _ROLE_KEY; no occurrence straddles a run's
    # edge, a brace): those of the body less those of the rest.
    in_runs = role_keys - rest.count(_ROLE_KEY)
    markers, others = _markers_and_turns(messages, marker, shape)
    if markers != runs:
        return None  # a run was not a sequence of the list's own elements
    system = obj.get("system")
    items = in_runs + len(messages) - markers + (len(system) if type(system) is list else 0)
    # Objects: each turn of a run and each text part in one (its '"type":' key, written with the
    # colon right after it like the role key: a lower bound), and every object of the rest.
    objects = in_runs + text.count(_TYPE_KEY) - rest.count(_TYPE_KEY) + rest_objects
    if any(_template_field_given(obj, name) for name in template_fields):
        return Survey(items, None, objects)
    if role_keys < MIN_TURNS:
        return Survey(items, None, objects)  # too few turns for the bound: the ordinary path decides
    return Survey(items, in_runs + others, objects)


_TYPE_KEY = '"type":'


def _markers_and_turns(messages: list[Any], marker: str, shape: TurnShape) -> tuple[int, int]:
    """How many of ``messages`` are the ``marker`` standing for a run, and how many are turns
    of ``shape`` outside the runs (a Responses item counts when its type is a message)."""
    markers = others = 0
    for message in messages:
        if message == marker:
            markers += 1
        elif (type(message) is dict and message.get("role") in shape.roles
              and message.get("type", "message") == "message"):
            others += 1
    return markers, others


def _loads_counting(text: str) -> tuple[Any, int]:
    """``strict_json.loads(text)`` and the JSON objects in it."""
    value = strict_json.loads(text)
    return value, _count_objects(value)


def _count_objects(value: Any) -> int:
    """The JSON objects in a decoded value, itself included (iterative: any depth)."""
    count, level = 0, [value]
    while level:
        deeper = []
        for container in level:
            if type(container) is dict:
                count += 1
                deeper += [v for v in container.values() if type(v) is dict or type(v) is list]
            else:
                deeper += [v for v in container if type(v) is dict or type(v) is list]
        level = deeper
    return count


async def _replace_runs(pattern: re.Pattern[str], text: str, replacement: str) -> tuple[str, int]:
    """``text`` with each match of ``pattern`` of at least ``_MIN_RUN_CHARS`` replaced by
    ``replacement``, and how many were; a Trio checkpoint every few matches."""
    pieces: list[str] = []
    position = replaced = 0
    for found, match in enumerate(pattern.finditer(text), 1):
        if match.end() - match.start() >= _MIN_RUN_CHARS:
            pieces += [text[position:match.start()], replacement]
            position = match.end()
            replaced += 1
        if found % _PIECES_PER_CHECKPOINT == 0:
            await trio.lowlevel.checkpoint()
    pieces.append(text[position:])
    return "".join(pieces), replaced


ProbeKey = tuple[str, str]  # (pattern, text)


def probe_conversations() -> list[tuple[ProbeKey, int, list[tuple[str, str]]]]:
    """The probe conversations: ``((pattern, text), turns, [(role, content), ...])`` for each
    pattern, probe text and count in :data:`PROBE_COUNTS`. A ``system`` message leads the
    ``after-system`` pattern and is not counted as a turn."""
    alternating = ("user", "assistant")
    out = []
    for text in _PROBE_TEXTS:
        for k in PROBE_COUNTS:
            out.append((("user", text), k, [("user", text)] * k))
            out.append((("assistant", text), k, [("assistant", text)] * k))
            turns = [(alternating[i % 2], text) for i in range(k)]
            out.append((("alternating", text), k, turns))
            out.append((("after-system", text), k, [("system", text), *turns]))
    return out


def floor_from_counts(counts: Mapping[ProbeKey, Mapping[int, int]]) -> int:
    """The least number of tokens one more turn added in any probe series: for each series
    (template-text tokens by turn count), the smallest ``(t[b] - t[a]) // (b - a)`` over
    consecutive counts a < b. 0 when no series has two counts (nothing rendered) or any
    increment is not positive (the template drops or merges turns)."""
    floor: int | None = None
    for series in counts.values():
        ks = sorted(series)
        for a, b in zip(ks, ks[1:]):
            step = (series[b] - series[a]) // (b - a)
            floor = step if floor is None else min(floor, step)
    return max(floor or 0, 0)


async def measure_turn_floor(
    render_template_text: Callable[[list[tuple[str, str]]], Sequence[str] | None],
    count_tokens: Callable[[str], Awaitable[int]],
) -> int:
    """The turn floor (module docstring) of the loaded template and tokenizer.

    ``render_template_text(conversation)``: the special (template) text segments of the
    rendered prompt for ``[(role, content), ...]``, or None when the template refuses that
    conversation (a series it refuses is left out: such requests fail anyway).
    ``count_tokens(text)``: the tokens of one special-parsed segment (the worker's tokenizer).

    Each distinct segment text is tokenized once, all of them concurrently. Exceptions of
    ``count_tokens`` propagate (the caller keeps no floor and tries again later).
    """
    rendered: list[tuple[ProbeKey, int, Sequence[str]]] = []
    for key, k, conversation in probe_conversations():
        segments = render_template_text(conversation)
        if segments is not None:
            rendered.append((key, k, segments))
    texts = sorted({text for _, _, segments in rendered for text in segments if text})
    # One after the other: the worker's call thread queues a bounded number of tokenizer calls
    # (a burst of them would be refused), and these are short.
    tokens = {text: await count_tokens(text) for text in texts}
    counts: dict[ProbeKey, dict[int, int]] = {}
    for key, k, segments in rendered:
        counts.setdefault(key, {})[k] = sum(tokens.get(text, 0) for text in segments)
    return floor_from_counts(counts)
