"""The one streaming skeleton every API adapter's SSE body runs (spec/README.md §7).

An adapter validates, converts and starts its turn; then :func:`sse_body` streams it: the
opening bytes, each batch of the turn's output encoded in the API's wire format, the closing
bytes, and on failure the API's error event. So the failure path is written once:

- an ``APIError`` from the turn (the worker failed the generation midway) becomes the API's
  error event, after whatever was encoded before it;
- any other exception (a bug, or e.g. a RecursionError on pathological model output) is
  logged with its traceback and becomes an ``internal_error`` event naming the request id;
- however the body ends (finished, failed, or the client gone and the generator closed),
  ``close`` ends the turn (synchronous, idempotent: it frees the worker slot).

Batches are written as they come: when the client reads slower than the model, the turn's
mailbox joins what arrived meanwhile into the next batch, so a slow client gets fewer,
larger chunks with the same concatenation.

It also holds the bytes of an OpenAI event (``data: <compact JSON>``, :func:`chunk_bytes`) and
the ``[DONE]`` terminator, which Chat Completions and the completions endpoint share.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar

from trioserve import errors

__all__ = ["DONE", "StreamEncoder", "chunk_bytes", "compact_json", "sse_body", "utf8"]

log = logging.getLogger("trioserve.serving")

T_contra = TypeVar("T_contra", contravariant=True)

# The terminator of an OpenAI event stream (Chat Completions, completions).
DONE = b"data: [DONE]\n\n"


class StreamEncoder(Protocol[T_contra]):
    """An API's wire format for one streamed answer."""

    def start(self) -> bytes:
        """The bytes that open the stream (may be empty)."""

    def encode(self, batch: T_contra) -> bytes:
        """The bytes of one batch of output (may be empty: nothing to send yet)."""

    def finish(self) -> bytes:
        """The bytes after the last batch, once the turn ended normally (may be empty)."""

    def fail(self, error: errors.APIError) -> bytes:
        """The API's error event (and terminator) after the stream started."""


async def sse_body(batches: AsyncIterator[T_contra], encoder: StreamEncoder[T_contra], *,
                   request_id: str, close: Callable[[], None], start_now: bool = False,
                   on_success: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The SSE body of one streamed answer (module docstring).

    ``start_now``: send the opening bytes at once (the prompt is still being prefilled);
    otherwise they go out with the first batch, in one write. ``on_success`` runs after the
    last batch of a turn that ended normally (e.g. to store the answer). Never ends without
    the closing bytes or the error event unless the client left; ``close`` runs on every
    way out, including when the consumer stops iterating (aclose).
    """
    out = encoder.start()
    if start_now and out:
        yield out
        out = b""
    try:
        try:
            async with contextlib.aclosing(batches):  # type: ignore[type-var]
                async for batch in batches:
                    out += encoder.encode(batch)
                    if out:
                        yield out
                        out = b""
            if on_success is not None:
                on_success()
            out += encoder.finish()
            if out:
                yield out
        except errors.APIError as exc:
            yield out + encoder.fail(exc)
        except Exception:
            log.exception("stream %s failed", request_id)
            close()
            yield out + encoder.fail(errors.internal_error(
                f"the response could not be completed (request id {request_id}; details in "
                "the server log)"))
    finally:
        close()


# --- the OpenAI framing: ``data: <compact JSON>\n\n``, UTF-8 ---------------------------------


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate becomes U+FFFD."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # Only lone surrogates get here (the worker sends valid UTF-8, so this is a bug
        # elsewhere); send U+FFFD rather than fail the stream or emit invalid UTF-8.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")


def compact_json(obj: Any) -> str:
    """``obj`` as compact JSON text, non-ASCII kept."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def chunk_bytes(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as compact JSON (non-ASCII kept, UTF-8 encoded)."""
    return b"data: " + utf8(compact_json(obj)) + b"\n\n"
