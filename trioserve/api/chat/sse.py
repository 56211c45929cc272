"""Server-sent event framing for ``chat.completion.chunk`` streams (spec/README.md §7).

Owns the bytes of each chunk event, framed as every OpenAI event is (``api.streaming``:
``data: <compact JSON>\\n\\n``, UTF-8, no ``event:``/``id:`` lines, the ``data: [DONE]``
terminator). It does not own the order of events or when to send them (the serving layer
does), nor the HTTP response.

Content chunks are the hot path (one per decoded piece, up to ~20,000 per second across a
server), so :class:`ChunkFactory` prebuilds the bytes around the text and only JSON-escapes
the text itself; ``test_sse.py`` pins that the fast path equals the generic encoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from trioserve.api.streaming import chunk_bytes, compact_json, utf8
from trioserve.model.tool_formats.base import ToolCall

__all__ = ["ChunkFactory"]

# json.dumps(str, ensure_ascii=False) uses this C function; calling it directly skips the
# encoder setup json.dumps does on every call. Measured on a short token: content_chunk
# ~0.3 us versus ~5 us for building the chunk dict and dumping it.
_escape = json.encoder.encode_basestring


class ChunkFactory:
    """Builds the events of one streamed completion; every chunk shares ``id``, ``created``
    and ``model``.

    With ``include_usage`` every chunk carries ``"usage": null`` except the final usage
    chunk (``choices: []``); without it no chunk has a ``usage`` key. Stateless apart from
    the prebuilt bytes, so methods may be called in any order; the caller keeps the §7
    order: role, body (content / reasoning / tool calls), finish, [usage], then ``[DONE]``.
    """

    def __init__(self, id: str, created: int, model: str, include_usage: bool) -> None:
        self.id = id
        self.created = created
        self.model = model
        self.include_usage = include_usage
        head = compact_json({"id": id, "object": "chat.completion.chunk", "created": created, "model": model})
        # head is '{...}'; chunks continue it with ',"choices":[...]' and close it.
        self._open = b"data: " + utf8(head[:-1]) + b',"choices":[{"index":0,"delta":'
        self._close_open = (
            b',"logprobs":null,"finish_reason":null}]'
            + (b',"usage":null' if include_usage else b"")
            + b"}\n\n"
        )
        self._content_prefix = self._open + b'{"content":'
        self._reasoning_prefix = self._open + b'{"reasoning_content":'
        self._body_suffix = b"}" + self._close_open

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = usage
        return chunk_bytes(obj)

    @staticmethod
    def _choice(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def role_chunk(self) -> bytes:
        """The first chunk: ``delta: {"role": "assistant", "content": ""}``."""
        return self._chunk([self._choice({"role": "assistant", "content": ""})])

    def content_chunk(self, text: str) -> bytes:
        """``delta: {"content": text}`` (fast path: only ``text`` is encoded)."""
        return self._content_prefix + utf8(_escape(text)) + self._body_suffix

    def reasoning_chunk(self, text: str) -> bytes:
        """``delta: {"reasoning_content": text}`` (spec §11; same fast path)."""
        return self._reasoning_prefix + utf8(_escape(text)) + self._body_suffix

    def tool_calls_chunk(self, calls: Sequence[ToolCall], first_index: int = 0) -> bytes:
        """One event per call, each ``delta.tool_calls = [{"index", "id", "type",
        "function": {"name", "arguments"}}]`` with the complete arguments (spec §10).

        Every event carries ``index`` (counting from ``first_index``) and ``id``: clients
        that key on either break when they are missing or always 0.
        """
        return b"".join(
            self._chunk([self._choice({"tool_calls": [{"index": first_index + k, **call}]})])
            for k, call in enumerate(calls)
        )

    def tool_call_start_chunk(self, index: int, call_id: str, name: str) -> bytes:
        """The first event of a call whose arguments follow in pieces (spec §10 "Streamed
        arguments"): ``index``, ``id``, ``type``, ``function.name`` and empty arguments."""
        return self._chunk([self._choice({"tool_calls": [{
            "index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": ""}}]})])

    def tool_call_arguments_chunk(self, index: int, delta: str) -> bytes:
        """A piece of call ``index``'s arguments: ``delta.tool_calls[{"index", "function":
        {"arguments": delta}}]`` (the accumulators concatenate the pieces by index)."""
        return self._chunk([self._choice({"tool_calls": [{
            "index": index, "function": {"arguments": delta}}]})])

    def finish_chunk(self, finish_reason: str) -> bytes:
        """``delta: {}`` with the non-null ``finish_reason``."""
        return self._chunk([self._choice({}, finish_reason)])

    def usage_chunk(self, usage: Mapping[str, Any]) -> bytes:
        """The usage chunk: ``choices: []`` and ``usage`` (send only with include_usage)."""
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": dict(usage),
        }
        return chunk_bytes(obj)

    @staticmethod
    def error_event(envelope: Mapping[str, Any]) -> bytes:
        """A failure after the stream started: ``data: {"error": {...}}`` (send DONE next)."""
        return chunk_bytes(dict(envelope))
