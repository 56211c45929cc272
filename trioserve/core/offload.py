"""A large request's CPU-bound preparation runs off the event loop.

Parsing, validating and rendering a request is pure Python, linear in its size — and it
runs on the one Trio thread that also forwards every other client's stream. 110,000 empty
chat messages took about 20 s of it: every stream stood still meanwhile. ``prepare`` runs
such work in a worker thread (``trio.to_thread.run_sync``: the caller waits for it, nothing
outlives it) while small requests, nearly all of them, stay inline. One large request is
prepared at a time (``_large_requests``), so many of them cannot crowd the event loop out
of the interpreter lock; the others wait their turn without holding anyone else up.

Cancellation: a prepare already running in a thread finishes (bounded: linear work); the
caller then sees the cancellation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

__all__ = ["LARGE_BODY_BYTES", "LARGE_MESSAGE_COUNT", "prepare"]

T = TypeVar("T")

# Above these sizes preparation moves to a thread: a request body of this size takes some
# milliseconds to parse and render (a decode step's order of magnitude).
LARGE_BODY_BYTES = 256 * 1024
LARGE_MESSAGE_COUNT = 1000

_large_requests = trio.CapacityLimiter(1)


async def prepare(work: Callable[[], T], *, large: bool) -> T:
    """``work()`` — inline when not ``large``, else in a worker thread, one at a time.
    Exceptions propagate to the caller either way."""
    if not large:
        return work()
    return await trio.to_thread.run_sync(work, limiter=_large_requests)
