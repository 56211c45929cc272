"""The Anthropic Messages adapter: ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(spec/README.md §16), a thin layer over the serving core.

Request: ``api.messages.request.parse_messages_request`` validates the body and maps it to a
``CoreRequest`` (the session key from ``X-Claude-Code-Session-Id`` or the generic session
headers); the core renders, constrains, admits and runs it. This module writes the turn's
events as a ``message`` object or as Anthropic's SSE events (``api.messages.wire.StreamEncoder``).
``count_tokens`` renders the same prompt and has the worker tokenize it, so the count is the
prompt a ``/v1/messages`` request with that body would send.

Reasoning budget (``thinking: {"type": "enabled", "budget_tokens": B}``) on a model with
reasoning markers: while the answer is still inside its reasoning block and the worker has
sent B token records for it (checked after each batch of events, so it may overshoot by the
tokens of one batch), the generation is cut (cancelled, its usage read), and a second
generation continues from the rendered prompt plus the reasoning block closed by the model's
end marker, with what is left of ``max_tokens``. The client sees one message: the thinking
block, then the answer; its usage is the first generation's prompt and both generations'
output tokens.

Timing and cancellation contracts are the core's (``ServingCore.start`` returns after the
first worker record, so failures known before output are plain JSON errors; ``Turn.close``
runs on every path out, and a stream's ``cancel`` when the HTTP request ends, so a client
that disconnects frees its slot). A failure mid-stream is an ``error`` event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from functools import partial
from typing import Any

from trioserve.core.events import Accumulator, Event, Finished, ReasoningDelta, Usage
from trioserve.core.serving import ServingCore, Turn
from trioserve.core.offload import LARGE_BODY_BYTES, prepare
from trioserve.core.runtime import Arrival
from trioserve.core.turn_floor import survey
from trioserve.api.answers import Answer, JsonResponse, StreamResponse
from trioserve.api.ignored_fields import response_headers as ignored_fields_headers
from trioserve.api.streaming import sse_body
from trioserve.api.messages.request import MessagesRequest, parse_messages_request
from trioserve.api.messages.wire import StreamEncoder, message_object, new_message_id

__all__ = ["ServingMessages"]

log = logging.getLogger("trioserve.messages")


class _Exchange:
    """The turns of one request: one, or two when a reasoning budget cut the first.
    ``close`` (synchronous, idempotent) ends them all; the HTTP layer calls it at request end."""

    def __init__(self, first: Turn) -> None:
        self.turns = [first]

    def close(self) -> None:
        for turn in self.turns:
            turn.close()


# Messages fields that can change what the template renders (the thinking switch, the effort).
MESSAGES_TEMPLATE_FIELDS = ("thinking", "output_config")


class ServingMessages:
    """Anthropic Messages over a :class:`ServingCore`."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    async def _parse(self, body: bytes, headers: Mapping[str, str] | None, *,
                     count_only: bool) -> MessagesRequest:
        """The parsed request; a large body is parsed off the event loop (trioserve.core.offload)."""
        return await prepare(partial(self._parse_now, body, headers, count_only=count_only),
                             large=len(body) > LARGE_BODY_BYTES)

    def _parse_now(self, body: bytes, headers: Mapping[str, str] | None, *,
                   count_only: bool) -> MessagesRequest:
        profile = self.core.profile
        req = parse_messages_request(
            body, served_model=self.core.model_id,
            max_body_bytes=self.core.settings.max_body_bytes, headers=headers,
            count_only=count_only, names=self.core.names,
            reasoning_effort_supported=bool(profile and profile.honours_reasoning_effort),
            can_reason=bool(profile and (profile.honours_reasoning_effort
                                         or profile.reasoning_markers is not None)))
        if req.dropped_billing_line:
            log.debug("dropped the x-anthropic-billing-header system line (prefix reuse)")
        return req

    async def create(self, body: bytes, *, request_id: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     arrival: Arrival | None = None) -> Answer:
        """Serve one request (``api.answers.GeneratingAPI``): the ``message`` object, or a
        stream of SSE events, each with the response headers (``x-trioserve-ignored-fields``,
        spec §4.1). Raises APIError for every failure known before the first byte of the
        response. ``request_id`` (default: a new one) is the ``msg_…`` id."""
        message_id = request_id or new_message_id()
        if len(body) <= self.core.settings.max_body_bytes:
            # As for Chat Completions: a conversation whose turns alone cannot fit is refused
            # before any per-message work (trioserve.core.turn_floor).
            await self.core.refuse_early(await survey(
                body, served_model=self.core.model_id, template_fields=MESSAGES_TEMPLATE_FIELDS,
                serves=partial(self.core.names.serves, route="messages")))
        req = await self._parse(body, headers, count_only=False)
        exchange = _Exchange(await self.core.start(req.core, request_id=message_id, arrival=arrival,
                                                   early_start=req.stream))
        events = self._events(req, exchange, message_id)
        out_headers = ignored_fields_headers(req.ignored_fields, log, message_id)
        if req.stream:
            return StreamResponse(self._stream(events, exchange, message_id), exchange.close,
                                  out_headers)
        acc = Accumulator()
        try:
            async with contextlib.aclosing(events):
                async for batch in events:
                    acc.extend(batch)
        finally:
            exchange.close()
        return JsonResponse(message_object(message_id, self.core.model_id, acc.result), out_headers)

    async def _events(self, req: MessagesRequest, exchange: _Exchange,
                      message_id: str) -> AsyncGenerator[list[Event], None]:
        """The request's events: the first turn's, and when the reasoning budget cut it, the
        answer's from a second turn (module docstring), ending with one Finished."""
        turn = exchange.turns[0]
        budget = req.thinking_budget
        markers = self.core.reasoning_markers()
        if budget is None or markers is None:
            async with contextlib.aclosing(turn.batches()) as batches:
                async for events in batches:
                    yield events
            return
        reasoning: list[str] = []
        answering = False
        async with contextlib.aclosing(turn.batches()) as batches:
            async for events in batches:
                for event in events:
                    if isinstance(event, ReasoningDelta):
                        reasoning.append(event.text)
                    elif not isinstance(event, Finished):
                        answering = True
                yield events
                if isinstance(events[-1], Finished):
                    return
                if reasoning and not answering and turn.token_records >= budget:
                    break
        tail = await turn.cut()
        cut_finish = tail[-1]
        assert isinstance(cut_finish, Finished)
        rest = tail[:-1]
        reasoning += [e.text for e in rest if isinstance(e, ReasoningDelta)]
        if rest:
            yield rest
        used = cut_finish.usage.completion_tokens
        left = (req.core.max_tokens or 0) - used
        log.debug("reasoning budget %d reached after %d tokens; answering with %d left",
                  budget, used, left)
        if left <= 0:
            yield [Finished("length", cut_finish.usage)]
            return
        start, end = markers
        prefix = f"{start}\n{''.join(reasoning).strip()}\n{end}\n\n"
        answer = await self.core.start(
            dataclasses.replace(req.core, answer_prefix=prefix, max_tokens=left),
            request_id=message_id + "-answer")
        exchange.turns.append(answer)
        first = cut_finish.usage
        async with contextlib.aclosing(answer.batches()) as batches:
            async for events in batches:
                last = events[-1]
                if isinstance(last, Finished):
                    usage = Usage(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens,
                                  completion_tokens=used + last.usage.completion_tokens,
                                  divergence=first.divergence)
                    events = [*events[:-1], dataclasses.replace(last, usage=usage)]
                yield events

    def _stream(self, events: AsyncIterator[list[Event]], exchange: _Exchange,
                message_id: str) -> AsyncIterator[bytes]:
        """The SSE body (``api.streaming``); never ends without ``message_stop`` or an
        ``error`` event unless the client left."""
        return sse_body(events, StreamEncoder(message_id, self.core.model_id), request_id=message_id,
                        close=exchange.close, start_now=exchange.turns[0].admitted_early)

    async def count_tokens(self, body: bytes, *, headers: Mapping[str, str] | None = None,
                           client: str = "") -> dict[str, Any]:
        """``{"input_tokens": N}``: the rendered prompt's exact token count.

        ``client`` (the peer address) names whose share of the tokenizer queue the count
        takes (worker/tokenize_gate.py): a full queue or share is ``503 overloaded_error``
        before the body is parsed. Cancellation (the client left) frees its place and
        cancels the worker's tokenize.

        The body is held to the same size bounds as :meth:`create` (items and JSON objects,
        ``ServingCore.refuse_oversized``) before anything else; not to the early context bound:
        counting a conversation that no longer fits is what a client asks to learn."""
        if len(body) <= self.core.settings.max_body_bytes:
            self.core.refuse_oversized(await survey(
                body, served_model=self.core.model_id, template_fields=MESSAGES_TEMPLATE_FIELDS,
                serves=partial(self.core.names.serves, route="messages")))
        async with self.core.tokenizer_place(client):
            req = await self._parse(body, headers, count_only=True)
            return {"input_tokens": await self.core.count_tokens(req.core)}
