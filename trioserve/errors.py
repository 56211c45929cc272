"""OpenAI-style API errors: one exception type, one constructor per row of the error table.

Owns the mapping from "what went wrong" to HTTP status, OpenAI error ``type``, ``code`` and
``param`` (spec/README.md §3). It does not own the HTTP response itself: the app
turns an :class:`APIError` into a JSON response with ``status``, ``headers`` and ``envelope()``.
No web-framework imports, so every layer may raise these.

Error table (status, type, code)::

    APIError
    ├── invalid_json                 400 invalid_request_error  invalid_json
    ├── invalid_value                400 invalid_request_error  invalid_value
    ├── missing_required_parameter   400 invalid_request_error  missing_required_parameter
    ├── unsupported_parameters       400 invalid_request_error  unsupported_parameter
    ├── template_error               400 invalid_request_error  invalid_value        (param messages)
    ├── context_length_exceeded      400 invalid_request_error  context_length_exceeded
    ├── model_not_found              404 invalid_request_error  model_not_found
    ├── not_found                    404 invalid_request_error  not_found
    ├── doubled_v1                   404 invalid_request_error  not_found            (a path with /v1/v1)
    ├── session_not_found            404 invalid_request_error  session_not_found    (param session)
    ├── method_not_allowed           405 invalid_request_error  method_not_allowed
    ├── session_busy                 409 invalid_request_error  session_busy         (param session)
    ├── model_busy                   409 invalid_request_error  model_busy           (param model)
    ├── model_pinned                 409 invalid_request_error  model_pinned         (param model)
    ├── request_too_large            413 invalid_request_error  request_too_large
    ├── internal_error               500 server_error           internal_error
    ├── model_cannot_load            500 server_error           model_load_failed    + x-should-retry: false
    ├── server_busy                  503 server_error           server_busy          + Retry-After
    ├── worker_unavailable           503 server_error           worker_unavailable   + Retry-After
    ├── model_loading                503 server_error           model_loading        + Retry-After
    ├── model_load_failed            503 server_error           model_load_failed    + Retry-After (timeout)
    ├── model_memory_busy            503 server_error           model_memory_busy    + Retry-After
    └── model_too_large              507 server_error           model_too_large      (param model)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "APIError",
    "invalid_json",
    "invalid_value",
    "missing_required_parameter",
    "unsupported_parameters",
    "template_error",
    "control_text_error",
    "context_length_exceeded",
    "model_not_found",
    "not_found",
    "doubled_v1",
    "session_not_found",
    "session_busy",
    "method_not_allowed",
    "request_too_large",
    "internal_error",
    "server_busy",
    "worker_unavailable",
    "model_busy",
    "model_pinned",
    "model_loading",
    "model_load_failed",
    "model_cannot_load",
    "model_memory_busy",
    "model_too_large",
]

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error that becomes an HTTP response with the OpenAI error envelope.

    Attributes:
        status: HTTP status code.
        type: OpenAI error type (``invalid_request_error`` or ``server_error``).
        code: machine-readable code from the spec's table, or None.
        param: the offending request parameter as a path (``messages[1].content``), or None.
        message: human-readable text; says what was wrong and what to send instead.
        headers: extra response headers (``Retry-After`` on 503s).
    """

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.message = message
        self.headers: dict[str, str] = dict(headers or {})

    def envelope(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}`` (all four keys always present)."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"APIError({self.status}, code={self.code!r}, param={self.param!r}, message={self.message!r})"


def invalid_json(detail: str) -> APIError:
    """400 ``invalid_json``: the body is not JSON, or not a JSON object."""
    return APIError(400, INVALID_REQUEST, f"Invalid JSON body: {detail}", code="invalid_json")


def invalid_value(message: str, param: str | None) -> APIError:
    """400 ``invalid_value``: a parameter is present but has the wrong type or a bad value."""
    return APIError(400, INVALID_REQUEST, message, code="invalid_value", param=param)


def missing_required_parameter(param: str) -> APIError:
    """400 ``missing_required_parameter``: a required parameter is absent (or null)."""
    return APIError(
        400,
        INVALID_REQUEST,
        f"Missing required parameter: '{param}'.",
        code="missing_required_parameter",
        param=param,
    )


def unsupported_parameters(
    offenders: Sequence[tuple[str, str]], supported: Sequence[str] = ()
) -> APIError:
    """400 ``unsupported_parameter`` naming every offender at once.

    Args:
        offenders: ``(param, reason)`` pairs in request order; must not be empty. ``param`` of
            the first becomes the envelope's ``param``.
        supported: the parameters trioserve honours, listed in the message so the client knows
            what it may send instead.
    """
    if not offenders:
        raise ValueError("unsupported_parameters needs at least one offender")
    listed = "; ".join(f"'{param}' ({reason})" for param, reason in offenders)
    noun = "parameter" if len(offenders) == 1 else "parameters"
    message = f"Unsupported {noun}: {listed}."
    if supported:
        message += " Supported parameters: " + ", ".join(supported) + "."
    return APIError(
        400, INVALID_REQUEST, message, code="unsupported_parameter", param=offenders[0][0]
    )


def control_text_error(message: str, param: str) -> APIError:
    """400 ``invalid_value`` for request text that would reach the model as control tokens
    (spec §5.5): the chat template cannot keep it apart from its own text, so the request is
    refused rather than rendered open."""
    return APIError(400, INVALID_REQUEST, message, code="invalid_value", param=param)


def template_error(message: str, param: str = "messages") -> APIError:
    """400 ``invalid_value`` for a chat template that refused the messages.

    Templates call ``raise_exception`` on message sequences they cannot render (for example
    two user turns in a row), so the fault is the request's, not the server's.
    """
    return APIError(
        400,
        INVALID_REQUEST,
        f"The model's chat template rejected the request: {message}",
        code="invalid_value",
        param=param,
    )


def context_length_exceeded(
    prompt_tokens: int, n_ctx: int, max_tokens: int | None = None, *, at_least: bool = False,
    param: str = "messages",
) -> APIError:
    """400 ``context_length_exceeded`` (``param``: where the API keeps the conversation), from
    an exact token count.

    Args:
        prompt_tokens: tokens in the rendered prompt.
        n_ctx: the model's context window.
        max_tokens: the completion budget the client asked for, when that (not the prompt
            alone) is what does not fit.
        at_least: ``prompt_tokens`` is a lower bound (the worker refused a prompt from its
            size before tokenizing it), not an exact count.
    """
    amount = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {n_ctx} tokens, but the messages "
            f"take {amount} tokens. Shorten the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {n_ctx} tokens, but you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Shorten the messages or reduce max_tokens."
        )
    return APIError(
        400, INVALID_REQUEST, message, code="context_length_exceeded", param=param
    )


def model_not_found(model: str, served_model: str | Sequence[str] | None = None) -> APIError:
    """404 ``model_not_found`` (param ``model``); the message names what is served."""
    message = f"The model '{model}' does not exist."
    if isinstance(served_model, str):
        message += f" This server serves '{served_model}'."
    elif served_model:
        message += " This server serves " + ", ".join(f"'{m}'" for m in served_model) + "."
    return APIError(404, INVALID_REQUEST, message, code="model_not_found", param="model")


def not_found(path: str | None = None) -> APIError:
    """404 ``not_found`` for an unknown route."""
    what = f"'{path}'" if path else "the requested URL"
    return APIError(404, INVALID_REQUEST, f"Not found: {what} is not a route of this server.", code="not_found")


def doubled_v1(path: str, route: str) -> APIError:
    """404 ``not_found`` for ``path``, which is the route ``route`` with one ``/v1`` too many:
    the client's base URL ends in ``/v1`` and the client adds ``/v1`` itself (Claude Code with
    ``ANTHROPIC_BASE_URL=http://host:8000/v1`` asks for ``/v1/v1/messages``). The message says
    so and names the route, so the mistake is found from the client's error alone."""
    return APIError(404, INVALID_REQUEST,
                    f"Not found: '{path[:200]}' has one '/v1' too many; the route is "
                    f"'{route[:200]}'. Remove one '/v1' from the client's base URL: Anthropic "
                    "clients (Claude Code's ANTHROPIC_BASE_URL) take the server's address without "
                    "'/v1' (e.g. http://127.0.0.1:8000), OpenAI clients take it with one "
                    "(http://127.0.0.1:8000/v1).", code="not_found")


def method_not_allowed(method: str | None = None, allowed: Sequence[str] = ()) -> APIError:
    """405 ``method_not_allowed``; sets the ``Allow`` header when ``allowed`` is given."""
    message = f"Method {method} is not allowed here." if method else "Method not allowed."
    headers = {"Allow": ", ".join(allowed)} if allowed else None
    return APIError(405, INVALID_REQUEST, message, code="method_not_allowed", headers=headers)


def request_too_large(limit: int) -> APIError:
    """413 ``request_too_large``: the body exceeds ``limit`` bytes."""
    return APIError(
        413,
        INVALID_REQUEST,
        f"Request body too large: the limit is {limit} bytes (TRIOSERVE_MAX_BODY_BYTES).",
        code="request_too_large",
    )


def request_timeout(received: int, seconds: float) -> APIError:
    """408 ``request_timeout``: the request body arrived slower than the minimum rate
    (``received`` bytes in ``seconds``); the connection is closed (its unread body would
    otherwise be taken for the next request)."""
    return APIError(408, INVALID_REQUEST,
                    f"The request body arrived too slowly: {received} bytes in {seconds:.1f} s.",
                    code="request_timeout", headers={"Connection": "close"})


def internal_error(message: str) -> APIError:
    """500 ``internal_error``: a bug or an unexpected failure on our side."""
    return APIError(500, SERVER_ERROR, f"Internal server error: {message}", code="internal_error")


def _retry_after(seconds: int) -> dict[str, str]:
    # An integer number of seconds (RFC 9110 §10.2.3), at least 1 (spec §3): "0" invites a
    # client to retry in a tight loop.
    return {"Retry-After": str(max(1, int(seconds)))}


def server_busy(retry_after: int = 1) -> APIError:
    """503 ``server_busy``: the admission queue is full; ``Retry-After`` in seconds."""
    return APIError(
        503,
        SERVER_ERROR,
        "The server is busy: the request queue is full. Retry later.",
        code="server_busy",
        headers=_retry_after(retry_after),
    )


def worker_unavailable(reason: str, retry_after: int = 1) -> APIError:
    """503 ``worker_unavailable``: the model worker is loading, crashed or restarting."""
    return APIError(
        503,
        SERVER_ERROR,
        f"The model worker is unavailable ({reason}). Retry later.",
        code="worker_unavailable",
        headers=_retry_after(retry_after),
    )


def session_not_found(key: str) -> APIError:
    """404 ``session_not_found``: ``DELETE /v1/sessions/{key}`` for a session the worker does
    not hold (never used, already deleted, evicted without a spilled copy, or lost in a worker
    restart)."""
    return APIError(404, INVALID_REQUEST, f"No session {key!r} is held by this server.",
                    code="session_not_found", param="session")


def session_busy(key: str) -> APIError:
    """409 ``session_busy``: the session has a generation running or queued; delete it after
    that generation ends."""
    return APIError(409, INVALID_REQUEST, f"Session {key!r} has a generation running or queued; "
                    "retry once it has finished.", code="session_busy", param="session")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB ({n} bytes)"


def model_too_large(model: str, cost_bytes: int, budget_bytes: int, *,
                    pinned_bytes: int = 0) -> APIError:
    """507 ``model_too_large`` (param ``model``): the model needs more memory than the memory
    budget holds, alone or beside the pinned models (which are never unloaded). Not retryable
    with this server's settings, so no ``Retry-After``."""
    message = (f"Model '{model}' needs about {_mib(cost_bytes)} of memory, more than the "
               f"server's memory budget of {_mib(budget_bytes)}")
    if cost_bytes <= budget_bytes:
        message += f" beside the pinned models' {_mib(pinned_bytes)}"
    message += (". Raise --memory-budget-bytes, lower the model's context or slots, or use a "
                "smaller quantization.")
    return APIError(507, SERVER_ERROR, message, code="model_too_large", param="model")


def model_loading(model: str, waited_s: float, retry_after: int = 5) -> APIError:
    """503 ``model_loading``: the request waited ``waited_s`` seconds (``--model-load-timeout``)
    for the model to load and it has not finished; the load goes on."""
    return APIError(503, SERVER_ERROR, f"Model '{model}' is still loading after {waited_s:g} s. "
                    "Retry later.", code="model_loading", headers=_retry_after(retry_after))


def model_load_failed(model: str, reason: str, retry_after: int = 1) -> APIError:
    """503 ``model_load_failed``: the load this request waited for did not finish in time
    (``--model-load-timeout``); the next request for the model starts a new one. (A load whose
    workers did not start is :func:`model_cannot_load`.)"""
    return APIError(503, SERVER_ERROR, f"Model '{model}' failed to load: {reason}. The next "
                    "request loads it again.", code="model_load_failed",
                    headers=_retry_after(retry_after))


def model_cannot_load(model: str, reason: str, retry_in_s: float) -> APIError:
    """500 ``model_load_failed``: the model's workers did not start, for ``reason`` (the text
    the log has). Its loads are backed off (worker/lifecycle.py): none is tried again for
    ``retry_in_s`` seconds unless its files change, so the answer says not to retry: 500 with
    ``x-should-retry: false``, which the OpenAI and Anthropic SDKs obey (no Retry-After)."""
    return APIError(500, SERVER_ERROR, f"Model '{model}' cannot be loaded: {reason}. It is not "
                    f"loaded again before its files change or {retry_in_s:.0f} s passed.",
                    code="model_load_failed", headers={"x-should-retry": "false"})


def model_load_failed_no_room(model: str, last_error: str, holders: Sequence[str],
                              retry_after: int = 5) -> APIError:
    """503 ``model_load_failed``: the model's last load failed, and it is loaded again only
    into free memory: a model that may not load never unloads a working one for it."""
    names = ", ".join(f"'{name}'" for name in holders) or "other models"
    return APIError(503, SERVER_ERROR, f"Model '{model}' failed its last load ({last_error}). It "
                    "is loaded again only into free memory, never in place of a working model, "
                    f"and the memory budget is held by {names}: unload one (POST "
                    "/v1/models/<id>/unload) or retry once they were unloaded.",
                    code="model_load_failed", headers=_retry_after(retry_after))


def model_memory_busy(model: str, in_use: Sequence[str], waited_s: float,
                      retry_after: int = 5) -> APIError:
    """503 ``model_memory_busy``: loading the model needs memory the loaded models hold, and
    none of them became idle (no request in flight) within ``waited_s`` seconds."""
    names = ", ".join(f"'{name}'" for name in in_use) or "other models"
    return APIError(503, SERVER_ERROR, f"Model '{model}' cannot be loaded yet: the memory budget "
                    f"is held by {names}, with requests in flight, for the last {waited_s:g} s. "
                    "Retry later.", code="model_memory_busy", headers=_retry_after(retry_after))


def model_busy(model: str, leases: int, waiting: int) -> APIError:
    """409 ``model_busy``: an unload of a model with requests in flight or waiting for it
    (they are never cut); retry once they finished."""
    return APIError(409, INVALID_REQUEST, f"Model '{model}' has {leases} request(s) in flight and "
                    f"{waiting} waiting for it; retry the unload once they have finished.",
                    code="model_busy", param="model")


def model_pinned(model: str) -> APIError:
    """409 ``model_pinned``: a pinned model is never unloaded."""
    return APIError(409, INVALID_REQUEST, f"Model '{model}' is pinned: it stays loaded while "
                    "the server runs.", code="model_pinned", param="model")


class FatalStartupError(Exception):
    """The worker started but the server cannot use it (e.g. the model has no chat template).

    Raised by a ready callback (the serving core's ``configure``); restarting would not help,
    so the supervisor gives up at once and the server exits non-zero.
    """
