"""The one path every generation the serving core starts takes to its first record: submit it,
wait for its first worker record, and on a failure or a cancellation meanwhile cancel it and
report its stats, so nothing is left running and every generation is reported once.

Chat-template turns (``core/serving.py``) and raw prompts (``core/raw.py``) both use it; each
maps a runtime failure to its own API error (``error``), and each reports through its own
hook (``report``: synchronous, idempotent, never raises; ``GenerationTimer.report_once``).
"""

from __future__ import annotations

from collections.abc import Callable

from trioserve import errors
from trioserve.core.runtime import Arrival, Runtime
from trioserve.core.stats import GenerationStats, GenerationTimer
from trioserve.worker.protocol import GenerateParams
from trioserve.worker.runtime import Generation, GenerationError

__all__ = ["first_record", "report_generation", "submit"]


def submit(runtime: Runtime, params: GenerateParams, *, arrival: Arrival | None,
           error: Callable[[GenerationError], errors.APIError]) -> Generation:
    """Admit ``params`` on ``runtime``. Raises ``error(exc)`` (an APIError) when the runtime
    refuses it (``server_busy``, ``worker_unavailable``, an encoding error). Never blocks."""
    try:
        return runtime.submit(params, arrival=arrival)
    except GenerationError as exc:
        raise error(exc) from None


async def first_record(gen: Generation, timer: GenerationTimer, report: Callable[[], None]) -> str | None:
    """Wait for ``gen``'s first record: its first text, or None when it finished without any.

    On any failure or cancellation while waiting (a worker error, the client gone while the
    request was queued or prefilled) ``gen`` is cancelled and ``report`` runs, then the
    exception propagates as is: a GenerationError is the caller's to map (grammar errors,
    for one, have their own wording)."""
    try:
        first = await gen.receive()
    except BaseException:
        gen.cancel()
        report()
        raise
    timer.mark_first_output()
    return first


def report_generation(on_generation: Callable[[GenerationStats], None], request_id: str,
                      timer: GenerationTimer, gen: Generation) -> None:
    """Hand ``gen``'s stats to ``on_generation``, the first time only. Never raises."""
    timer.report_once(on_generation, request_id, gen.done,
                      cancel_requested=gen.cancel_requested, worker=gen.worker)
