"""What the serving core needs of the worker side: the runtime interface and its failures.

The core submits generations and calls single-reply operations (tokenize, detokenize) on a
:class:`Runtime`; one worker's ``SessionRuntime`` and the ``WorkerPool`` in front of several
both are one. Every :class:`~trioserve.worker.runtime.GenerationError` a runtime raises maps
to the HTTP contract's error through :func:`api_error` (spec/README.md §3).
"""

from __future__ import annotations

from typing import Any, Protocol

from trioserve import errors
from trioserve.core.request import ParamPaths
from trioserve.worker.protocol import GenerateParams, Record, Request
from trioserve.worker.runtime import Generation, GenerationError
from trioserve.worker.tokenize_gate import TokenizeGate

__all__ = ["Arrival", "Runtime", "api_error"]


class Arrival(Protocol):
    """A request the HTTP layer has begun to receive (``Runtime.arrival``): its mark lasts
    until the generation is submitted, so a burst's requests reach the worker together.
    ``done()`` is idempotent."""

    def done(self) -> None: ...


class Runtime(Protocol):
    """Admission of generations and single-reply operations on the worker(s)."""

    # Clients' tokenizer work (tokenize, detokenize, token counts) passes this gate first.
    tokenize_gate: TokenizeGate

    def submit(self, params: GenerateParams, *, arrival: Any = None) -> Generation:
        """Admit a generation; raises GenerationError (``server_busy``, ``worker_unavailable``,
        …) when it cannot be admitted. Never blocks."""
        ...

    async def call(self, request: Request, *, timeout: float | None = None) -> Record:
        """One request, one reply record (bounded by ``timeout``); raises GenerationError."""
        ...


_CHAT_PATHS = ParamPaths()


def api_error(exc: GenerationError, params: ParamPaths = _CHAT_PATHS) -> errors.APIError:
    """Map a runtime/worker failure to the HTTP contract's error; ``params``: the request's
    API's names for the fields it may point at (``messages``, ``stop``). Adapters of other APIs
    re-shape the envelope, not the parameter path."""
    retry_after = 1
    if exc.code in ("server_busy", "capacity_exhausted", "session_busy"):
        return errors.server_busy(retry_after)
    if exc.code in ("worker_unavailable", "cancelled"):
        return errors.worker_unavailable(exc.message, retry_after)
    if exc.code == "context_length_exceeded":
        return errors.context_length_exceeded(int(exc.details.get("prompt_tokens", 0)),
                                              int(exc.details.get("n_ctx", 0)),
                                              at_least=bool(exc.details.get("lower_bound")),
                                              param=params.messages)
    if exc.code in ("empty_prompt", "invalid_token_id", "invalid_request"):
        return errors.invalid_value(exc.message, params.messages)
    # The request could not be encoded for the worker (worker/protocol.py RequestRejected).
    if exc.code == "invalid_unicode":
        field = exc.details.get("field") or ""
        return errors.invalid_value(exc.message, params.stop if field.startswith("stop")
                                    else params.messages)
    if exc.code == "line_too_long":
        return errors.APIError(413, errors.INVALID_REQUEST, f"The rendered prompt is too large: "
                               f"{exc.message}. Send a shorter conversation.", code="request_too_large")
    if exc.code == "result_too_large":  # a tokenizer reply longer than one worker record
        return errors.APIError(413, errors.INVALID_REQUEST, "The result is too large to return "
                               f"({exc.message}). Send less text.", code="request_too_large")
    return errors.internal_error(f"the model worker failed ({exc.code}): {exc.message}")
