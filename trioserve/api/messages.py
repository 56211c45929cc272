"""The Anthropic Messages adapter: ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(spec/README.md §16), a thin layer over the serving core.

Request: ``messages_wire.parse_messages_request`` validates the body and maps it to a
``CoreRequest`` (the session key from ``X-Claude-Code-Session-Id`` or the generic session
headers); the core renders, constrains, admits and runs it. This module writes the turn's
events as a ``message`` object or as Anthropic's SSE events (``messages_wire.StreamEncoder``).
``count_tokens`` renders the same prompt and has the worker tokenize it, so the count is the
prompt a ``/v1/messages`` request with that body would send.

Timing and cancellation contracts are the core's (``ServingCore.start`` returns after the
first worker record, so failures known before output are plain JSON errors; ``Turn.close``
runs on every path out, and a stream's ``cancel`` when the HTTP request ends, so a client
that disconnects frees its slot). A failure mid-stream is an ``error`` event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from .. import errors
from ..core.events import Finished
from ..core.serving import ServingCore, Turn, api_error
from ..runtime import Arrival, GenerationError
from ..worker_protocol import Tokenize, Tokens
from .completions import TextStream
from .messages_wire import (
    MessagesRequest,
    StreamEncoder,
    message_object,
    new_message_id,
    parse_messages_request,
)

__all__ = ["ServingMessages"]

log = logging.getLogger("trioserve.messages")


class ServingMessages:
    """Anthropic Messages over a :class:`ServingCore`."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    def _parse(self, body: bytes, headers: Mapping[str, str] | None, *,
               count_only: bool) -> MessagesRequest:
        profile = self.core.profile
        req = parse_messages_request(
            body, served_model=self.core.model_id,
            max_body_bytes=self.core.settings.max_body_bytes, headers=headers,
            count_only=count_only,
            reasoning_effort_supported=bool(profile and profile.honours_reasoning_effort),
            can_reason=bool(profile and (profile.honours_reasoning_effort
                                         or profile.reasoning_markers is not None)))
        if req.dropped_billing_line:
            log.debug("dropped the x-anthropic-billing-header system line (prefix reuse)")
        return req

    async def create(self, body: bytes, *, message_id: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     arrival: Arrival | None = None) -> dict[str, Any] | TextStream:
        """Serve one request: a ``message`` dict, or a TextStream of SSE events. Raises
        APIError for every failure known before the first byte of the response."""
        message_id = message_id or new_message_id()
        req = self._parse(body, headers, count_only=False)
        turn = await self.core.start(req.core, request_id=message_id, arrival=arrival)
        if req.stream:
            return TextStream(self._stream(turn, message_id), turn.close)
        try:
            result = await turn.collect()
        finally:
            turn.close()
        return message_object(message_id, self.core.model_id, result)

    async def _stream(self, turn: Turn, message_id: str) -> AsyncIterator[bytes]:
        """The SSE body; never ends without ``message_stop`` or an ``error`` event unless the
        client left."""
        encoder = StreamEncoder(message_id, self.core.model_id)
        out = encoder.start()
        try:
            try:
                async for events in turn.batches():
                    out += encoder.encode(events)
                    if out:
                        yield out
                        out = b""
                    if isinstance(events[-1], Finished):
                        break
            except errors.APIError as exc:
                yield out + encoder.error(exc)
            except Exception:
                log.exception("stream %s failed", message_id)
                turn.close()
                yield out + encoder.error(errors.internal_error(
                    f"the response could not be completed (request id {message_id}; details "
                    "in the server log)"))
        finally:
            turn.close()

    async def count_tokens(self, body: bytes, *, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``{"input_tokens": N}``: the rendered prompt's exact token count."""
        req = self._parse(body, headers, count_only=True)
        params = self.core.generate_params(req.core)
        try:
            reply = await self.core.runtime.call(Tokenize(prompt_segments=params.prompt_segments))
        except GenerationError as exc:
            raise api_error(exc) from None
        assert isinstance(reply, Tokens)
        return {"input_tokens": len(reply.ids)}
