"""What an API adapter answers a request with when it does not fail: a whole JSON body
(:class:`JsonResponse`) or an event stream (:class:`StreamResponse`), each with the response
headers the adapter adds (``x-trioserve-ignored-tools``, ``x-trioserve-ignored-fields``:
spec/README.md §20.4, §4.1); and :class:`GeneratingAPI`, what every generating route calls
(``http/route_support.py``). The HTTP layer writes them; nothing here does I/O.

Also OpenAI's ``usage`` object (:func:`openai_usage`), which Chat Completions and the legacy
completions endpoint both answer with.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from trioserve.core.events import Usage
from trioserve.core.runtime import Arrival

__all__ = ["Answer", "GeneratingAPI", "JsonResponse", "StreamResponse", "openai_usage"]


@dataclass(frozen=True)
class JsonResponse:
    """A whole response: the body object and the response ``headers``."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamResponse:
    """A streamed answer: the SSE ``body``, ``cancel`` (synchronous, idempotent), which the
    HTTP layer calls when the request ends, whether or not the body was iterated, so a client
    that disconnects at any point frees its generation, and the response ``headers``."""

    body: AsyncIterator[bytes]
    cancel: Callable[[], None]
    headers: dict[str, str] = field(default_factory=dict)


Answer = JsonResponse | StreamResponse


class GeneratingAPI(Protocol):
    """An API's generating endpoint (chat, Responses, Messages, completions)."""

    async def create(self, body: bytes, *, request_id: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     arrival: Arrival | None = None) -> Answer:
        """Serve one request body. Raises APIError for every failure known before the first
        byte of the response. ``request_id`` (default: a new one) is the response's id;
        ``headers`` (case-insensitive) supply the session key headers (spec §12); ``arrival``
        (from ``SessionRuntime.arrival``) ends when the generation is submitted."""
        ...


def openai_usage(usage: Usage) -> dict[str, Any]:
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
    if usage.divergence is not None:  # where the prompt stopped matching its session (§12)
        out["trioserve_divergence"] = dict(usage.divergence)
    return out
