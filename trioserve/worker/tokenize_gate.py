"""Admission of clients' tokenizer work: a bounded, shared queue in front of the worker's call
thread (spec §14.1, §19.2, §18.1 ``count_tokens``).

``/tokenize``, ``/detokenize`` and ``/v1/messages/count_tokens`` run the worker's tokenizer on
text of up to the body limit: a conversation of 110,000 empty messages renders to megabytes,
seconds of tokenizer time. The worker answers them on a thread of its own (its call thread,
``cpp/call_worker.h``), so they never hold the step loop or a ping; this gate bounds how much
such work is outstanding and who holds it, like the generation queue does for generations:

* at most ``in_flight`` calls are at the worker at once (one runs, the next is ready behind
  it), so a call's deadline covers its own work and at most ``in_flight - 1`` others;
* at most ``waiting`` more wait here, in arrival order; one more is refused at once with
  ``server_busy`` (retryable: ``503`` + ``Retry-After``), before any work;
* one client (the peer address) holds at most ``per_client`` of those places, by default half
  of them, so one client cannot queue all of it and others still get through.

Cancellation: a caller cancelled while waiting leaves at once and frees its place; one
cancelled while its call is at the worker abandons the call (the runtime then sends the
worker a cancel frame for it, so no abandoned work keeps running).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator

import trio

from trioserve.worker.generation import GenerationError

__all__ = ["GateFull", "TokenizeGate", "tokenizer_busy"]


class GateFull(Exception):
    """Refused at once: the gate's places, or the client's share of them, are taken."""


def tokenizer_busy(exc: GateFull) -> GenerationError:
    """The runtime error a refusal maps to: ``server_busy``, retryable (``503`` with
    ``Retry-After``, like a full generation queue: spec §14.1)."""
    return GenerationError("server_busy", f"the tokenizer queue is full: {exc}", retryable=True)


class TokenizeGate:
    """Bounded FIFO admission with a per-client share (module docstring)."""

    def __init__(self, *, in_flight: int = 2, waiting: int = 16, per_client: int | None = None) -> None:
        if in_flight < 1 or waiting < 0:
            raise ValueError("in_flight must be >= 1 and waiting >= 0")
        self.in_flight = in_flight
        self.waiting = waiting
        self.places = in_flight + waiting
        self.per_client = max(1, self.places // 2) if per_client is None else max(1, per_client)
        self._running = trio.Semaphore(in_flight)  # FIFO: trio wakes waiters in order
        self._held = 0
        self._by_client: collections.Counter[str] = collections.Counter()

    @property
    def held(self) -> int:
        """Calls admitted and not finished (running or waiting)."""
        return self._held

    def held_by(self, client: str) -> int:
        return self._by_client[client]

    @contextlib.asynccontextmanager
    async def admit(self, client: str) -> AsyncIterator[None]:
        """Hold a place for one call of ``client`` while the block runs; the block starts once
        fewer than ``in_flight`` calls are at the worker.

        Raises GateFull at once (nothing held) when every place is taken or ``client``
        already holds ``per_client``. Cancellation while waiting releases the place.
        """
        if self._held >= self.places:
            raise GateFull(f"{self._held} tokenizer calls are already running or waiting")
        if self._by_client[client] >= self.per_client:
            raise GateFull(f"this client already has {self._by_client[client]} tokenizer calls "
                           "running or waiting")
        self._held += 1
        self._by_client[client] += 1
        try:
            async with self._running:
                yield
        finally:
            self._held -= 1
            self._by_client[client] -= 1
            if self._by_client[client] <= 0:
                del self._by_client[client]
