"""HTTP routes of the legacy and helper endpoints (spec/README.md §15), kept out of
``app.py`` so that module only wires them in: ``POST /v1/completions``, ``POST /tokenize``,
``POST /detokenize``, and the context window fields of ``GET /v1/models``."""

from __future__ import annotations

from typing import Any, Callable

from quart import Response, request
from quart_trio import QuartTrio

from ..config import Settings
from ..runtime import SessionRuntime
from .http import arriving_request, event_stream, json_response
from ..serving_chat import ServingChat
from ..stats import GenerationStats
from ..worker_protocol import Ready
from .completions import ServingCompletions, new_completion_id

__all__ = ["build", "register", "context_window", "LegacyEndpoints"]


class LegacyEndpoints:
    """The completions adapter plus what it needs from the chat adapter's model setup."""

    def __init__(self, completions: ServingCompletions, chat: ServingChat) -> None:
        self.completions = completions
        self.chat = chat
        self.n_ctx = 0  # a request's context window (the worker's per-slot n_ctx); 0 until ready

    def chain_ready(self, first: Callable[[Ready], None]) -> Callable[[Ready], None]:
        """An ``on_ready`` that runs ``first`` (the chat adapter's, which picks the profile
        and may raise FatalStartupError), then configures completions from the same record."""
        def on_ready(ready: Ready) -> None:
            first(ready)
            self.n_ctx = ready.n_ctx
            profile = self.chat.profile
            bos = ""
            if profile is not None and profile.profile.bos_once:
                bos = profile.bos_token
            bos_id = ready.special_tokens.get("bos_id")
            self.completions.configure(
                fim_ids=ready.fim_ids, bos_token=bos,
                bos_id=bos_id if isinstance(bos_id, int) and not isinstance(bos_id, bool) else None)
        return on_ready


def build(settings: Settings, model_id: str, runtime: SessionRuntime, chat: ServingChat,
          on_generation: Callable[[GenerationStats], None]) -> LegacyEndpoints:
    return LegacyEndpoints(ServingCompletions(model_id=model_id, runtime=runtime,
                                              max_body_bytes=settings.max_body_bytes,
                                              on_generation=on_generation), chat)


def context_window(n_ctx: int) -> dict[str, Any]:
    """``/v1/models`` fields for the context window of one request (a slot's ``n_ctx``):
    ``context_length`` (OpenRouter/LM Studio/llama-server name) and ``max_model_len``
    (vLLM's). Empty while no worker was ready yet."""
    return {"context_length": n_ctx, "max_model_len": n_ctx} if n_ctx > 0 else {}


def register(app: QuartTrio, legacy: LegacyEndpoints, runtime: SessionRuntime,
             call_at_request_end: Callable[[Callable[[], None]], None]) -> None:
    serving = legacy.completions

    @app.post("/v1/completions")
    async def completions() -> Response:
        completion_id = new_completion_id()
        async with arriving_request(runtime, completion_id) as (body, arrival):
            result = await serving.create(body, completion_id=completion_id,
                                          headers=request.headers, arrival=arrival)
        if isinstance(result, dict):
            return json_response(result)
        return event_stream(result.body, result.cancel, call_at_request_end)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return json_response(await serving.tokenize(await request.get_data(cache=False),
                                                    client=request.remote_addr or ""))

    @app.post("/detokenize")
    async def detokenize() -> Response:
        return json_response(await serving.detokenize(await request.get_data(cache=False),
                                                      client=request.remote_addr or ""))
