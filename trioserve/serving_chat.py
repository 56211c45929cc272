"""ServingChat: the OpenAI Chat Completions adapter over SessionRuntime.

Validation (``protocol``), chat template rendering (``chat_template``), tool-call parsing
(``tool_calls``), SSE framing (``sse``) and usage live here; processes and queues do not.

Response timing contract: ``create`` returns only after the first worker record for the
request arrived (first text, an empty finish, or an error). Errors that can be known
before generation — validation, queue full, worker unavailable, and the worker's exact
``context_length_exceeded`` — therefore always become plain JSON error responses, never
a stream that has already started. After that, a failure inside a stream is an ``error``
event followed by ``[DONE]``.

Cancellation contract: every path out of ``create`` and out of the stream generator
calls ``Generation.cancel()`` (synchronous, idempotent), so a client that disconnects at
any point — queued, prefilling, decoding — frees the worker.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from . import errors
from .chat_template import ChatTemplate, TemplateError, TemplateLoadError
from .config import Settings
from .protocol import ChatRequest, parse_chat_request
from .reasoning import ReasoningSplitter, split_reasoning
from .runtime import Done, GenerateParams, Generation, GenerationError, SessionRuntime
from .sse import DONE, ChunkFactory
from .supervisor import FatalStartupError
from .tool_calls import ToolCallStreamParser, parse_tool_calls
from .worker_client import ReadyInfo


@dataclass(frozen=True)
class ChatStream:
    """A streamed answer: the SSE ``body``, and ``cancel`` (synchronous, idempotent) that
    the HTTP layer calls when the request ends, whether or not the body was iterated."""

    body: AsyncIterator[bytes]
    cancel: Callable[[], None]


class ServingChat:
    """Turns validated chat requests into generations and generations into responses."""

    def __init__(self, *, settings: Settings, model_id: str, runtime: SessionRuntime) -> None:
        self.settings = settings
        self.model_id = model_id
        self.runtime = runtime
        self.template: ChatTemplate | None = None
        self.n_ctx = 0

    def configure(self, ready: ReadyInfo) -> None:
        """Pick the chat template when a worker becomes ready (Supervisor's on_ready).

        Order: a Hugging Face directory when configured, else the template the model
        carries, else ChatML only when the operator allowed the fallback. No template is
        a FatalStartupError: serving a model with a guessed format would silently produce
        garbage.
        """
        self.n_ctx = ready.n_ctx
        if self.template is not None:
            return  # a restarted worker serves the same model
        s = self.settings
        try:
            if s.hf_tokenizer_dir:
                template = ChatTemplate.from_hf_dir(s.hf_tokenizer_dir, no_think=s.no_think)
            elif ready.chat_template:
                special = ready.special_tokens
                template = ChatTemplate.from_string(
                    ready.chat_template, bos_token=special.get("bos") or "",
                    eos_token=special.get("eos") or "", no_think=s.no_think)
            elif s.chatml_fallback:
                template = ChatTemplate.chatml(no_think=s.no_think)
            else:
                raise FatalStartupError(
                    "the model has no chat template: pass --hf-tokenizer-dir with a directory "
                    "holding tokenizer_config.json, or --chatml-fallback to use ChatML")
        except (TemplateLoadError, OSError) as exc:
            # A template that does not load will not load after a restart either.
            raise FatalStartupError(f"cannot load the chat template: {exc}") from exc
        self.template = template

    # -- request entry -----------------------------------------------------------------

    async def create(self, body: bytes) -> dict[str, Any] | ChatStream:
        """Serve one request: a JSON dict (non-stream) or a ChatStream.

        Raises APIError for every failure known before the first byte of the response.
        """
        req = parse_chat_request(body, served_model=self.model_id,
                                 max_body_bytes=self.settings.max_body_bytes)
        if self.template is None:
            raise errors.worker_unavailable("the model worker is loading")
        try:
            prompt = self.template.render(
                req.messages, tools=req.tools if req.tools_enabled else None,
                add_generation_prompt=True, template_kwargs=req.chat_template_kwargs)
        except TemplateError as exc:
            raise errors.template_error(str(exc)) from None
        params = GenerateParams(
            prompt=prompt,
            max_new_tokens=req.max_tokens if req.max_tokens is not None else -1,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, stop=req.stop)
        try:
            gen = self.runtime.submit(params)
        except GenerationError as exc:
            raise _api_error(exc) from None
        try:
            first = await gen.receive()
        except GenerationError as exc:
            gen.cancel()
            raise _api_error(exc) from None
        except BaseException:
            gen.cancel()  # client went away while queued or prefilling
            raise
        if req.stream:
            return ChatStream(self._stream(req, gen, first), gen.cancel)
        try:
            return await self._complete(req, gen, first)
        finally:
            gen.cancel()

    # -- non-streaming -----------------------------------------------------------------

    async def _complete(self, req: ChatRequest, gen: Generation, first: str | None) -> dict[str, Any]:
        guard = _StopGuard(req.stop)
        parts: list[str] = []
        piece = first
        try:
            while piece is not None:
                parts.append(guard.feed(piece))
                if guard.hit:
                    gen.cancel()
                    await _drain(gen)
                    break
                piece = await gen.receive()
        except GenerationError as exc:
            raise _api_error(exc) from None
        done = gen.done
        reasoning, text = split_reasoning("".join(parts), prompt=gen.params.prompt)
        calls: list[dict[str, Any]] = []
        if req.tools_enabled:
            text, calls = parse_tool_calls(text, req.tool_names)
        message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "id": _completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_id,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(done, guard.hit, bool(calls))}],
            "usage": _usage(done),
        }

    # -- streaming ---------------------------------------------------------------------

    async def _stream(self, req: ChatRequest, gen: Generation, first: str | None) -> AsyncIterator[bytes]:
        chunks = ChunkFactory(_completion_id(), int(time.time()), self.model_id, req.include_usage)
        guard = _StopGuard(req.stop)
        thinking = ReasoningSplitter(prompt=gen.params.prompt)
        tools = ToolCallStreamParser(req.tool_names) if req.tools_enabled else None
        try:
            out = chunks.role_chunk()
            piece = first
            try:
                while piece is not None:
                    reasoning, text = thinking.feed(guard.feed(piece))
                    if reasoning:
                        out += chunks.reasoning_chunk(reasoning)
                    if tools is not None:
                        text = tools.feed(text)
                    if text:
                        out += chunks.content_chunk(text)
                    if guard.hit:
                        gen.cancel()
                        await _drain(gen)
                        break
                    if out:
                        yield out
                        out = b""
                    piece = await gen.receive()
                calls: list[dict[str, Any]] = []
                reasoning, rest = thinking.finish()
                if reasoning:
                    out += chunks.reasoning_chunk(reasoning)
                if tools is not None:
                    rest = tools.feed(rest)
                    more, calls = tools.finish()
                    rest += more
                if rest:
                    out += chunks.content_chunk(rest)
                if calls:
                    out += chunks.tool_calls_chunk(calls)
                done = gen.done
                out += chunks.finish_chunk(_finish_reason(done, guard.hit, bool(calls)))
                if req.include_usage:
                    out += chunks.usage_chunk(_usage(done))
                yield out + DONE
            except GenerationError as exc:
                yield out + chunks.error_event(_api_error(exc).envelope()) + DONE
        finally:
            gen.cancel()


class _StopGuard:
    """Control-plane backstop for stop strings: the worker already never emits them;
    this re-checks what crosses the wire, across piece boundaries, and cuts if needed."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.tail = ""
        self.hit = False

    def feed(self, piece: str) -> str:
        if not self.stops or self.hit:
            return "" if self.hit else piece
        window = self.tail + piece
        cut = min((i for i in (window.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            return piece[: max(0, cut - len(self.tail))]
        self.tail = window[-self.keep:] if self.keep else ""
        return piece


async def _drain(gen: Generation) -> None:
    """Consume a cancelled generation up to its terminal record (bounded by the runtime's
    cancel grace), so its usage is known."""
    while await gen.receive() is not None:
        pass


def _finish_reason(done: Done | None, stop_hit: bool, tool_calls: bool) -> str:
    if tool_calls:
        return "tool_calls"
    if stop_hit or done is None:
        return "stop"
    return done.finish_reason


def _usage(done: Done | None) -> dict[str, int]:
    prompt = done.prompt_tokens if done else 0
    completion = done.completion_tokens if done else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def _api_error(exc: GenerationError) -> errors.APIError:
    """Map a runtime/worker failure to the HTTP contract's error envelope."""
    retry_after = 1
    if exc.code in ("server_busy", "capacity_exhausted"):
        return errors.server_busy(retry_after)
    if exc.code in ("worker_unavailable", "cancelled"):
        return errors.worker_unavailable(exc.message, retry_after)
    if exc.code == "context_length_exceeded":
        return errors.context_length_exceeded(int(exc.details.get("prompt_tokens", 0)),
                                              int(exc.details.get("n_ctx", 0)))
    if exc.code in ("empty_prompt", "invalid_token_id", "invalid_request"):
        return errors.invalid_value(exc.message, "messages")
    # The request could not be encoded for the worker (worker_protocol.RequestRejected).
    if exc.code == "invalid_unicode":
        field = exc.details.get("field") or ""
        return errors.invalid_value(exc.message, "stop" if field.startswith("stop") else "messages")
    if exc.code == "line_too_long":
        return errors.APIError(413, errors.INVALID_REQUEST, f"The rendered prompt is too large: "
                               f"{exc.message}. Send a shorter conversation.", code="request_too_large")
    return errors.internal_error(f"the model worker failed ({exc.code}): {exc.message}")
