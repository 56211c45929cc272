"""Stored responses (spec §20.5): what ``store`` keeps for ``previous_response_id`` and for
``GET``/``DELETE /v1/responses/{id}``, bounded in count and characters, least recently used
first out, in memory only."""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from typing import Any

from trioserve.core.request import Message

__all__ = ["ResponseStore", "StoredResponse", "stored_chars"]


@dataclass
class StoredResponse:
    """One stored response: the conversation up to and including its output (for
    ``previous_response_id``), the response object as last sent, and its input items in
    OpenAI's item shapes (``GET /v1/responses/{id}`` and ``…/input_items``, spec §20.5)."""

    messages: tuple[Message, ...]
    response: dict[str, Any] = field(default_factory=dict)
    input_items: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0


class ResponseStore:
    """Stored responses (``store`` true, the default): response id → :class:`StoredResponse`
    (the conversation excludes the instructions, as OpenAI's does), for ``previous_response_id``
    and ``GET``/``DELETE /v1/responses/{id}``. Bounded: at most ``max_responses`` responses and
    ``max_chars`` characters in all, every string counted (the conversation's by
    :func:`stored_chars`, the response object and input items as their JSON text); the least
    recently used go first. In memory only: a restart forgets them (spec §20.5)."""

    def __init__(self, max_responses: int = 512, max_chars: int = 64 * 1024 * 1024) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()
        self._chars = 0

    def get(self, response_id: str) -> tuple[Message, ...] | None:
        entry = self.entry(response_id)
        return entry.messages if entry is not None else None

    def entry(self, response_id: str) -> StoredResponse | None:
        """The stored response (marked recently used), or None."""
        entry = self._items.get(response_id)
        if entry is None:
            return None
        self._items.move_to_end(response_id)
        return entry

    def put(self, response_id: str, messages: tuple[Message, ...],
            response: dict[str, Any] | None = None,
            input_items: list[dict[str, Any]] | None = None) -> None:
        """Keep ``messages`` (and the response object and input items) under ``response_id``,
        then drop the least recently used until both bounds hold; a response larger than
        ``max_chars`` alone is not kept."""
        size = (len(response_id) + sum(map(stored_chars, messages))
                + (len(json.dumps(response, ensure_ascii=False)) if response else 0)
                + (len(json.dumps(input_items, ensure_ascii=False)) if input_items else 0))
        if size > self.max_chars:
            return
        self.delete(response_id)
        self._items[response_id] = StoredResponse(messages, response or {}, input_items or [], size)
        self._chars += size
        while len(self._items) > self.max_responses or self._chars > self.max_chars:
            _, dropped = self._items.popitem(last=False)
            self._chars -= dropped.size

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored."""
        entry = self._items.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.size
        return True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chars(self) -> int:
        """Characters kept in all (what ``max_chars`` bounds)."""
        return self._chars


def stored_chars(message: Message) -> int:
    """Every character a stored message keeps: its text and reasoning, and every id, name
    and argument string (ids and names cost no context, since templates may not render
    them, but memory all the same: a client may send megabytes in a ``call_id``)."""
    size = len(message.role) + len(message.text) + len(message.reasoning or "")
    size += len(message.tool_call_id or "") + len(message.name or "")
    for call in message.tool_calls:
        arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(
            call.arguments, ensure_ascii=False)  # decoded arguments weigh as their JSON text
        size += len(call.id) + len(call.name) + len(arguments)
    return size
