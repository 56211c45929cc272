"""Token-id replay of a session's own assistant turns (spec §12).

Chat templates re-render an assistant turn from its parsed form (content, tool calls), which
is often not byte-identical to what the model generated (tool-call JSON spacing, say). The
re-rendered tokens then differ from the ones resident in the session's slot, and everything
after the first difference is computed again. So, per session key, the server remembers the
token ids each assistant turn generated, with the turn's parsed form; when the client sends
that turn back unchanged — content and tool calls compared semantically (arguments as JSON
values, call ids ignored) — its rendered body is replaced by those ids.

Rules: turns are matched by position (the k-th assistant message of the request against the
k-th remembered turn); the first turn that differs invalidates itself and every later turn.
A turn is remembered only when its ids are exactly what the client saw (no stop-string cut, no
cancel: the worker omits ``generated_token_ids`` then) and it carries no reasoning text.

Bounded: at most ``max_sessions`` sessions (least recently used dropped), ``max_turns``
turns each and ``max_bytes`` bytes in all (``limits.REPLAY_CACHE_BYTES``: every turn's ids and
signature and every key, as Python holds them; the least recently used sessions go first).
Filled only by finished generations (``ServingCore``). :func:`replay_cuts` finds the remembered turns' bodies in a rendered
prompt and :func:`splice_ids` puts their ids in place. Pure, no I/O.
"""

from __future__ import annotations

import collections
import json
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from trioserve import limits
from trioserve.model.chat_template import ChatTemplate
from trioserve.model.profiles import ServingProfile
from trioserve.model.template_errors import TemplateError
from trioserve.worker.protocol import IdsSegment, Segment, TextSegment

__all__ = ["ReplayStore", "ReplayTurn", "message_signature", "replay_cuts", "splice_ids"]

Signature = tuple[str, tuple[tuple[str, str], ...]]


def message_signature(content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None) -> Signature | None:
    """A comparable form of an assistant turn, or None when it cannot be compared."""
    calls: list[tuple[str, str]] = []
    for call in tool_calls or ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            return None
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        calls.append((str(function.get("name")), json.dumps(args, sort_keys=True, ensure_ascii=False)))
    return (content or "", tuple(calls))


@dataclass(frozen=True, slots=True)
class ReplayTurn:
    signature: Signature
    ids: tuple[int, ...]


# Bookkeeping beyond a turn's own objects (the dataclass, its tuples, the list slot).
_TURN_OVERHEAD = 200
# An int object beyond the small ones Python shares (token ids are mostly above 256).
_ID_BYTES = 32


def _turn_bytes(turn: ReplayTurn) -> int:
    content, calls = turn.signature
    return (sys.getsizeof(turn.ids) + _ID_BYTES * len(turn.ids) + sys.getsizeof(content)
            + sum(sys.getsizeof(name) + sys.getsizeof(args) for name, args in calls) + _TURN_OVERHEAD)


class ReplayStore:
    def __init__(self, max_sessions: int = 1024, max_turns: int = 256,
                 max_bytes: int = limits.REPLAY_CACHE_BYTES) -> None:
        self.max_sessions = max_sessions
        self.max_turns = max_turns
        self.max_bytes = max_bytes
        self._sessions: collections.OrderedDict[str, list[ReplayTurn]] = collections.OrderedDict()
        # Invariant: _sizes[key] is the key's and its turns' bytes; _bytes their sum, ≤ max_bytes.
        self._sizes: dict[str, int] = {}
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """What the remembered turns and keys hold now (what ``max_bytes`` bounds)."""
        return self._bytes

    def _resize(self, key: str, delta: int) -> None:
        self._sizes[key] += delta
        self._bytes += delta

    def plan(self, key: str, messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, ReplayTurn]]:
        """The (message index, turn) pairs to replay for this request, in order. Forgets the
        remembered turns from the first one the request does not send back unchanged."""
        turns = self._sessions.get(key)
        if turns is None:
            return []
        self._sessions.move_to_end(key)
        out: list[tuple[int, ReplayTurn]] = []
        ordinal = 0
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            if ordinal >= len(turns):
                break
            if message_signature(message.get("content"), message.get("tool_calls")) != turns[ordinal].signature:
                self._resize(key, -sum(map(_turn_bytes, turns[ordinal:])))
                del turns[ordinal:]
                break
            out.append((index, turns[ordinal]))
            ordinal += 1
        return out

    def record(self, key: str, messages: Sequence[Mapping[str, Any]], turn: ReplayTurn) -> None:
        """Remember ``turn`` as the answer to ``messages`` — only when every earlier assistant
        message of the request is a remembered turn (else positions would not line up)."""
        n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
        size = _turn_bytes(turn)
        turns = self._sessions.get(key)
        if turns is None:
            if n_assistant != 0 or size + sys.getsizeof(key) > self.max_bytes:
                return
            turns = self._sessions[key] = []
            self._sizes[key] = 0
            self._resize(key, sys.getsizeof(key))
        if len(turns) != n_assistant or len(turns) >= self.max_turns:
            return
        if self._sizes[key] + size > self.max_bytes:
            return  # the session alone would exceed the bound: its earlier turns stay
        turns.append(turn)
        self._resize(key, size)
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions or self._bytes > self.max_bytes:
            self.forget(next(iter(self._sessions)))

    def forget(self, key: str) -> None:
        if self._sessions.pop(key, None) is not None:
            self._bytes -= self._sizes.pop(key)


def replay_cuts(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 template: ChatTemplate, profile: ServingProfile, kwargs: Any, full: str,
                 replays: list[tuple[int, ReplayTurn]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Character spans of ``full`` (the rendered prompt) holding the bodies of the replayed
    assistant turns, with their ids. A turn's body starts where the render of the messages
    before it (with the generation prompt) ends and ends at the end-of-turn text of the
    render that includes it; turns whose renders are not prefixes of ``full`` are skipped."""
    eos = template.eos_token
    if not eos:
        return []
    cuts: list[tuple[int, int, tuple[int, ...]]] = []
    for index, turn in replays:
        try:
            before, t1 = profile.prepare_messages(messages[:index], tools)
            upto, t2 = profile.prepare_messages(messages[:index + 1], tools)
            head = template.render(before, tools=t1, add_generation_prompt=True,
                                   template_kwargs=kwargs)
            whole = template.render(upto, tools=t2, add_generation_prompt=False,
                                    template_kwargs=kwargs)
        except (ValueError, TemplateError):
            continue
        if not (whole.startswith(head) and full.startswith(whole)):
            continue
        end = whole.rfind(eos, len(head))
        if end <= len(head) or (cuts and len(head) < cuts[-1][1]):
            continue
        cuts.append((len(head), end, turn.ids))
    return cuts


def splice_ids(segments: Sequence[tuple[str, bool]],
               cuts: list[tuple[int, int, tuple[int, ...]]]) -> tuple[Segment, ...]:
    """``segments`` with each character span ``[start, end)`` (ascending, disjoint) replaced
    by one ids segment; text around a cut keeps its ``special`` flag."""
    out: list[Segment] = []
    emitted: set[int] = set()
    pos = 0
    for text, special in segments:
        seg_start, seg_end = pos, pos + len(text)
        cursor = seg_start
        for k, (start, end, ids) in enumerate(cuts):
            if end <= cursor or start >= seg_end:
                continue
            if start > cursor:
                out.append(TextSegment(text[cursor - seg_start:start - seg_start], special))
            if k not in emitted:
                out.append(IdsSegment(tuple(ids)))
                emitted.add(k)
            cursor = min(end, seg_end)
        if cursor < seg_end:
            out.append(TextSegment(text[cursor - seg_start:], special))
        pos = seg_end
    return tuple(out)
