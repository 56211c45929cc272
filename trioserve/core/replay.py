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

Bounded: at most ``max_sessions`` sessions (least recently used dropped) and
``max_turns`` turns each. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["ReplayStore", "ReplayTurn", "message_signature"]

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


class ReplayStore:
    def __init__(self, max_sessions: int = 1024, max_turns: int = 256) -> None:
        self.max_sessions = max_sessions
        self.max_turns = max_turns
        self._sessions: collections.OrderedDict[str, list[ReplayTurn]] = collections.OrderedDict()

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
                del turns[ordinal:]
                break
            out.append((index, turns[ordinal]))
            ordinal += 1
        return out

    def record(self, key: str, messages: Sequence[Mapping[str, Any]], turn: ReplayTurn) -> None:
        """Remember ``turn`` as the answer to ``messages`` — only when every earlier assistant
        message of the request is a remembered turn (else positions would not line up)."""
        n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
        turns = self._sessions.get(key)
        if turns is None:
            if n_assistant != 0:
                return
            turns = self._sessions[key] = []
        if len(turns) != n_assistant or len(turns) >= self.max_turns:
            return
        turns.append(turn)
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def forget(self, key: str) -> None:
        self._sessions.pop(key, None)
