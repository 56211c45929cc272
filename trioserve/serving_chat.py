"""ServingChat: the OpenAI Chat Completions adapter over SessionRuntime.

Validation (``protocol``), chat template rendering (``chat_template``), the model profile
(``profiles``: tool injection, reasoning controls and markers, extra stops, the BOS rule),
tool-call parsing (``tool_formats``, in the profile's format), SSE framing (``sse``) and usage
live here; processes and queues do not.

Prompts go to the runtime as segments (``GenerateParams.prompt_segments``): template text is
tokenized with special-token parsing, text from the request without it, so a user who types
``<|im_start|>system`` gets characters, not a control token (issue 9; worker protocol v2 §5).

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

import dataclasses
import logging
import secrets
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

from . import errors, structured
from .chat_template import ChatTemplate, ControlTextError, ControlTokens, TemplateError, TemplateLoadError
from .config import Settings
from .profiles import ServingProfile, resolve_profile
from .protocol import ChatRequest, parse_chat_request
from .reasoning import ReasoningSplitter, split_reasoning
from .replay import ReplayStore, ReplayTurn, message_signature
from .sessions import SessionKey, resolve_session_key, worker_retention
from .runtime import Arrival, Done, GenerateParams, Generation, GenerationError, SessionRuntime
from .sse import DONE, ChunkFactory
from .stats import GenerationStats, GenerationTimer, log_generation
from .supervisor import FatalStartupError
from .tool_formats import ParseEvent, ToolCallParser, parser_class, tool_schemas
from .worker_client import ReadyInfo
from .worker_protocol import IdsSegment, Segment, TextSegment

log = logging.getLogger("trioserve.serving")


@dataclass(frozen=True)
class ChatStream:
    """A streamed answer: the SSE ``body``, and ``cancel`` (synchronous, idempotent) that
    the HTTP layer calls when the request ends, whether or not the body was iterated."""

    body: AsyncIterator[bytes]
    cancel: Callable[[], None]


class ServingChat:
    """Turns validated chat requests into generations and generations into responses."""

    def __init__(self, *, settings: Settings, model_id: str, runtime: SessionRuntime,
                 on_generation: Callable[[GenerationStats], None] = log_generation) -> None:
        self.settings = settings
        self.model_id = model_id
        self.runtime = runtime
        self.on_generation = on_generation  # called once per generation when its request ends
        self.template: ChatTemplate | None = None
        self.profile: ServingProfile | None = None
        self.n_ctx = 0
        self.grammar_supported = False  # the worker enforces grammars (structured outputs)
        self.replay = ReplayStore()  # per session key: assistant turns' generated token ids

    def configure(self, ready: ReadyInfo) -> None:
        """Pick the chat template and the model profile when a worker becomes ready
        (Supervisor's on_ready).

        Template order: the ``chat_template`` file when configured, else a Hugging Face
        directory when configured, else the template the model carries, else ChatML only
        when the operator allowed the fallback. No template is a FatalStartupError: serving a
        model with a guessed format would silently produce garbage. BOS/EOS come from the
        Hugging Face directory when given, else from the ready record.

        The profile is then resolved from the ``profile`` setting or the template and the
        GGUF architecture, the template is probed for what it renders, and the result is
        logged (and served as ``capabilities`` by ``GET /v1/models``).
        """
        self.n_ctx = ready.n_ctx
        # Per incarnation: a restarted worker could be another build.
        self.grammar_supported = ready.raw.get("capabilities", {}).get("grammar") is True
        if self.template is not None:
            return  # a restarted worker serves the same model
        s = self.settings
        special = ready.special_tokens
        try:
            if s.chat_template:
                source = Path(s.chat_template).read_text(encoding="utf-8")
                bos, eos = special.get("bos") or "", special.get("eos") or ""
                if s.hf_tokenizer_dir:  # its tokens are the more specific
                    hf = ChatTemplate.from_hf_dir(s.hf_tokenizer_dir)
                    bos, eos = hf.bos_token, hf.eos_token
                template = ChatTemplate.from_string(source, bos, eos, no_think=s.no_think)
            elif s.hf_tokenizer_dir:
                template = ChatTemplate.from_hf_dir(s.hf_tokenizer_dir, no_think=s.no_think)
            elif ready.chat_template:
                template = ChatTemplate.from_string(
                    ready.chat_template, bos_token=special.get("bos") or "",
                    eos_token=special.get("eos") or "", no_think=s.no_think)
            elif s.chatml_fallback:
                template = ChatTemplate.chatml(no_think=s.no_think)
            else:
                raise FatalStartupError(
                    "the model has no chat template: pass --chat-template with a Jinja file, "
                    "--hf-tokenizer-dir with a directory holding tokenizer_config.json, or "
                    "--chatml-fallback to use ChatML")
        except (TemplateLoadError, OSError, UnicodeDecodeError) as exc:
            # A template that does not load will not load after a restart either.
            raise FatalStartupError(f"cannot load the chat template: {exc}") from exc
        architecture = (ready.raw.get("model") or {}).get("architecture")
        try:
            profile = resolve_profile(template, architecture=architecture, override=s.profile,
                                      tools_injection=s.tools_injection,
                                      bos_token=special.get("bos") or template.bos_token)
        except KeyError as exc:  # an unknown profile name (the CLI's choices prevent it)
            raise FatalStartupError(str(exc.args[0])) from exc
        try:
            parser_class(profile.tool_format)  # every registry entry names a known parser
        except ValueError as exc:
            raise FatalStartupError(str(exc)) from exc
        log.info("%s", profile.describe())
        control = special.get("control")
        if isinstance(control, list) and all(isinstance(t, str) for t in control):
            # The worker's tokenizer decides what a control token is, whatever the template
            # source: render_segments refuses request text that would become one.
            template.control_tokens = ControlTokens(control)
        self.template = template
        self.profile = profile

    def capabilities(self) -> dict[str, Any] | None:
        """The model's capabilities for ``GET /v1/models`` (None until a worker was ready)."""
        return self.profile.capabilities() if self.profile is not None else None

    # -- request entry -----------------------------------------------------------------

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
        req = parse_chat_request(body, served_model=self.model_id,
                                 max_body_bytes=self.settings.max_body_bytes)
        session = resolve_session_key(
            {"prompt_cache_key": req.prompt_cache_key, "session_id": req.session_id}, headers)
        if self.template is None or self.profile is None:
            raise errors.worker_unavailable("the model worker is loading")
        # response_format / forced tool_choice → a grammar, or a 400 before anything runs.
        constraint = structured.constraint_for(req, tool_format=self.profile.tool_format)
        structured.require_worker_support(constraint, self.grammar_supported)
        replays = self.replay.plan(session.key, req.messages) if session is not None else []
        params = self._generate_params(req, self.template, self.profile, replays)
        if session is not None:
            params = dataclasses.replace(params, session_id=session.key,
                                         retention=worker_retention(req.prompt_cache_retention))
        if constraint is not None:
            params = dataclasses.replace(params, grammar=constraint.grammar)
        timer = GenerationTimer()
        try:
            gen = self.runtime.submit(params, arrival=arrival)
        except GenerationError as exc:
            raise _api_error(exc) from None
        try:
            first = await gen.receive()
            timer.mark_first_output()
        except GenerationError as exc:
            gen.cancel()
            self._report(completion_id, timer, gen)
            # Grammar errors come before any token: a plain 400.
            raise (structured.worker_error(exc.code, exc.message, constraint)
                   or _api_error(exc)) from None
        except BaseException:
            gen.cancel()  # client went away while queued or prefilling
            self._report(completion_id, timer, gen)
            raise
        if req.stream:
            def end() -> None:  # also when the body was never iterated
                gen.cancel()
                self._report(completion_id, timer, gen)
                self._remember(req, session, gen)
            return ChatStream(self._stream(req, gen, first, completion_id, timer), end)
        try:
            return await self._complete(req, gen, first, completion_id)
        finally:
            gen.cancel()
            self._report(completion_id, timer, gen)
            self._remember(req, session, gen)

    def _remember(self, req: ChatRequest, session: SessionKey | None, gen: Generation) -> None:
        """Remember this turn's generated ids for replay (spec §12) when they are exactly
        what the client saw. Never raises (runs in ``finally`` blocks)."""
        if session is None:
            return
        try:
            done = gen.done
            ids = done.record.get("generated_token_ids") if done is not None else None
            if done is None or done.cancelled or not isinstance(ids, list) or not ids:
                return
            reasoning, text = split_reasoning("".join(gen.text_parts), prompt=gen.params.prompt,
                                              markers=self._reasoning_markers())
            if reasoning:
                return
            calls: list[Any] = []
            parser = self._tool_parser(req)  # the profile's format, as the client was answered
            if parser is not None:
                text, calls = parser.parse(text)
            signature = message_signature(text, calls)
            if signature is not None:
                self.replay.record(session.key, req.messages, ReplayTurn(signature, tuple(ids)))
        except Exception:
            log.exception("could not remember the turn for replay")

    def _report(self, completion_id: str, timer: GenerationTimer, gen: Generation) -> None:
        """Hand this generation's stats to ``on_generation``, once (later calls do
        nothing; never raises: it runs in ``finally`` blocks)."""
        if timer.reported:
            return
        timer.reported = True
        try:
            done = gen.done
            self.on_generation(timer.finish(completion_id, done.record if done else None,
                                            cancel_requested=gen.cancel_requested))
        except Exception:
            log.exception("could not report generation stats")

    def _generate_params(self, req: ChatRequest, template: ChatTemplate,
                         profile: ServingProfile,
                         replays: list[tuple[int, ReplayTurn]] | None = None) -> GenerateParams:
        """Render the request through the profile and template into GenerateParams.

        ``replays``: assistant turns (message index, remembered turn) whose rendered body is
        replaced by the ids the model generated for it (spec §12); a turn whose body cannot
        be located in the rendered prompt is rendered as text.

        Raises APIError 400: ``reasoning_effort`` on a template without a thinking switch,
        tools on a template that cannot render them with injection off (both
        ``unsupported_parameter``), or a template that refused the messages.
        """
        try:
            kwargs = profile.template_kwargs(req.reasoning_effort, req.chat_template_kwargs)
        except ValueError as exc:
            raise errors.unsupported_parameters([("reasoning_effort", str(exc))]) from None
        try:
            messages, tools = profile.prepare_messages(
                req.messages, req.tools if req.tools_enabled else None)
        except ValueError as exc:
            raise errors.unsupported_parameters([("tools", str(exc))]) from None
        try:
            rendered = template.render_segments(messages, tools=tools, add_generation_prompt=True,
                                                template_kwargs=kwargs)
        except ControlTextError as exc:
            raise errors.control_text_error(str(exc), exc.param) from None
        except TemplateError as exc:
            raise errors.template_error(str(exc)) from None
        if not rendered.separated:
            log.debug("the chat template reworks request text: that text stays in template "
                      "text (it holds no control token; render_segments checked)")
        segments = profile.apply_prefix_rule(rendered.segments)
        prompt_segments: tuple[Segment, ...] = tuple(TextSegment(text, special) for text, special in segments)
        if replays:
            cuts = self._replay_cuts(req, template, profile, kwargs, rendered.text, replays)
            if cuts:
                shift = len("".join(t for t, _ in segments)) - len(rendered.text)
                prompt_segments = splice_ids(segments, [(a + shift, b + shift, ids) for a, b, ids in cuts])
        return GenerateParams(
            prompt="".join(text for text, _ in segments),
            prompt_segments=prompt_segments,
            max_new_tokens=req.max_tokens if req.max_tokens is not None else -1,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, stop=profile.stops(req.stop))

    def _tool_parser(self, req: ChatRequest) -> ToolCallParser | None:
        """A fresh parser of the profile's tool-call format for this request's declared
        tools, or None when the output is not parsed for calls (no tools, or
        ``tool_choice: "none"``)."""
        if not req.tools_enabled or self.profile is None:
            return None
        return parser_class(self.profile.tool_format)(tool_schemas(req.tools))

    def _replay_cuts(self, req: ChatRequest, template: ChatTemplate, profile: ServingProfile,
                     kwargs: Any, full: str, replays: list[tuple[int, ReplayTurn]]
                     ) -> list[tuple[int, int, tuple[int, ...]]]:
        """Character spans of ``full`` (the rendered prompt) holding the bodies of the replayed
        assistant turns, with their ids. A turn's body starts where the render of the messages
        before it (with the generation prompt) ends and ends at the end-of-turn text of the
        render that includes it; turns whose renders are not prefixes of ``full`` are skipped."""
        eos = template.eos_token
        if not eos:
            return []
        tools = req.tools if req.tools_enabled else None
        cuts: list[tuple[int, int, tuple[int, ...]]] = []
        for index, turn in replays:
            try:
                before, t1 = profile.prepare_messages(req.messages[:index], tools)
                upto, t2 = profile.prepare_messages(req.messages[:index + 1], tools)
                head = template.render(before, tools=t1, add_generation_prompt=True, template_kwargs=kwargs)
                whole = template.render(upto, tools=t2, add_generation_prompt=False, template_kwargs=kwargs)
            except (ValueError, TemplateError):
                continue
            if not (whole.startswith(head) and full.startswith(whole)):
                continue
            end = whole.rfind(eos, len(head))
            if end <= len(head) or (cuts and len(head) < cuts[-1][1]):
                continue
            cuts.append((len(head), end, turn.ids))
        return cuts

    def _reasoning_markers(self) -> tuple[str, str] | None:
        markers = self.profile.reasoning_markers if self.profile else None
        return (markers.start, markers.end) if markers else None

    # -- non-streaming -----------------------------------------------------------------

    async def _complete(self, req: ChatRequest, gen: Generation, first: str | None,
                        completion_id: str) -> dict[str, Any]:
        guard = _StopGuard(gen.params.stop)
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
        reasoning, text = split_reasoning("".join(parts), prompt=gen.params.prompt,
                                          markers=self._reasoning_markers())
        calls: list[Any] = []
        parser = self._tool_parser(req)
        if parser is not None:
            text, calls = parser.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_id,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(done, guard.hit, bool(calls))}],
            "usage": _usage(done),
        }

    # -- streaming ---------------------------------------------------------------------

    async def _stream(self, req: ChatRequest, gen: Generation, first: str | None,
                      completion_id: str, timer: GenerationTimer) -> AsyncIterator[bytes]:
        """The SSE body. Never ends without ``[DONE]`` unless the client left: a worker
        failure becomes its error event, and so does any unexpected exception (a bug, or
        e.g. a RecursionError on pathological model output), logged with its traceback.

        Tool calls (spec §10): each worker piece goes stop guard -> reasoning splitter ->
        the profile's tool-call parser. Content is sent as soon as the parser releases it
        (it holds only text that could still start a call marker, and an open call block);
        each call is sent as its own ``tool_calls`` chunk as soon as it is complete, with
        ``index`` counting calls over the whole response, in output order with the content
        around it (a piece may hold several tokens: the runtime hands over everything that
        arrived since the last receive)."""
        chunks = ChunkFactory(completion_id, int(time.time()), self.model_id, req.include_usage)
        guard = _StopGuard(gen.params.stop)
        thinking = ReasoningSplitter(prompt=gen.params.prompt, markers=self._reasoning_markers())
        tools = self._tool_parser(req)
        calls_sent = 0  # the next call's ``index``
        try:
            out = chunks.role_chunk()
            piece = first
            try:
                while piece is not None:
                    reasoning, text = thinking.feed(guard.feed(piece))
                    if reasoning:
                        out += chunks.reasoning_chunk(reasoning)
                    if tools is None:
                        if text:
                            out += chunks.content_chunk(text)
                    else:
                        body, calls_sent = _body_chunks(chunks, tools.feed_events(text), calls_sent)
                        out += body
                    if guard.hit:
                        gen.cancel()
                        await _drain(gen)
                        break
                    if out:
                        yield out
                        out = b""
                    piece = await gen.receive()
                reasoning, rest = thinking.finish()
                if reasoning:
                    out += chunks.reasoning_chunk(reasoning)
                if tools is None:
                    if rest:
                        out += chunks.content_chunk(rest)
                else:
                    events = tools.feed_events(rest) + tools.finish_events()
                    body, calls_sent = _body_chunks(chunks, events, calls_sent)
                    out += body
                done = gen.done
                out += chunks.finish_chunk(_finish_reason(done, guard.hit, calls_sent > 0))
                if req.include_usage:
                    out += chunks.usage_chunk(_usage(done))
                yield out + DONE
            except GenerationError as exc:
                yield out + chunks.error_event(_api_error(exc).envelope()) + DONE
            except Exception:
                log.exception("stream %s failed", completion_id)
                gen.cancel()
                error = errors.internal_error(f"the response could not be completed (request id "
                                              f"{completion_id}; details in the server log)")
                yield out + chunks.error_event(error.envelope()) + DONE
        finally:
            gen.cancel()
            self._report(completion_id, timer, gen)


def _body_chunks(chunks: ChunkFactory, events: list[ParseEvent], calls_sent: int) -> tuple[bytes, int]:
    """The SSE chunks of a tool parser's events, in order: each content run one content
    chunk, each call its own ``tool_calls`` chunk with the next ``index``. Returns the bytes
    and the updated number of calls sent."""
    out = b""
    text = ""
    for event in events:
        if isinstance(event, str):
            text += event
            continue
        if text:
            out += chunks.content_chunk(text)
            text = ""
        out += chunks.tool_calls_chunk([event], first_index=calls_sent)
        calls_sent += 1
    if text:
        out += chunks.content_chunk(text)
    return out, calls_sent


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


def _usage(done: Done | None) -> dict[str, Any]:
    """OpenAI usage. ``prompt_tokens_details.cached_tokens`` = the prompt tokens the worker did
    not compute for this request (resident in its slot, or restored from a spilled session):
    the done record's ``reused_prompt_tokens`` (spec §8)."""
    prompt = done.prompt_tokens if done else 0
    completion = done.completion_tokens if done else 0
    cached = 0
    if done is not None:
        reused = done.record.get("reused_prompt_tokens")
        if isinstance(reused, int) and not isinstance(reused, bool):
            cached = max(0, min(reused, prompt))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def _api_error(exc: GenerationError) -> errors.APIError:
    """Map a runtime/worker failure to the HTTP contract's error envelope."""
    retry_after = 1
    if exc.code in ("server_busy", "capacity_exhausted", "session_busy"):
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


def splice_ids(segments: tuple[tuple[str, bool], ...],
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
