"""Anthropic Messages API wire format (spec/README.md §16), the answer side: the ``message``
object, the SSE event encoder and the error envelope. Pure: no I/O, no runtime.
``api.messages.request`` owns the request side.

Usage: ``input_tokens`` are the prompt tokens the worker computed, ``cache_read_input_tokens``
the ones it reused (so their sum is the prompt), ``cache_creation_input_tokens`` is 0.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any


from trioserve import errors
from trioserve.core.events import (
    Event,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallStarted,
    TurnResult,
    Usage,
)

__all__ = ["message_object", "StreamEncoder", "error_envelope", "error_type", "stop_reason",
           "usage_object", "new_message_id"]


# --- responses ----------------------------------------------------------------------------------


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(finished: Finished | None) -> str:
    """Anthropic's ``stop_reason`` for the core's ending."""
    if finished is None:
        return "end_turn"
    if finished.reason == "length":
        return "max_tokens"
    if finished.reason == "tool_calls":
        return "tool_use"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage_object(usage: Usage) -> dict[str, Any]:
    """Anthropic usage: ``input_tokens`` computed + ``cache_read_input_tokens`` reused = the
    prompt (module docstring)."""
    cached = max(0, min(usage.cached_tokens, usage.prompt_tokens))
    out: dict[str, Any] = {"input_tokens": usage.prompt_tokens - cached,
                           "output_tokens": usage.completion_tokens,
                           "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
    if usage.divergence is not None:  # where the prompt stopped matching its session (§12)
        out["trioserve_divergence"] = dict(usage.divergence)
    return out


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_object(message_id: str, model: str, result: TurnResult) -> dict[str, Any]:
    """The non-streaming response: thinking, then text, then tool_use blocks."""
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text:
        content.append({"type": "text", "text": result.text})
    for call in result.tool_calls:
        content.append({"type": "tool_use", "id": call.call_id, "name": call.name,
                        "input": _tool_input(call.arguments)})
    finished = result.finished
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(finished),
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": usage_object(finished.usage if finished else Usage())}


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {payload}\n\n".encode("utf-8", "replace")


class StreamEncoder:
    """Turns core events into Anthropic's SSE events, in its order:
    ``message_start``, ``ping``, per block ``content_block_start`` → deltas →
    ``content_block_stop`` (``index`` counting blocks from 0), ``message_delta`` (stop_reason,
    stop_sequence, usage), ``message_stop``. A block closes when output of another kind
    begins; a tool call is one ``tool_use`` block whose arguments arrive as
    ``input_json_delta``."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._index = -1
        self._tool_sent: dict[int, bool] = {}  # call index → any argument delta sent

    def start(self) -> bytes:
        message: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": usage_object(Usage())}
        return (_event("message_start", {"type": "message_start", "message": message})
                + _event("ping", {"type": "ping"}))

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + _event("content_block_start", {"type": "content_block_start",
                                                    "index": self._index, "content_block": block})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta",
                                              "index": self._index, "delta": delta})

    def encode(self, events: list[Event]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, TextDelta):
                if self._open != "text":
                    out += self._begin("text", {"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, ReasoningDelta):
                if self._open != "thinking":
                    out += self._begin("thinking", {"type": "thinking", "thinking": "",
                                                    "signature": ""})
                out += self._delta({"type": "thinking_delta", "thinking": event.text})
            elif isinstance(event, ToolCallStarted):
                out += self._begin("tool_use", {"type": "tool_use", "id": event.call_id,
                                                "name": event.name, "input": {}})
                self._tool_sent[event.index] = False
            elif isinstance(event, ToolCallArgumentsDelta):
                if event.delta:
                    self._tool_sent[event.index] = True
                    out += self._delta({"type": "input_json_delta", "partial_json": event.delta})
            elif isinstance(event, ToolCallDone):
                if not self._tool_sent.get(event.index):
                    out += self._delta({"type": "input_json_delta",
                                        "partial_json": event.arguments})
                out += self._close()
            elif isinstance(event, Finished):
                out += self._close()
                out += _event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(event),
                              "stop_sequence": event.stop_sequence},
                    "usage": usage_object(event.usage)})
                out += _event("message_stop", {"type": "message_stop"})
        return out

    def finish(self) -> bytes:
        """Nothing after the last batch: ``message_stop`` comes with the ending's batch."""
        return b""

    def fail(self, exc: errors.APIError) -> bytes:
        """A failure after the stream started: Anthropic's ``error`` event."""
        return _event("error", error_envelope(exc))


# --- errors -----------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_envelope(exc: errors.APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; the message names the parameter
    (Anthropic's envelope has no ``param`` field)."""
    message = exc.message
    if exc.param and f"'{exc.param}'" not in message:
        message = f"{message} (parameter '{exc.param}')"
    return {"type": "error", "error": {"type": error_type(exc.status), "message": message}}
