"""Per-generation statistics: what one generation cost, measured where it is served.

Owns the measurements (``GenerationTimer``), the record (``GenerationStats``) and its log
line on the ``trioserve.core.stats`` logger. It does not own where they go next: the serving
layer hands each record to a callback that the app wires to this log line and to the
Prometheus metrics. No HTTP or process knowledge, so the adapter may import it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from trioserve.worker.protocol import Done

log = logging.getLogger("trioserve.core.stats")


@dataclass(frozen=True)
class GenerationStats:
    """One generation, from admission to its end.

    ``finish_reason`` is the worker's (``stop``/``length``), or ``cancelled`` when the
    request ended before the worker's terminal record (client gone, stop string cut), or
    ``error`` when the generation failed. Token counts are None when no terminal record
    arrived. ``ttft_ms`` runs from admission (queue wait included) to the first output;
    ``decode_tps`` is completion tokens after the first over the time after the first.
    ``worker`` is the index of the pool worker that served it (0 with one worker), so the
    metrics can keep each worker's KV-cache state apart.
    """

    request_id: str
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    decode_tps: float | None
    finish_reason: str
    cancelled: bool
    # From the worker's done record, for the metrics routers read (metrics.py); None/False
    # when it did not say or no done record arrived.
    restored_tokens: int | None = None
    spilled_session: bool = False
    resident_tokens: int | None = None
    # Self-speculative decoding (spec §4.6): None when the generation was not drafted.
    drafted_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    worker: int = 0
    # Session branches (spec §12): a branch opened beyond its key's first, branches evicted
    # for it, and the divergence report's ``change`` when the prompt stopped matching.
    branch_opened: bool = False
    branch_evictions: int = 0
    divergence: str | None = None

    def log_line(self) -> str:
        def show(value: Any) -> str:
            if value is None:
                return "-"
            if isinstance(value, bool):
                return "true" if value else "false"
            if isinstance(value, float):
                return f"{value:.1f}"
            return str(value)

        return (f"id={self.request_id} prompt={show(self.prompt_tokens)} "
                f"cached={show(self.cached_tokens)} completion={show(self.completion_tokens)} "
                f"ttft_ms={show(self.ttft_ms)} decode_tps={show(self.decode_tps)} "
                f"finish={self.finish_reason} cancelled={show(self.cancelled)}"
                + (f" divergence={self.divergence}" if self.divergence else ""))


def log_generation(stats: GenerationStats) -> None:
    """Write ``stats`` as one INFO line on ``trioserve.core.stats``."""
    log.info("%s", stats.log_line())


@dataclass
class GenerationTimer:
    """Clock readings of one generation (``time.perf_counter``, seconds)."""

    admitted: float = field(default_factory=time.perf_counter)
    first_output: float | None = None
    reported: bool = False  # set by report_once

    def mark_first_output(self) -> None:
        if self.first_output is None:
            self.first_output = time.perf_counter()

    def report_once(self, on_generation: Callable[[GenerationStats], None], request_id: str,
                    done: Done | None, *, cancel_requested: bool, worker: int = 0) -> None:
        """Hand the stats to ``on_generation`` the first time only (a stream's end hook and
        its ``finally`` may both call it). Never raises: callers run it in ``finally``
        blocks, where an exception would replace the one being handled."""
        if self.reported:
            return
        self.reported = True
        try:
            on_generation(self.finish(request_id, done, cancel_requested=cancel_requested,
                                      worker=worker))
        except Exception:
            log.exception("could not report generation stats")

    def finish(self, request_id: str, done: Done | None, *, cancel_requested: bool,
               worker: int = 0) -> GenerationStats:
        """The stats once the request is over; ``done`` is the worker's terminal ``done``
        record (None when none arrived); ``worker`` the pool index that served it."""
        now = time.perf_counter()
        ttft = None if self.first_output is None else (self.first_output - self.admitted) * 1000
        prompt = cached = completion = None
        decode_tps = None
        if done is not None:
            prompt = done.prompt_tokens
            cached = done.reused_prompt_tokens
            completion = done.completion_tokens
            elapsed = now - self.first_output if self.first_output is not None else 0.0
            if completion > 1 and elapsed > 0:
                decode_tps = (completion - 1) / elapsed
            cancelled = done.cancelled
            finish = "cancelled" if cancelled else (done.finish_reason or "stop")
        else:
            cancelled = cancel_requested
            finish = "cancelled" if cancelled else "error"
        return GenerationStats(request_id=request_id, prompt_tokens=prompt, cached_tokens=cached,
                               completion_tokens=completion, ttft_ms=ttft, decode_tps=decode_tps,
                               finish_reason=finish, cancelled=cancelled,
                               restored_tokens=done.restored_prompt_tokens if done else None,
                               spilled_session=done.spilled_session if done else False,
                               resident_tokens=done.resident_tokens if done else None,
                               drafted_tokens=done.drafted_tokens if done else None,
                               accepted_draft_tokens=done.accepted_draft_tokens if done else None,
                               worker=worker)
