"""ServingCore: one API-neutral request (``core.request``) in, one :class:`Turn` of typed
events (``core.events``) out.

Owns what every API shares: the chat template and model profile (picked when a worker
becomes ready: core/model_setup.py), rendering, output constraints (structured outputs, forced
tool calls), the session key and token-id replay (spec §12), admission through the runtime,
the output pipeline,
per-generation stats, and the mapping of runtime failures to :class:`~trioserve.errors.APIError`.
It owns no wire format: adapters (``trioserve.api.*``) turn requests into a
:class:`~trioserve.core.request.CoreRequest` and events into their own bytes and errors.

Timing contract: :meth:`ServingCore.start` returns only once the first worker record for the
request arrived (first text, an empty finish, or an error), so every failure that can be
known before generation — validation, queue full, worker unavailable, context too long, a
rejected grammar — is raised by ``start`` as an APIError, before an adapter answers anything.
Failures after that surface from :meth:`Turn.batches` as APIError.

Cancellation contract: :meth:`Turn.close` (synchronous, idempotent, never raises) cancels
the generation, reports its stats and remembers the turn for replay; adapters call it on every
path out of a request (the HTTP layer's request-end hook for streams), so a client that
disconnects at any point — queued, prefilling, decoding — frees the worker. ``start`` cancels
the generation itself when it fails or is cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial
from typing import Any

import trio

from trioserve.core.model_names import ModelNames
from trioserve import errors, limits

from trioserve.core import constraints as structured
from trioserve.core.admission import first_record, report_generation, submit
from trioserve.core.logit_bias import BiasSupport
from trioserve.core import model_setup
from trioserve.model.chat_template import ChatTemplate
from trioserve.model.template_errors import ControlTextError, TemplateError
from trioserve.config import Settings
from trioserve.core.offload import LARGE_MESSAGE_COUNT, prepare
from trioserve.model.profiles import ServingProfile, UnreadTemplateVariable
from trioserve.core.checkpoint_hints import find_marks, mark_segments
from trioserve.core.replay import ReplayStore, ReplayTurn, replay_cuts, splice_ids
from trioserve.core.branches import Placement
from trioserve.core.session_branches import SessionBranches, remember_turn, stats_extra, with_divergence
from trioserve.core.raw import RawPrompts
from trioserve.core.runtime import Arrival, Runtime, api_error
from trioserve.worker.runtime import GenerateParams, Generation, GenerationError
from trioserve.worker.tokenize_gate import GateFull, tokenizer_busy
from trioserve.core.stats import GenerationStats, GenerationTimer, log_generation
from trioserve.model.tool_formats import ToolCallParser, parser_class, tool_schemas
from trioserve.core.turn_floor import MIN_TURNS, Survey, measure_turn_floor
from trioserve.worker.protocol import Ready, Segment, TextSegment, Tokenize, Tokens
from trioserve.core.events import Accumulator, Event, Finished, TurnResult
from trioserve.core.pipeline import OutputPipeline
from trioserve.core.request import CoreRequest, Message, unmatched_tool_result

__all__ = ["EARLY_START_CHARS", "ServingCore", "Turn"]

# Streams whose rendered prompt is at least this long start at admission (ServingCore.start's
# early_start): about a thousand tokens, a prefill long enough to be worth a tokenize call.
EARLY_START_CHARS = 4096

log = logging.getLogger("trioserve.serving")


class Turn:
    """One admitted generation and its events. Produced by :meth:`ServingCore.start`.

    Consume it once, either by iterating :meth:`batches` (streaming) or by awaiting
    :meth:`collect` (whole answer); then, or whenever the request ends, call :meth:`close`.
    ``result`` holds what was produced so far (everything once finished).
    """

    def __init__(self, core: ServingCore, request: CoreRequest, request_id: str,
                 gen: Generation, first: str | None, pipeline: OutputPipeline,
                 timer: GenerationTimer, *, admitted_early: bool = False,
                 placement: Placement | None = None) -> None:
        self.request = request
        self.placement = placement  # its session branch and divergence (spec §12)
        # Returned at admission, before the first worker record (ServingCore.start's
        # early_start): the first record is awaited by batches().
        self.admitted_early = admitted_early
        self.request_id = request_id
        self._core = core
        self._gen = gen
        self._first = first
        self._pipeline = pipeline
        self._timer = timer
        self._acc = Accumulator()
        self._consumed = False
        self._closed = False

    @property
    def prompt(self) -> str:
        """The rendered prompt text (diagnostics and tests)."""
        return self._gen.params.prompt

    @property
    def result(self) -> TurnResult:
        return self._acc.result

    @property
    def finished(self) -> Finished | None:
        """The ending, once :meth:`batches` delivered it."""
        return self._acc.finished

    async def batches(self) -> AsyncGenerator[list[Event], None]:
        """The events, one non-empty list per piece of worker output (a piece may hold several
        tokens: the runtime hands over everything that arrived since the last receive), the
        last list ending with :class:`Finished`. Raises APIError when the worker fails the
        generation midway. Callable once."""
        if self._consumed:
            raise RuntimeError("a turn's events can be consumed once")
        self._consumed = True
        pipeline, gen = self._pipeline, self._gen
        piece = self._first
        try:
            if self.admitted_early:
                piece = await gen.receive()
                self._timer.mark_first_output()
            while piece is not None:
                events = pipeline.feed(piece)
                if pipeline.stop_hit:
                    gen.cancel()
                    await _drain(gen)
                    break
                if events:
                    self._acc.extend(events)
                    yield events
                piece = await gen.receive()
            tail = (events if pipeline.stop_hit else []) + pipeline.finish(gen.done)
        except GenerationError as exc:
            raise api_error(exc) from None
        tail = with_divergence(self.placement, tail)
        self._acc.extend(tail)
        yield tail

    async def collect(self) -> TurnResult:
        """Consume every event; the whole answer."""
        async for _ in self.batches():
            pass
        return self._acc.result

    @property
    def token_records(self) -> int:
        """Token records the worker sent for this generation so far: at most the tokens it
        generated (a record carries one token's text, or a held-back tail; spec §4.1)."""
        return len(self._gen.text_parts)

    async def cut(self) -> list[Event]:
        """End the generation early, after :meth:`batches` was left between two batches:
        cancel it, wait (bounded by the runtime's cancel grace) for its terminal record, and
        return the last events (held-back text, then :class:`Finished` with the worker's usage).
        Raises APIError when the worker fails it meanwhile."""
        self._gen.cancel()
        try:
            await _drain(self._gen)
        except GenerationError as exc:
            raise api_error(exc) from None
        tail = with_divergence(self.placement, self._pipeline.finish(self._gen.done))
        self._acc.extend(tail)
        return tail

    def close(self) -> None:
        """End the request: cancel the generation if it still runs, report its stats and
        remember the turn for replay. Synchronous, idempotent, never raises."""
        if self._closed:
            return
        self._closed = True
        self._gen.cancel()
        self._core._report(self.request_id, self._timer, self._gen, self.placement)
        remember_turn(self._core.replay, self.placement, self.request, self._gen, self._acc)


class ServingCore:
    """Renders, constrains and generates API-neutral requests (module docstring)."""

    def __init__(self, *, settings: Settings, model_id: str, runtime: Runtime,
                 on_generation: Callable[[GenerationStats], None] = log_generation,
                 grammars: structured.GrammarCache | None = None) -> None:
        """``grammars``: the compiled-grammar cache (the server's, shared by its models; a
        core of its own by default)."""
        self.settings = settings
        self.model_id = model_id
        # The requested names this model answers; the server replaces it when it serves
        # several models or aliases (trioserve.registry).
        self.names = ModelNames.single(model_id, client_names=settings.client_model_names)
        self.runtime = runtime
        self.on_generation = on_generation  # called once per generation when its request ends
        self.raw = RawPrompts(runtime, on_generation)  # raw prompts and the tokenizer (raw.py)
        self.template: ChatTemplate | None = None
        self.profile: ServingProfile | None = None
        self.n_ctx = 0
        self.checkpoint_marks = False
        self.grammar_supported = False  # the worker enforces grammars (structured outputs)
        self.unique_keys_supported = False  # the worker keeps JSON keys unique (spec §5.6)
        self.bias_support = BiasSupport()  # the worker's engine and vocabulary (logit_bias)
        self.replay = ReplayStore()  # per worker session: assistant turns' generated token ids
        self.branches = SessionBranches(runtime, settings.session_branches)  # spec §12
        self.grammars = grammars if grammars is not None else structured.GrammarCache()
        # Tokens each user/assistant turn adds at least (turn_floor); None: not measured yet.
        self.turn_floor: int | None = None
        self._turn_floor_lock = trio.Lock()

    # -- worker readiness ----------------------------------------------------------------

    def configure(self, ready: Ready) -> None:
        """Pick the chat template and the model profile when a worker becomes ready
        (Supervisor's on_ready): core/model_setup.py's rules, once per model (a restarted
        worker serves the same model). Raises FatalStartupError as ``model_setup.set_up``
        does (no usable template, ...): the worker is refused."""
        self.n_ctx = ready.n_ctx
        # Per incarnation: a restarted worker could be another build.
        self.grammar_supported = ready.supports_grammar
        self.unique_keys_supported = ready.supports_unique_keys
        self.bias_support = self.raw.bias_support = BiasSupport.from_ready(ready)
        # A state that cannot be cut back is resumed from checkpoints: mark where prompts diverge.
        self.checkpoint_marks = ready.raw.get("checkpoint_kind") is not None
        if self.template is not None:
            return  # a restarted worker serves the same model
        chosen = model_setup.set_up(self.settings, ready)
        self.template = chosen.template
        self.profile = chosen.profile

    def capabilities(self) -> dict[str, Any] | None:
        """The model's capabilities for ``GET /v1/models`` (None until a worker was ready)."""
        return self.profile.capabilities() if self.profile is not None else None

    # -- the early bound -----------------------------------------------------------------

    async def refuse_early(self, found: Survey | None, *, param: str = "messages") -> None:
        """The refusals that come before any per-message work, from a body's
        :func:`~trioserve.core.turn_floor.survey`: :meth:`refuse_unfittable` for its turns
        (the more telling error where it applies), then 400 ``invalid_value`` naming ``param``
        for more than ``limits.MAX_CONVERSATION_ITEMS`` items, then 413 ``request_too_large``
        for more than ``limits.MAX_BODY_OBJECTS`` JSON objects, whatever the body's other
        fields. Nothing for None."""
        if found is None:
            return
        if found.turns is not None:
            await self.refuse_unfittable(found.turns, param=param)
        self.refuse_oversized(found, param=param)

    def refuse_oversized(self, found: Survey | None, *, param: str = "messages") -> None:
        """The size bounds of :meth:`refuse_early` alone (``limits.MAX_CONVERSATION_ITEMS``
        items, ``limits.MAX_BODY_OBJECTS`` objects): what every route that takes a
        conversation applies, token counts included (a count of 110k messages cost seconds of
        worker time), before any per-message work. Nothing for None."""
        if found is None:
            return
        if found.items > limits.MAX_CONVERSATION_ITEMS:
            raise errors.invalid_value(
                f"Invalid value for '{param}': at most {limits.MAX_CONVERSATION_ITEMS} items "
                f"(messages, input items and system blocks together), got {found.items}.", param)
        if found.objects > limits.MAX_BODY_OBJECTS:
            raise errors.APIError(
                413, errors.INVALID_REQUEST,
                f"The request body holds at least {found.objects} JSON objects (messages, content "
                f"parts, blocks, tools, schemas); at most {limits.MAX_BODY_OBJECTS} are accepted.",
                code="request_too_large")

    async def refuse_unfittable(self, turns: int, *, param: str = "messages") -> None:
        """Raise 400 ``context_length_exceeded`` ("at least N tokens") when ``turns`` user and
        assistant messages alone take the whole context under the loaded template: ``turns ×
        turn floor >= n_ctx`` (``trioserve.core.turn_floor``; the worker's condition for "no room to
        generate"). Does nothing for fewer than ``turn_floor.MIN_TURNS`` turns, while no worker
        was ready, or when the floor is 0 or could not be measured (the ordinary path decides).
        ``param``: the request's name for its conversation (the error's ``param``).

        The first call measures the floor (a few renders and tokenize calls answered between
        the worker's steps); concurrent callers wait for that one measurement.
        """
        if turns < MIN_TURNS or self.n_ctx <= 0 or self.template is None:
            return
        floor = await self._measured_turn_floor()
        if floor > 0 and turns * floor >= self.n_ctx:
            exc = errors.context_length_exceeded(turns * floor, self.n_ctx, at_least=True)
            raise errors.APIError(exc.status, exc.type, exc.message, code=exc.code, param=param)

    async def _measured_turn_floor(self) -> int:
        """The cached turn floor, measured on first use; 0 (not cached: measured again next
        time) when the worker could not tokenize the probes."""
        async with self._turn_floor_lock:
            if self.turn_floor is None:
                try:
                    self.turn_floor = await measure_turn_floor(self._probe_template_text,
                                                               self._special_tokens)
                except GenerationError as exc:
                    log.warning("could not measure the template's tokens per turn: %s", exc)
                    return 0
                log.info("the chat template adds at least %d tokens per user/assistant "
                         "message", self.turn_floor)
            return self.turn_floor

    def _probe_template_text(self, conversation: list[tuple[str, str]]) -> list[str] | None:
        """The template (special-parsed) text segments of ``conversation`` rendered like a
        request's prompt, or None when the template refuses it."""
        messages = tuple(Message(role=role, text=text)  # type: ignore[arg-type]
                         for role, text in conversation)
        try:
            params = self.generate_params(CoreRequest(messages=messages))
        except errors.APIError:
            return None
        return [seg.text for seg in params.prompt_segments or ()
                if isinstance(seg, TextSegment) and seg.special]

    async def _special_tokens(self, text: str) -> int:
        reply = await self.runtime.call(Tokenize(prompt_segments=(TextSegment(text, True),)))
        return len(reply.ids)  # type: ignore[union-attr]

    @contextlib.asynccontextmanager
    async def tokenizer_place(self, client: str) -> AsyncIterator[None]:
        """Hold a place in the tokenizer queue for ``client`` (the peer address) for the block
        (worker/tokenize_gate.py). Raises APIError ``503 server_busy`` at once when the queue or
        the client's share is full; cancellation while waiting frees the place."""
        try:
            async with self.runtime.tokenize_gate.admit(client):
                yield
        except GateFull as exc:
            raise api_error(tokenizer_busy(exc)) from None

    async def count_tokens(self, req: CoreRequest) -> int:
        """The exact token count of ``req``'s rendered prompt (the worker's tokenizer; the
        worker answers the count, not the ids). Rendering a huge conversation runs off the
        event loop, as for a generation. Raises APIError as :meth:`generate_params` does, or
        for a worker failure."""
        if (unmatched := unmatched_tool_result(req)) is not None:
            raise unmatched
        params = await prepare(partial(self.generate_params, req),
                               large=len(req.messages) > LARGE_MESSAGE_COUNT)
        try:
            reply = await self.runtime.call(Tokenize(prompt_segments=params.prompt_segments,
                                                     count_only=True))
        except GenerationError as exc:
            raise api_error(exc, req.params) from None
        assert isinstance(reply, Tokens)
        return reply.count

    # -- a request -----------------------------------------------------------------------

    async def start(self, req: CoreRequest, *, request_id: str,
                    arrival: Arrival | None = None, early_start: bool = False) -> Turn:
        """Admit ``req`` and wait for its first worker record; the :class:`Turn`.

        Raises APIError for every failure known before output (module docstring), with the
        parameter paths of the request's API (``CoreRequest.params``). ``arrival``
        (from ``SessionRuntime.arrival``) ends when the generation is submitted.

        ``early_start`` (streams, spec §7 "Bytes before the first token"): for a prompt of at
        least :data:`EARLY_START_CHARS` characters without an output constraint, the worker
        tokenizes the prompt first; when it fits the context the generation is submitted and
        the Turn returned at once (``admitted_early``), so the stream can start while the
        prompt is prefilled. A failure after that (the worker failing, a session busy)
        surfaces from :meth:`Turn.batches`. Constrained requests keep waiting for the first
        record: the worker's grammar check answers there, and it must stay a plain 400.
        """
        if (unmatched := unmatched_tool_result(req)) is not None:
            raise unmatched
        template, profile = self.template, self.profile
        # output format / forced tool choice → a grammar, or a 400 before anything runs.
        # Checked before availability (spec §4 step 5a): an unenforceable output format or
        # tool choice is the request's fault whether or not the worker is up. While the
        # model is loading its call format is unknown; every format accepts the same
        # requests, so Hermes stands in for the check.
        constraint = structured.constraint_for(
            req, tool_format=profile.tool_format if profile is not None else "hermes",
            cache=self.grammars)
        if template is None or profile is None:
            raise errors.worker_unavailable("the model worker is loading")
        structured.require_worker_support(constraint, self.grammar_supported)
        self.bias_support.check(req.sampling.logit_bias)
        large = len(req.messages) > LARGE_MESSAGE_COUNT
        messages = await prepare(req.template_messages, large=large)
        placement = await self.branches.place(req, messages, large=large)
        name = placement.name if req.session is not None else None  # its branch's worker session
        replays = self.replay.plan(name, messages) if name is not None else []
        params = await prepare(partial(self.generate_params, req, messages, replays), large=large)
        if name is not None:
            params = dataclasses.replace(params, session_id=name, retention=req.retention)
        if constraint is not None:
            # A template with a thinking switch may open a reasoning block before the
            # constrained answer, unless this request switched thinking off.
            may_think = profile.support.thinking_switch and profile.thinks(req.reasoning_effort, req.template_kwargs)
            params = self._constrained(params, constraint, may_think=may_think)
        early = (early_start and constraint is None and self.n_ctx > 0
                 and len(params.prompt) >= EARLY_START_CHARS)
        if early:
            await self._refuse_unfitting_prompt(params, req)
        timer = GenerationTimer()
        gen = submit(self.runtime, params, arrival=arrival, error=partial(api_error, params=req.params))
        # Arguments are streamed as written only where a grammar holds the output to valid
        # calls (spec §10 "Streamed arguments").
        stream_arguments = constraint is not None and req.tools_enabled
        if early:
            return Turn(self, req, request_id, gen, None, self._pipeline(req, params, stream_arguments),
                        timer, admitted_early=True, placement=placement)
        try:  # a failure or cancellation meanwhile cancels and reports it (core/admission.py)
            first = await first_record(gen, timer, partial(self._report, request_id, timer, gen, placement))
        except GenerationError as exc:
            # Grammar errors come before any token: a plain 400.
            raise (structured.worker_error(exc.code, exc.message, constraint)
                   or api_error(exc, req.params)) from None
        if constraint is not None:
            # The worker took the grammar: only now is it kept for reuse (a refused
            # request compiles and leaves nothing: test_refused_requests_leave_no_grammar).
            self.grammars.put(constraint)
        return Turn(self, req, request_id, gen, first,
                    self._pipeline(req, params, stream_arguments), timer, placement=placement)

    def _constrained(self, params: GenerateParams, constraint: structured.Constraint, *,
                     may_think: bool) -> GenerateParams:
        """``params`` with ``constraint``'s grammar, after the reasoning block a thinking
        template opens, and the worker's repeated-key check where the output is JSON."""
        state = structured.reasoning_state(self.reasoning_markers(), params.prompt, may_think=may_think)
        params = dataclasses.replace(params, grammar=structured.with_reasoning(
            constraint.grammar, self.reasoning_markers(), state))
        if constraint.json_keys and self.unique_keys_supported:
            # A grammar cannot remember keys: the worker refuses a repeated one.
            params = dataclasses.replace(params, unique_keys=structured.unique_keys_field(
                self.reasoning_markers(), state))
        return params

    def _pipeline(self, req: CoreRequest, params: GenerateParams,
                  stream_arguments: bool) -> OutputPipeline:
        return OutputPipeline(stops=params.stop, request_stops=req.stops, prompt=params.prompt,
                              reasoning_markers=self.reasoning_markers(),
                              tool_parser=self.tool_parser(req),
                              single_call=not req.parallel_tool_calls,
                              stream_arguments=stream_arguments)

    async def _refuse_unfitting_prompt(self, params: GenerateParams, req: CoreRequest) -> None:
        """400 ``context_length_exceeded`` when the worker's count of the prompt leaves no
        room to generate (the worker's own condition, spec §4 "Context clamp"); the count is
        a tokenize call answered between the worker's steps."""
        try:
            reply = await self.runtime.call(Tokenize(prompt_segments=params.prompt_segments))
        except GenerationError as exc:
            raise api_error(exc, req.params) from None
        n_prompt = len(reply.ids)  # type: ignore[union-attr]
        if n_prompt >= self.n_ctx:
            raise errors.context_length_exceeded(n_prompt, self.n_ctx, param=req.params.messages)

    def generate_params(self, req: CoreRequest, messages: list[dict[str, Any]] | None = None,
                        replays: list[tuple[int, ReplayTurn]] | None = None) -> GenerateParams:
        """Render the request through the profile and template into GenerateParams.

        ``messages``: ``req.template_messages()`` when the caller already has them.
        ``replays``: assistant turns (message index, remembered turn) whose rendered body is
        replaced by the ids the model generated for it (spec §12); a turn whose body cannot
        be located in the rendered prompt is rendered as text.

        Raises APIError 400: ``reasoning_effort`` on a template without a thinking switch,
        tools on a template that cannot render them with injection off (both
        ``unsupported_parameter``), or a template that refused the messages.
        """
        template, profile = self.template, self.profile
        if template is None or profile is None:
            raise errors.worker_unavailable("the model worker is loading")
        if messages is None:
            messages = req.template_messages()
        try:
            kwargs = profile.template_kwargs(req.reasoning_effort, req.template_kwargs)
        except UnreadTemplateVariable as exc:
            raise errors.unsupported_parameters(
                [(req.params.template_field(exc.param), str(exc))]) from None
        tools = req.template_tools()
        try:
            prepared, shown_tools = profile.prepare_messages(messages, tools)
        except ValueError as exc:
            raise errors.unsupported_parameters([(req.params.tools, str(exc))]) from None
        try:
            rendered = template.render_segments(prepared, tools=shown_tools,
                                                add_generation_prompt=True, template_kwargs=kwargs)
        except ControlTextError as exc:
            raise errors.control_text_error(
                str(exc), req.params.template_field(exc.param)) from None
        except TemplateError as exc:
            raise errors.template_error(str(exc), req.params.messages) from None
        if not rendered.separated:
            log.debug("the chat template reworks request text: that text stays in template "
                      "text (it holds no control token; render_segments checked)")
        segments = profile.apply_prefix_rule(rendered.segments)
        if req.answer_prefix:  # model output to continue from: its markers are control tokens
            segments = (*segments, (req.answer_prefix, True))
        prompt_segments: tuple[Segment, ...] = tuple(TextSegment(text, special)
                                                     for text, special in segments)
        shift = len("".join(t for t, _ in segments)) - len(rendered.text) - len(req.answer_prefix or "")
        if replays:
            cuts = replay_cuts(messages, tools, template, profile, kwargs, rendered.text, replays)
            if cuts:
                prompt_segments = splice_ids(segments, [(a + shift, b + shift, ids)
                                                        for a, b, ids in cuts])
        if self.checkpoint_marks:
            marks = find_marks(lambda msgs, gen: template.render(msgs, tools=shown_tools, add_generation_prompt=gen,
                                                                 template_kwargs=kwargs), prepared, rendered.text)
            prompt_segments = mark_segments(prompt_segments, marks, shift, len(req.answer_prefix or ""))
        return GenerateParams(
            prompt="".join(text for text, _ in segments),
            prompt_segments=prompt_segments,
            max_new_tokens=req.max_tokens if req.max_tokens is not None else -1,
            temperature=req.sampling.temperature, top_p=req.sampling.top_p,
            top_k=req.sampling.top_k, seed=req.sampling.seed, stop=profile.stops(req.stops),
            logit_bias=req.sampling.logit_bias)

    def tool_parser(self, req: CoreRequest) -> ToolCallParser | None:
        """A fresh parser of the profile's tool-call format for this request's declared
        tools, or None when the output is not parsed for calls (no tools, or
        ``tool_choice: "none"``)."""
        if not req.tools_enabled or self.profile is None:
            return None
        return parser_class(self.profile.tool_format)(tool_schemas(req.tool_dicts()))

    def reasoning_markers(self) -> tuple[str, str] | None:
        markers = self.profile.reasoning_markers if self.profile else None
        return (markers.start, markers.end) if markers else None

    # -- bookkeeping at the end of a request ---------------------------------------------------

    def _report(self, request_id: str, timer: GenerationTimer, gen: Generation,
                placement: Placement | None = None) -> None:
        """Hand the generation's stats on, with its session branch's events (``placement``)."""
        on_generation = self.on_generation
        if placement is not None:
            extra = stats_extra(placement)
            on_generation = lambda stats: self.on_generation(dataclasses.replace(stats, **extra))  # noqa: E731
        report_generation(on_generation, request_id, timer, gen)


async def _drain(gen: Generation) -> None:
    """Consume a cancelled generation up to its terminal record (bounded by the runtime's
    cancel grace), so its usage is known."""
    while await gen.receive() is not None:
        pass
