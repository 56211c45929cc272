"""The OpenAI Responses adapter (``POST /v1/responses``, spec §20).

Request: the body is decoded with ``strict_json`` and validated by ``api.responses.request`` into
a :class:`ResponsesRequest`; ``previous_response_id`` prepends a stored conversation
(:class:`ResponseStore`); ``prompt_cache_key`` (or the session headers) is the session key. The
serving core does the rest; this module writes the turn's events as Responses stream events
(:class:`ResponseWriter`) or, non-streamed, as the final response object the same writer
assembled — one path, so both always agree.

Stream order (spec §20.3): ``response.created``, ``response.in_progress``; then per output
item ``response.output_item.added`` → (``content_part.added`` → text/reasoning deltas →
``…text.done`` → ``content_part.done`` | ``function_call_arguments.delta``/``.done``) →
``response.output_item.done`` **as soon as the item ends** (the next item starts, or the
generation ends); last ``response.completed``, ``response.incomplete`` (the token budget ended
it: ``incomplete_details.reason: max_output_tokens``) or ``response.failed``. Every event has
``type`` and a ``sequence_number`` counting from 0; items carry ids and ``output_index``.

Timing and cancellation: as chat (``api.chat``): errors known before output are plain JSON
errors; the stream's ``cancel`` (the turn's ``close``) runs when the HTTP request ends.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any

from trioserve.core.model_names import ModelNames
from trioserve import errors, strict_json
from trioserve.core.events import (
    Event,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from trioserve.core.request import Message, ToolCallPart
from trioserve.core.serving import ServingCore, Turn
from trioserve.core.offload import LARGE_BODY_BYTES, prepare
from trioserve.api.validation import load_json_object
from trioserve.core.runtime import Arrival
from trioserve.core.sessions import resolve_session_key
from trioserve.core.turn_floor import RESPONSES_TEMPLATE_FIELDS, RESPONSES_TURNS, survey
from trioserve.api.streaming import compact_json, sse_body, utf8
from trioserve.api.answers import Answer, JsonResponse, StreamResponse
from trioserve.api.ignored_fields import response_headers as ignored_fields_headers
from trioserve.api.responses.request import ResponsesRequest, parse_responses_body
from trioserve.api.responses.tools import CUSTOM_INPUT_KEY
from trioserve.api.responses.store import ResponseStore, StoredResponse, stored_chars

__all__ = ["ServingResponses", "ResponseStore", "ResponseWriter", "StoredResponse", "stored_chars",
           "IGNORED_TOOLS_HEADER", "new_response_id"]

log = logging.getLogger("trioserve.responses")

# Names the hosted tools a request declared that were not offered to the model (spec §20.4).
IGNORED_TOOLS_HEADER = "x-trioserve-ignored-tools"


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ServingResponses:
    """``POST /v1/responses`` over a :class:`ServingCore`."""

    def __init__(self, core: ServingCore, store: ResponseStore | None = None) -> None:
        self.core = core
        self.store = store or ResponseStore()
        # Which other served model stores a response id (spec §2.1: stores are per model), for
        # the error that names it; the server sets it when it serves several models.
        self.stored_elsewhere: Callable[[str], str | None] = lambda response_id: None

    async def create(self, body: bytes, *, request_id: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     arrival: Arrival | None = None) -> Answer:
        """Serve one request (``api.answers.GeneratingAPI``). Raises APIError for every
        failure known before output. ``request_id`` (default: a new one) is the ``resp_…`` id."""
        response_id = request_id or new_response_id()
        max_body = self.core.settings.max_body_bytes
        if len(body) > max_body:
            raise errors.request_too_large(max_body)
        # As for Chat Completions: an input whose user turns alone cannot fit is refused before
        # any per-item work (trioserve.core.turn_floor).
        await self.core.refuse_early(
            await survey(body, served_model=self.core.model_id, shape=RESPONSES_TURNS,
                         serves=partial(self.core.names.serves, route="responses"),
                         template_fields=RESPONSES_TEMPLATE_FIELDS), param="input")
        req = await prepare(partial(_parse_body, body, served_model=self.core.model_id,
                                    names=self.core.names),
                            large=len(body) > LARGE_BODY_BYTES)
        history: tuple[Message, ...] = ()
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise _previous_not_found(req.previous_response_id,
                                          self.stored_elsewhere(req.previous_response_id))
            history = stored
        out_headers: dict[str, str] = {}
        if req.ignored_tools:
            out_headers[IGNORED_TOOLS_HEADER] = ", ".join(dict.fromkeys(req.ignored_tools))
            log.info("response %s: hosted tools not offered to the model: %s", response_id,
                     out_headers[IGNORED_TOOLS_HEADER])
        out_headers.update(ignored_fields_headers(req.ignored_fields, log, response_id))
        session = resolve_session_key({"prompt_cache_key": req.prompt_cache_key, "session_id": None},
                                      headers)
        core_req = req.core_request(history, session)
        turn = await self.core.start(core_req, request_id=response_id, arrival=arrival,
                                     early_start=req.stream)
        writer = ResponseWriter(response_id, self.core.model_id, req)
        conversation = history + tuple(req.messages)
        if req.stream:
            return StreamResponse(self._stream(writer, turn, conversation), turn.close, out_headers)
        try:
            async for events in turn.batches():
                writer.encode(events)
        finally:
            turn.close()
        self._remember(req, writer, conversation)
        return JsonResponse(writer.response(), out_headers)

    def _remember(self, req: ResponsesRequest, writer: ResponseWriter,
                  conversation: tuple[Message, ...]) -> None:
        if req.store and writer.finished is not None:
            self.store.put(writer.response_id, conversation + (writer.assistant_message(),),
                           writer.response(), req.input_items)

    # -- stored responses (spec §20.5) ---------------------------------------------------------

    def retrieve(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the stored response object. 404 when not stored."""
        _refuse_query(query, allowed=("stream",))
        if query.get("stream", "false") != "false":
            raise errors.unsupported_parameters([("stream", "streaming a stored response "
                                                  "again is not supported")])
        return self._stored(response_id).response

    def delete(self, response_id: str) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}``: forget a stored response. 404 when not stored."""
        if not self.store.delete(response_id):
            raise _response_not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the request's input items as an OpenAI
        list page (``limit`` 1-100, default 20; ``order`` ``desc`` (default) or ``asc``;
        ``after``: an item id, the page starts after it). 404 when not stored."""
        _refuse_query(query, allowed=("limit", "order", "after"))
        limit = 20
        if "limit" in query:
            text = query["limit"]
            # ASCII digits only: '²' is a digit to str.isdigit() and a ValueError to int(),
            # '٣' and '５' would be read as 3 and 5 (strict_json.ascii_digits).
            value = strict_json.ascii_digits(text, max_digits=3)
            if value is None or not 1 <= value <= 100:
                raise errors.invalid_value(f"Invalid value for 'limit': {text[:64]!r}; expected "
                                           "an integer from 1 to 100 in ASCII digits.", "limit")
            limit = value
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise errors.invalid_value(f"Invalid value for 'order': {order!r}; expected asc "
                                       "or desc.", "order")
        items = list(self._stored(response_id).input_items)
        if order == "desc":
            items.reverse()
        if "after" in query:
            ids = [item.get("id") for item in items]
            if query["after"] not in ids:
                raise errors.invalid_value(f"Invalid value for 'after': no input item "
                                           f"{query['after']!r} in this response.", "after")
            items = items[ids.index(query["after"]) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit}

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.entry(response_id)
        if entry is None:
            raise _response_not_found(response_id)
        return entry

    def _stream(self, writer: ResponseWriter, turn: Turn,
                conversation: tuple[Message, ...]) -> AsyncIterator[bytes]:
        """The SSE body (``api.streaming``); a failure after the start is ``response.failed``
        (logged with its traceback when unexpected); a completed response is stored."""
        return sse_body(turn.batches(), writer, request_id=writer.response_id, close=turn.close,
                        start_now=turn.admitted_early,
                        on_success=lambda: self._remember(writer.request, writer, conversation))


def _previous_not_found(response_id: str, owner: str | None) -> errors.APIError:
    """400 ``previous_response_not_found``; ``owner``: the other model that stores it."""
    if owner is not None:
        message = (f"Previous response with id '{response_id}' was produced by the model "
                   f"'{owner}' (stored responses belong to their model): send it with "
                   f"\"model\": \"{owner}\".")
    else:
        message = (f"Previous response with id '{response_id}' not found (responses are kept in "
                   "memory, bounded, and only when 'store' was not false).")
    return errors.APIError(400, errors.INVALID_REQUEST, message,
                           code="previous_response_not_found", param="previous_response_id")


def _response_not_found(response_id: str) -> errors.APIError:
    return errors.APIError(404, errors.INVALID_REQUEST,
                           f"Response with id {response_id!r} not found (responses are kept in "
                           "memory, bounded, and only when 'store' was not false).",
                           code="response_not_found", param="response_id")


def _refuse_query(query: Mapping[str, str], *, allowed: tuple[str, ...]) -> None:
    """400 ``unsupported_parameter`` naming every query parameter not in ``allowed``."""
    offenders = [(name, "not supported by this server") for name in query if name not in allowed]
    if offenders:
        raise errors.unsupported_parameters(offenders, allowed)


def _parse_body(body: bytes, *, served_model: str, names: ModelNames | None = None) -> ResponsesRequest:
    return parse_responses_body(load_json_object(body), served_model=served_model, names=names)


def _event(obj: dict[str, Any]) -> bytes:
    data = compact_json(obj)
    kind: str = obj["type"]
    return b"event: " + kind.encode() + b"\ndata: " + utf8(data) + b"\n\n"


class _Item:
    """An output item being written: its index, wire id, kind and accumulated text."""

    def __init__(self, index: int, kind: str, item_id: str) -> None:
        self.index = index
        self.kind = kind  # "message", "reasoning", "function_call", "custom_tool_call"
        self.id = item_id
        self.text: list[str] = []
        self.call_id = ""
        self.name = ""
        self.namespace: str | None = None
        self.model_name = ""
        self.arguments = ""
        self.done: dict[str, Any] | None = None  # the finished item


class ResponseWriter:
    """Turns core events into Responses stream events and assembles the response object.
    Used for streams (the bytes) and whole responses (``response()``) alike."""

    def __init__(self, response_id: str, model: str, request: ResponsesRequest) -> None:
        self.response_id = response_id
        self.model = model
        self.request = request
        self.created_at = int(time.time())
        self.sequence = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.finished: Finished | None = None
        self.error: errors.APIError | None = None

    # -- the response object -------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        """The response object as it stands (status from the ending)."""
        req = self.request
        status, incomplete = "in_progress", None
        if self.error is not None:
            status = "failed"
        elif self.finished is not None:
            if self.finished.reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            else:
                status = "completed"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": ({"code": self.error.code or "server_error", "message": self.error.message}
                      if self.error is not None else None),
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": [item.done for item in self.items if item.done is not None],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning_echo,
            "store": req.store,
            "temperature": req.temperature,
            "text": req.text_echo,
            "tool_choice": req.tool_choice_echo,
            "tools": req.tools_echo,
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": _usage(self.finished.usage) if self.finished is not None else None,
            "metadata": req.metadata,
            "prompt_cache_key": req.prompt_cache_key,
            "user": req.user,
        }

    def assistant_message(self) -> Message:
        """This response's output as one assistant turn (for ``previous_response_id``)."""
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCallPart] = []
        for item in self.items:
            if item.kind == "message":
                text.append("".join(item.text))
            elif item.kind == "reasoning":
                reasoning.append("".join(item.text))
            else:
                calls.append(ToolCallPart.from_text(item.call_id, item.model_name, item.arguments))
        return Message("assistant", "\n".join(text), reasoning="\n".join(reasoning) or None,
                       tool_calls=tuple(calls))

    # -- events ----------------------------------------------------------------------------------

    def _emit(self, obj: dict[str, Any]) -> bytes:
        obj["sequence_number"] = self.sequence
        self.sequence += 1
        return _event(obj)

    def start(self) -> bytes:
        return (self._emit({"type": "response.created", "response": self.response()})
                + self._emit({"type": "response.in_progress", "response": self.response()}))

    def encode(self, events: list[Event]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, TextDelta):
                out += self._ensure_open("message") + self._text_delta(event.text)
            elif isinstance(event, ReasoningDelta):
                out += self._ensure_open("reasoning") + self._text_delta(event.text)
            elif isinstance(event, ToolCallStarted):
                out += self._close() + self._open_call(event)
            elif isinstance(event, ToolCallArgumentsDelta):
                out += self._arguments_delta(event)
            elif isinstance(event, ToolCallDone):
                out += self._close_call(event)
            elif isinstance(event, Finished):
                self.finished = event
                out += self._close(incomplete=event.reason == "length")
                kind = "response.incomplete" if event.reason == "length" else "response.completed"
                out += self._emit({"type": kind, "response": self.response()})
        return out

    def finish(self) -> bytes:
        """Nothing after the last batch: the ending's batch closes the response."""
        return b""

    def fail(self, error: errors.APIError) -> bytes:
        """End the stream with ``response.failed``; the open item ends ``incomplete``."""
        out = self._close(incomplete=True)
        self.error = error
        return out + self._emit({"type": "response.failed", "response": self.response()})

    def _new_item(self, kind: str, prefix: str) -> _Item:
        item = _Item(len(self.items), kind, _item_id(prefix))
        self.items.append(item)
        self.open = item
        return item

    def _ensure_open(self, kind: str) -> bytes:
        if self.open is not None and self.open.kind == kind:
            return b""
        out = self._close()
        if kind == "message":
            item = self._new_item("message", "msg")
            added = {"id": item.id, "type": "message", "status": "in_progress", "role": "assistant",
                     "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = self._new_item("reasoning", "rs")
            added = {"id": item.id, "type": "reasoning", "status": "in_progress", "summary": [],
                     "content": []}
            part = {"type": "reasoning_text", "text": ""}
        out += self._emit({"type": "response.output_item.added", "output_index": item.index,
                           "item": added})
        out += self._emit({"type": "response.content_part.added", "item_id": item.id,
                           "output_index": item.index, "content_index": 0, "part": part})
        return out

    def _text_delta(self, text: str) -> bytes:
        item = self.open
        assert item is not None
        item.text.append(text)
        if item.kind == "message":
            return self._emit({"type": "response.output_text.delta", "item_id": item.id,
                               "output_index": item.index, "content_index": 0, "delta": text,
                               "logprobs": []})
        return self._emit({"type": "response.reasoning_text.delta", "item_id": item.id,
                           "output_index": item.index, "content_index": 0, "delta": text})

    def _open_call(self, event: ToolCallStarted) -> bytes:
        target = self.request.tool_map.get(event.name)
        custom = target is not None and target.kind == "custom"
        item = self._new_item("custom_tool_call" if custom else "function_call",
                              "ctc" if custom else "fc")
        item.call_id, item.model_name = event.call_id, event.name
        item.name = target.name if target is not None else event.name
        item.namespace = target.namespace if target is not None else None
        added: dict[str, Any] = {"id": item.id, "type": item.kind, "status": "in_progress",
                                 "call_id": item.call_id, "name": item.name}
        if custom:
            added["input"] = ""
        else:
            added["arguments"] = ""
        if item.namespace is not None:
            added["namespace"] = item.namespace
        return self._emit({"type": "response.output_item.added", "output_index": item.index,
                           "item": added})

    def _arguments_delta(self, event: ToolCallArgumentsDelta) -> bytes:
        item = self.open
        assert item is not None and item.kind in ("function_call", "custom_tool_call")
        item.arguments += event.delta
        if item.kind == "custom_tool_call":
            return b""  # the input is known once the arguments object is complete
        return self._emit({"type": "response.function_call_arguments.delta", "item_id": item.id,
                           "output_index": item.index, "delta": event.delta})

    def _close_call(self, event: ToolCallDone) -> bytes:
        item = self.open
        assert item is not None and item.call_id == event.call_id
        item.arguments = event.arguments
        done: dict[str, Any] = {"id": item.id, "type": item.kind, "status": "completed",
                                "call_id": item.call_id, "name": item.name}
        if item.kind == "custom_tool_call":
            text = _custom_input(event.arguments)
            done["input"] = text
            out = self._emit({"type": "response.custom_tool_call_input.delta", "item_id": item.id,
                              "output_index": item.index, "delta": text})
            out += self._emit({"type": "response.custom_tool_call_input.done", "item_id": item.id,
                               "output_index": item.index, "input": text})
        else:
            done["arguments"] = event.arguments
            out = self._emit({"type": "response.function_call_arguments.done", "item_id": item.id,
                              "output_index": item.index, "arguments": event.arguments})
        if item.namespace is not None:
            done["namespace"] = item.namespace
        item.done = done
        self.open = None
        return out + self._emit({"type": "response.output_item.done", "output_index": item.index,
                                 "item": done})

    def _close(self, incomplete: bool = False) -> bytes:
        """End the open text item (message or reasoning) with its done events."""
        item = self.open
        if item is None:
            return b""
        self.open = None
        status = "incomplete" if incomplete else "completed"
        if item.kind in ("function_call", "custom_tool_call"):
            # Only a failure ends a call that was not completed; it is reported incomplete.
            done: dict[str, Any] = {"id": item.id, "type": item.kind, "status": "incomplete", "call_id": item.call_id,
                    "name": item.name}
            done["input" if item.kind == "custom_tool_call" else "arguments"] = ""
            item.done = done
            return self._emit({"type": "response.output_item.done", "output_index": item.index,
                               "item": done})
        text = "".join(item.text)
        part: dict[str, Any]
        if item.kind == "message":
            part = {"type": "output_text", "text": text, "annotations": []}
            out = self._emit({"type": "response.output_text.done", "item_id": item.id,
                              "output_index": item.index, "content_index": 0, "text": text,
                              "logprobs": []})
            done = {"id": item.id, "type": "message", "status": status, "role": "assistant",
                    "content": [part]}
        else:
            part = {"type": "reasoning_text", "text": text}
            out = self._emit({"type": "response.reasoning_text.done", "item_id": item.id,
                              "output_index": item.index, "content_index": 0, "text": text})
            done = {"id": item.id, "type": "reasoning", "status": status, "summary": [],
                    "content": [part], "encrypted_content": None}
        out += self._emit({"type": "response.content_part.done", "item_id": item.id,
                           "output_index": item.index, "content_index": 0, "part": part})
        item.done = done
        return out + self._emit({"type": "response.output_item.done", "output_index": item.index,
                                 "item": done})


def _custom_input(arguments: str) -> str:
    """A freeform custom tool's input from the arguments object the model wrote for it."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT_KEY), str):
        return str(value[CUSTOM_INPUT_KEY])
    return arguments


def _usage(usage: Usage) -> dict[str, Any]:
    """Responses usage. ``input_tokens_details.cached_tokens``: prompt tokens not computed for
    this request (spec §8). Reasoning tokens are not counted apart from the output: 0. A
    drafted generation adds ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``
    to ``output_tokens_details`` (self-speculative decoding, as in chat)."""
    details: dict[str, Any] = {"reasoning_tokens": 0}
    if usage.drafted_tokens is not None:
        details["accepted_prediction_tokens"] = usage.accepted_draft_tokens or 0
        details["rejected_prediction_tokens"] = usage.rejected_draft_tokens or 0
    out: dict[str, Any] = {"input_tokens": usage.prompt_tokens,
                           "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                           "output_tokens": usage.completion_tokens,
                           "output_tokens_details": details,
                           "total_tokens": usage.total_tokens}
    if usage.divergence is not None:  # where the prompt stopped matching its session (§12)
        out["trioserve_divergence"] = dict(usage.divergence)
    return out
