"""The OpenAI Chat Completions adapter (``POST /v1/chat/completions``, spec §5-§12).

Request: ``protocol.parse_chat_request`` validates the body (the contract's validation
order); :func:`core_request` maps it to the API-neutral ``CoreRequest``; the session key comes
from the body or headers (spec §12). Everything after that — rendering, constraints, replay,
admission, the output pipeline — is the serving core's (``trioserve.core``). This module only
writes the turn's events as a ``chat.completion`` object or ``chat.completion.chunk`` events
(``sse``).

Response timing contract: ``create`` returns only after the first worker record for the
request arrived (``ServingCore.start``), so errors known before generation are plain JSON
error responses, never a stream that has already started. After that, a failure inside a
stream is an ``error`` event followed by ``[DONE]``.

Cancellation contract: every path out of ``create`` and out of the stream generator ends the
turn (``Turn.close``: synchronous, idempotent), and so does the stream's ``cancel``, which
the HTTP layer runs when the request ends; a client that disconnects at any point — queued,
prefilling, decoding — frees the worker.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import partial
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
)
from trioserve.core.request import (
    CoreRequest,
    ForcedTool,
    FunctionTool,
    JsonObjectOutput,
    JsonSchemaOutput,
    Message,
    OutputFormat,
    Sampling,
    ToolCallPart,
    ToolChoice,
)
from trioserve.core.serving import ServingCore, Turn
from trioserve.model.tool_formats.base import ToolCall
from trioserve.core.offload import LARGE_BODY_BYTES, prepare
from trioserve.api.chat.validation import ChatRequest, parse_chat_request
from trioserve.core.runtime import Arrival
from trioserve.core.sessions import SessionKey, resolve_session_key, worker_retention
from trioserve.api.answers import Answer, JsonResponse, StreamResponse, openai_usage
from trioserve.api.chat.sse import ChunkFactory
from trioserve.api.ignored_fields import response_headers as ignored_fields_headers
from trioserve.api.streaming import DONE, sse_body
from trioserve.core.turn_floor import survey

__all__ = ["ServingChat", "core_request", "new_completion_id"]

log = logging.getLogger("trioserve.chat")


class ServingChat:
    """Chat Completions over a :class:`ServingCore`: parses the body into a
    :class:`CoreRequest` and encodes the core's events as chat completions or chunks."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    async def create(self, body: bytes, *, request_id: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     arrival: Arrival | None = None) -> Answer:
        """Serve one request (``api.answers.GeneratingAPI``): the ``chat.completion`` object
        (non-stream) or a stream of chunks, each with the response headers
        (``x-trioserve-ignored-fields``, spec §4.1).

        Raises APIError for every failure known before the first byte of the response.
        ``request_id`` (default: a new one) is the response's ``chatcmpl-…`` id.
        ``headers`` (case-insensitive) supply the session key headers (spec §12).
        ``arrival`` (from ``SessionRuntime.arrival``) ends when the generation is submitted.
        """
        completion_id = request_id or new_completion_id()
        if len(body) <= self.core.settings.max_body_bytes:
            # Before any per-message work: a conversation whose turns alone cannot fit is
            # refused in milliseconds, whatever its length (trioserve.core.turn_floor).
            await self.core.refuse_early(await survey(
                body, served_model=self.core.model_id,
                serves=partial(self.core.names.serves, route="chat")))
        req = await prepare(partial(parse_chat_request, body, served_model=self.core.model_id,
                                    names=self.core.names,
                                    max_body_bytes=self.core.settings.max_body_bytes),
                            large=len(body) > LARGE_BODY_BYTES)
        session = resolve_session_key(
            {"prompt_cache_key": req.prompt_cache_key, "session_id": req.session_id}, headers)
        turn = await self.core.start(core_request(req, session), request_id=completion_id,
                                     arrival=arrival, early_start=req.stream)
        out_headers = ignored_fields_headers(req.ignored_fields, log, completion_id)
        if req.stream:
            return StreamResponse(self._stream(req, turn, completion_id), turn.close, out_headers)
        try:
            result = await turn.collect()
        finally:
            turn.close()
        return JsonResponse(self._completion(result, completion_id), out_headers)

    def _completion(self, result: TurnResult, completion_id: str) -> dict[str, Any]:
        assert result.finished is not None
        calls = [_tool_call(call) for call in result.tool_calls]
        text = result.text
        message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.core.model_id,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": result.finished.reason}],
            "usage": openai_usage(result.finished.usage),
        }

    def _stream(self, req: ChatRequest, turn: Turn, completion_id: str) -> AsyncIterator[bytes]:
        """The SSE body (``api.streaming``). Never ends without ``[DONE]`` unless the client
        left: a worker failure becomes its error event, and so does any unexpected exception
        (logged with its traceback).

        Content is sent as soon as the pipeline releases it; each call is sent as its own
        ``tool_calls`` chunk as soon as it is complete, with ``index`` counting calls over
        the whole response, in output order with the content around it (spec §10)."""
        chunks = ChunkFactory(completion_id, int(time.time()), self.core.model_id, req.include_usage)
        return sse_body(turn.batches(), _ChatEncoder(chunks, req.include_usage), request_id=completion_id,
                        close=turn.close, start_now=turn.admitted_early)


@dataclass(frozen=True)
class _ChatEncoder:
    """``chat.completion.chunk`` events (``api.streaming.StreamEncoder``): the role chunk
    first; the ending, the usage and ``[DONE]`` in the ending's batch, so in one write."""

    chunks: ChunkFactory
    include_usage: bool

    def start(self) -> bytes:
        return self.chunks.role_chunk()

    def encode(self, events: list[Event]) -> bytes:
        out = _event_chunks(self.chunks, events, self.include_usage)
        return out + DONE if isinstance(events[-1], Finished) else out

    def finish(self) -> bytes:
        return b""

    def fail(self, error: errors.APIError) -> bytes:
        return self.chunks.error_event(error.envelope()) + DONE


def _event_chunks(chunks: ChunkFactory, events: list[Event], include_usage: bool) -> bytes:
    """The SSE chunks of a batch of events, in order: each run of content one content chunk,
    each reasoning delta a reasoning chunk, a call that starts and completes in the batch its
    own ``tool_calls`` chunk; a call streamed as it is written (spec §10 "Streamed
    arguments") a start chunk, then one chunk per argument piece; the ending is the finish
    chunk (and the usage chunk)."""
    out = b""
    text = ""
    whole: set[int] = set()  # calls that start and complete in this batch: sent whole
    for event in events:
        if isinstance(event, TextDelta):
            text += event.text
            continue
        if text:
            out += chunks.content_chunk(text)
            text = ""
        if isinstance(event, ReasoningDelta):
            out += chunks.reasoning_chunk(event.text)
        elif isinstance(event, ToolCallStarted):
            if _done_in(events, event.index):
                whole.add(event.index)
            else:  # its start goes out now; the arguments follow in pieces
                out += chunks.tool_call_start_chunk(event.index, event.call_id, event.name)
        elif isinstance(event, ToolCallArgumentsDelta):
            if event.index not in whole and event.delta:
                out += chunks.tool_call_arguments_chunk(event.index, event.delta)
        elif isinstance(event, ToolCallDone) and event.index in whole:
            out += chunks.tool_calls_chunk([_tool_call(event)], first_index=event.index)
        elif isinstance(event, Finished):
            out += chunks.finish_chunk(event.reason)
            if include_usage:
                out += chunks.usage_chunk(openai_usage(event.usage))
    if text:
        out += chunks.content_chunk(text)
    return out


def _done_in(events: list[Event], index: int) -> bool:
    return any(isinstance(e, ToolCallDone) and e.index == index for e in events)


def _tool_call(call: ToolCallDone) -> ToolCall:
    return {"id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def core_request(req: ChatRequest, session: SessionKey | None) -> CoreRequest:
    """The API-neutral form of a validated chat request."""
    messages = tuple(
        Message(role=m["role"], text=m["content"], reasoning=m.get("reasoning_content"),
                tool_calls=tuple(ToolCallPart(c["id"], c["function"]["name"],
                                              c["function"]["arguments"])
                                 for c in m.get("tool_calls") or ()),
                tool_call_id=m.get("tool_call_id"), name=m.get("name"))
        for m in req.messages)
    tools = tuple(FunctionTool(t["function"]["name"], t["function"].get("description"),
                               t["function"].get("parameters"))
                  for t in req.tools or ())
    choice: ToolChoice
    if req.tool_choice == "function":
        choice = ForcedTool(req.tool_choice_function or "")
    else:
        choice = req.tool_choice  # type: ignore[assignment]
    output: OutputFormat | None = None
    fmt = req.response_format
    if fmt is not None and fmt.get("type") == "json_object":
        output = JsonObjectOutput()
    elif fmt is not None and fmt.get("type") == "json_schema":
        spec = fmt["json_schema"]  # validation checked name and schema
        output = JsonSchemaOutput(name=spec["name"], schema=spec["schema"],
                                  description=spec.get("description"), strict=spec.get("strict"))
    return CoreRequest(
        messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, output_format=output,
        sampling=Sampling(req.temperature, req.top_p, req.top_k, req.seed, req.logit_bias),
        max_tokens=req.max_tokens, stops=req.stop, session=session,
        retention=worker_retention(req.prompt_cache_retention),
        reasoning_effort=req.reasoning_effort, template_kwargs=dict(req.chat_template_kwargs))


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)
