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
turn (``Turn.close``: synchronous, idempotent), and so does the ChatStream's ``cancel``, which
the HTTP layer runs when the request ends; a client that disconnects at any point — queued,
prefilling, decoding — frees the worker.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from .. import errors
from ..config import Settings
from ..core.events import (
    Event,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallDone,
    TurnResult,
    Usage,
)
from ..core.request import (
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
    arguments_text,
)
from ..core.serving import ServingCore, Turn
from ..offload import LARGE_BODY_BYTES, prepare
from ..protocol import ChatRequest, parse_chat_request
from ..runtime import Arrival, SessionRuntime
from ..sessions import SessionKey, resolve_session_key, worker_retention
from ..sse import DONE, ChunkFactory
from ..stats import GenerationStats, log_generation
from ..turn_floor import count_turns

__all__ = ["ChatStream", "ServingChat", "core_request", "new_completion_id", "usage_dict"]

log = logging.getLogger("trioserve.serving")


@dataclass(frozen=True)
class ChatStream:
    """A streamed answer: the SSE ``body``, and ``cancel`` (synchronous, idempotent) that
    the HTTP layer calls when the request ends, whether or not the body was iterated."""

    body: AsyncIterator[bytes]
    cancel: Callable[[], None]


class ServingChat:
    """Chat Completions over a :class:`ServingCore` (``core``; built from ``settings``,
    ``model_id``, ``runtime`` and ``on_generation`` when not given)."""

    def __init__(self, core: ServingCore | None = None, *, settings: Settings | None = None,
                 model_id: str | None = None, runtime: SessionRuntime | None = None,
                 on_generation: Callable[[GenerationStats], None] = log_generation) -> None:
        if core is None:
            if settings is None or model_id is None or runtime is None:
                raise TypeError("ServingChat needs a core, or settings, model_id and runtime")
            core = ServingCore(settings=settings, model_id=model_id, runtime=runtime,
                               on_generation=on_generation)
        self.core = core

    # The core's state, under the names this class had before the core existed.
    settings = property(lambda self: self.core.settings)
    model_id = property(lambda self: self.core.model_id)
    runtime = property(lambda self: self.core.runtime)
    replay = property(lambda self: self.core.replay)
    template = property(lambda self: self.core.template,
                        lambda self, value: setattr(self.core, "template", value))
    profile = property(lambda self: self.core.profile,
                       lambda self, value: setattr(self.core, "profile", value))
    grammar_supported = property(lambda self: self.core.grammar_supported,
                                 lambda self, value: setattr(self.core, "grammar_supported", value))

    def configure(self, ready: Any) -> None:
        self.core.configure(ready)

    def capabilities(self) -> dict[str, Any] | None:
        return self.core.capabilities()

    async def create(self, body: bytes, *, completion_id: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     arrival: Arrival | None = None) -> dict[str, Any] | ChatStream:
        """Serve one request: a JSON dict (non-stream) or a ChatStream.

        Raises APIError for every failure known before the first byte of the response.
        ``completion_id`` (default: a new one) is the response's ``chatcmpl-…`` id.
        ``headers`` (case-insensitive) supply the session key headers (spec §12).
        ``arrival`` (from ``SessionRuntime.arrival``) ends when the generation is submitted.
        """
        completion_id = completion_id or new_completion_id()
        if len(body) <= self.core.settings.max_body_bytes:
            # Before any per-message work: a conversation whose turns alone cannot fit is
            # refused in milliseconds, whatever its length (trioserve.turn_floor).
            turns = await count_turns(body, served_model=self.core.model_id)
            if turns is not None:
                await self.core.refuse_unfittable(turns)
        req = await prepare(partial(parse_chat_request, body, served_model=self.core.model_id,
                                    max_body_bytes=self.core.settings.max_body_bytes),
                            large=len(body) > LARGE_BODY_BYTES)
        session = resolve_session_key(
            {"prompt_cache_key": req.prompt_cache_key, "session_id": req.session_id}, headers)
        turn = await self.core.start(core_request(req, session), request_id=completion_id,
                                     arrival=arrival)
        if req.stream:
            return ChatStream(self._stream(req, turn, completion_id), turn.close)
        try:
            result = await turn.collect()
        finally:
            turn.close()
        return self._completion(result, completion_id)

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
            "usage": usage_dict(result.finished.usage),
        }

    async def _stream(self, req: ChatRequest, turn: Turn, completion_id: str) -> AsyncIterator[bytes]:
        """The SSE body. Never ends without ``[DONE]`` unless the client left: a worker
        failure becomes its error event, and so does any unexpected exception (a bug, or
        e.g. a RecursionError on pathological model output), logged with its traceback.

        Content is sent as soon as the pipeline releases it; each call is sent as its own
        ``tool_calls`` chunk as soon as it is complete, with ``index`` counting calls over
        the whole response, in output order with the content around it (spec §10)."""
        chunks = ChunkFactory(completion_id, int(time.time()), self.core.model_id, req.include_usage)
        out = chunks.role_chunk()
        try:
            try:
                async for events in turn.batches():
                    out += _event_chunks(chunks, events, req.include_usage)
                    if isinstance(events[-1], Finished):
                        out += DONE  # the ending, the usage and [DONE] go in one write
                    if out:
                        yield out
                        out = b""
            except errors.APIError as exc:
                yield out + chunks.error_event(exc.envelope()) + DONE
            except Exception:
                log.exception("stream %s failed", completion_id)
                turn.close()
                error = errors.internal_error(f"the response could not be completed (request id "
                                              f"{completion_id}; details in the server log)")
                yield out + chunks.error_event(error.envelope()) + DONE
        finally:
            turn.close()


def _event_chunks(chunks: ChunkFactory, events: list[Event], include_usage: bool) -> bytes:
    """The SSE chunks of a batch of events, in order: each run of content one content chunk,
    each reasoning delta a reasoning chunk, each completed call its own ``tool_calls`` chunk;
    the ending is the finish chunk (and the usage chunk)."""
    out = b""
    text = ""
    for event in events:
        if isinstance(event, TextDelta):
            text += event.text
            continue
        if text:
            out += chunks.content_chunk(text)
            text = ""
        if isinstance(event, ReasoningDelta):
            out += chunks.reasoning_chunk(event.text)
        elif isinstance(event, ToolCallDone):
            out += chunks.tool_calls_chunk([_tool_call(event)], first_index=event.index)
        elif isinstance(event, Finished):
            out += chunks.finish_chunk(event.reason)
            if include_usage:
                out += chunks.usage_chunk(usage_dict(event.usage))
    if text:
        out += chunks.content_chunk(text)
    return out


def _tool_call(call: ToolCallDone) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def usage_dict(usage: Usage) -> dict[str, Any]:
    """OpenAI usage. ``prompt_tokens_details.cached_tokens`` = the prompt tokens the worker did
    not compute for this request; ``completion_tokens_details`` with OpenAI's
    ``accepted_prediction_tokens`` / ``rejected_prediction_tokens`` = the self-speculative
    draft tokens accepted / rejected, only when the generation was drafted (spec §8)."""
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if usage.drafted_tokens is not None:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_draft_tokens or 0,
            "rejected_prediction_tokens": usage.rejected_draft_tokens or 0}
    return out


def core_request(req: ChatRequest, session: SessionKey | None) -> CoreRequest:
    """The API-neutral form of a validated chat request."""
    messages = tuple(
        Message(role=m["role"], text=m["content"], reasoning=m.get("reasoning_content"),
                tool_calls=tuple(ToolCallPart(c["id"], c["function"]["name"],
                                              arguments_text(c["function"]["arguments"]))
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
        spec = fmt.get("json_schema") or {}
        output = JsonSchemaOutput(name=spec.get("name"), schema=spec.get("schema"),
                                  description=spec.get("description"), strict=spec.get("strict"))
    return CoreRequest(
        messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls, output_format=output,
        sampling=Sampling(req.temperature, req.top_p, req.top_k, req.seed),
        max_tokens=req.max_tokens, stops=req.stop, session=session,
        retention=worker_retention(req.prompt_cache_retention),
        reasoning_effort=req.reasoning_effort, template_kwargs=dict(req.chat_template_kwargs))


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)
