"""Which served model a request goes to (spec/README.md §2.1).

A generating route reads the body's ``model`` before its adapter validates the rest, resolves
it with the registry (exact ids, then aliases; ``trioserve.registry``), leases that model
from the host and hands the request to the model's adapter. An unknown name is 404
``model_not_found`` listing the served ids. A body whose ``model`` cannot be read (not JSON,
no ``model``, not a string) goes to the default model (the registry's first), whose adapter
answers with the same validation error a one-model server gives.

With one model and no aliases the body is not read twice: the model is known.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, AsyncIterator, Callable

from trioserve import errors
from trioserve.core.offload import LARGE_BODY_BYTES, prepare
from trioserve.http.host import ModelServices
from trioserve.http.services import Services

__all__ = ["describe", "leased_model", "model_for", "requested_model", "stored_response_model"]

RequestEnd = Callable[[Callable[[], None]], None]


def requested_model(body: bytes) -> object:
    """The body's ``model`` member; None when the body is not a JSON object or has none."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return obj.get("model") if isinstance(obj, dict) else None


async def model_for(services: Services, body: bytes, route: str) -> str:
    """The id of the model that serves ``body`` on ``route`` (module docstring). A large body
    is parsed off the event loop, as the adapters parse it (trioserve.core.offload).

    Raises:
        APIError: 404 ``model_not_found`` for a ``model`` string no model answers.
    """
    registry = services.registry
    if len(registry.specs) == 1 and not registry.aliases:
        return registry.default.id  # its adapter checks the name, as it always did
    requested = await prepare(partial(requested_model, body), large=len(body) > LARGE_BODY_BYTES)
    spec = registry.resolve(requested, route)
    if spec is not None:
        return spec.id
    if isinstance(requested, str):
        raise errors.model_not_found(requested, registry.ids)
    return registry.default.id


@asynccontextmanager
async def leased_model(services: Services, model_id: str,
                       call_at_request_end: RequestEnd | None = None) -> AsyncIterator[ModelServices]:
    """Lease ``model_id`` from the host for the block; with ``call_at_request_end`` the model
    stays counted as in use until the HTTP request ends (an event stream outlives the
    handler)."""
    async with services.host.lease(model_id) as model:
        if call_at_request_end is not None:
            call_at_request_end(model.hold())
        yield model


def stored_response_model(services: Services, response_id: str) -> ModelServices:
    """The loaded model whose Responses store holds ``response_id``, else the default model
    (whose adapter then answers 404 ``response_not_found``)."""
    for model in services.host.loaded():
        if model.responses.store.entry(response_id) is not None:
            return model
    return services.default


def describe(services: Services, model: ModelServices | None, spec_id: str) -> dict[str, Any]:
    """A ``GET /v1/models`` entry (spec §2): id, context window and capabilities once a
    worker of it was ready, else as its file's header gives them (http/model_preview.py), and
    its ``state``: the host's, or ``failed`` with ``failure`` (the reason) while it cannot be
    served (its last load failed, or its header shows it cannot start)."""
    host = services.host
    entry: dict[str, Any] = {"id": spec_id, "object": "model", "created": services.created,
                             "owned_by": "trioserve", "state": host.state(spec_id)}
    failure = host.failure(spec_id)
    if failure is not None:
        entry.update(state="failed", failure=failure)
    capabilities = model.core.capabilities() if model is not None else None  # None while loading
    if capabilities is not None:
        assert model is not None
        entry["capabilities"] = capabilities
        if model.pool.kernel_path is not None:  # llama workers: the verified CPU path
            entry["capabilities"] = {**capabilities, "kernel_path": model.pool.kernel_path}
    n_ctx = model.n_ctx if model is not None else 0
    if capabilities is None or n_ctx <= 0:
        preview = host.preview(spec_id)
        if preview is not None:
            if capabilities is None and preview.capabilities is not None:
                entry["capabilities"] = preview.capabilities
            n_ctx = n_ctx if n_ctx > 0 else (preview.context_length or 0)
    if n_ctx > 0:
        # The context window of one request (a slot's n_ctx): context_length is
        # OpenRouter's, LM Studio's and llama-server's name, max_model_len vLLM's.
        entry.update(context_length=n_ctx, max_model_len=n_ctx)
    return entry
