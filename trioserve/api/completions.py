"""The legacy and helper endpoints: ``POST /v1/completions``, ``/tokenize``, ``/detokenize``.

``/v1/completions`` takes a raw prompt (no chat template): a string, tokenized with
special-token parsing (a completion prompt is usually a rendered template) and the model's BOS
rule, or token ids used verbatim. ``suffix`` asks for fill-in-the-middle: the prompt becomes
``<FIM prefix> prompt <FIM suffix> suffix <FIM middle>`` with the model's FIM token ids from the
worker's ready record (prefix and suffix are user text: no special-token parsing); a model
without FIM tokens answers 400 ``unsupported_parameter`` naming ``suffix``. The output is the
raw text: no reasoning split, no tool-call parsing.

``/tokenize`` and ``/detokenize`` use llama-server's request and response shapes and the
worker's ``tokenize`` / ``detokenize`` ops (the same tokenizer as generation).

Timing and cancellation contracts are chat's (``serving_chat``): ``complete`` returns only
after the worker's first record for the request, so every error known before generation is a
plain JSON error; a streamed answer's ``cancel`` runs when the HTTP request ends, however it
ends, so a client that disconnects frees its slot.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Callable, Mapping

from pydantic import BaseModel, ValidationError

from .. import errors, limits, strict_json
from ..protocol import _load_json_object, _translate
from ..request_models import ROUTER_WRITTEN_DEFAULTS
from ..core.pipeline import usage_of
from ..core.serving import api_error
from ..offload import LARGE_BODY_BYTES, prepare
from ..runtime import Arrival, Done, GenerateParams, Generation, GenerationError, SessionRuntime
from ..sessions import resolve_session_key
from ..sse import DONE, chunk_bytes
from ..stats import GenerationStats, GenerationTimer
from ..tokenize_gate import GateFull, tokenizer_busy
from ..worker_protocol import Detokenize, Detokenized, IdsSegment, Segment, TextSegment, Tokenize, Tokens
from .chat import usage_dict
from .legacy_models import CompletionBody, DetokenizeBody, TokenizeBody

log = logging.getLogger("trioserve.completions")

__all__ = ["ServingCompletions", "CompletionRequest", "parse_completion_request", "TextStream"]

SUPPORTED_PARAMETERS = ("model", "prompt", "suffix", "stream", "stream_options.include_usage",
                        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                        "prompt_cache_key", "session_id")

# OpenAI's default for the legacy endpoint: without max_tokens a completion is 16 tokens.
DEFAULT_MAX_TOKENS = 16

# Parameter → (is this value unsupported?, why); checked for keys present in the body.
_UNSUPPORTED_WHEN: dict[str, tuple[Callable[[CompletionBody], bool], str]] = {
    "n": (lambda b: b.n not in (None, 1), "only n=1 is supported"),
    "best_of": (lambda b: b.best_of not in (None, 1), "only best_of=1 is supported"),
    "echo": (lambda b: b.echo is True, "echoing the prompt is not supported"),
    "logprobs": (lambda b: b.logprobs not in (None, 0), "log probabilities are not supported"),
    "frequency_penalty": (lambda b: b.frequency_penalty not in (None, 0), "only 0 is supported"),
    "presence_penalty": (lambda b: b.presence_penalty not in (None, 0), "only 0 is supported"),
    "logit_bias": (lambda b: bool(b.logit_bias), "only an empty object is supported"),
    # What SGLang-lineage routers write into every body they forward (request_models.py).
    **{name: ((lambda b, name=name, ok=ROUTER_WRITTEN_DEFAULTS[name]:
               getattr(b, name) not in (None, ok)),
              f"only {str(ROUTER_WRITTEN_DEFAULTS[name]).lower()} is supported")
       for name in ("no_stop_trim", "ignore_eos", "skip_special_tokens", "return_hidden_states")},
}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated ``/v1/completions`` request. ``prompt`` is text or token ids."""

    prompt: str | tuple[int, ...]
    suffix: str | None
    stream: bool
    include_usage: bool
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    prompt_cache_key: str | None
    session_id: str | None


def _validate(model: type[BaseModel], body: bytes, max_body_bytes: int) -> tuple[dict[str, Any], Any]:
    """Stages 1–3 of the chat validation order (size, JSON, types) for ``model``."""
    if len(body) > max_body_bytes:
        raise errors.request_too_large(max_body_bytes)
    obj = _load_json_object(body)
    try:
        parsed = model.model_validate(
            obj, context={"unicode_checks": strict_json.may_hold_lone_surrogates(body)})
    except ValidationError as exc:
        raise _translate(exc.errors(include_url=False)[0]) from None
    return obj, parsed


def _unknown_keys(obj: Mapping[str, Any], model: type[BaseModel]) -> list[tuple[str, str]]:
    return [(key, "unknown parameter") for key in obj if key not in model.model_fields]


def _prompt(value: Any) -> str | tuple[int, ...]:
    """The prompt as text or ids; a batch must hold exactly one prompt."""
    if isinstance(value, str):
        return value
    items = list(value)
    if len(items) == 1 and isinstance(items[0], (str, list)):
        if isinstance(items[0], str):
            return items[0]
        items = items[0]
    if not items:
        raise errors.invalid_value("'prompt' must not be empty.", "prompt")
    if all(isinstance(i, str) for i in items):
        raise errors.unsupported_parameters(
            [("prompt", f"a batch of {len(items)} prompts; send one prompt per request")],
            SUPPORTED_PARAMETERS)
    for k, i in enumerate(items):
        if isinstance(i, bool) or not isinstance(i, int):
            if isinstance(i, list):
                raise errors.unsupported_parameters(
                    [("prompt", "a batch of several prompts; send one prompt per request")],
                    SUPPORTED_PARAMETERS)
            raise errors.invalid_value(
                f"Invalid type for 'prompt[{k}]': expected an integer token id, got "
                f"{strict_json.json_type_name(i)}.", f"prompt[{k}]")
        if not 0 <= i <= limits.INT32_MAX:
            raise errors.invalid_value(f"Invalid value for 'prompt[{k}]': {i} is not a token id.",
                                       f"prompt[{k}]")
    return tuple(items)


def parse_completion_request(body: bytes, *, served_model: str, max_body_bytes: int) -> CompletionRequest:
    """Validate a ``/v1/completions`` body (chat's order: size, JSON, types, unsupported,
    model). Raises APIError, never anything else."""
    obj, parsed = _validate(CompletionBody, body, max_body_bytes)
    offenders = _unknown_keys(obj, CompletionBody)
    offenders += [(k, _UNSUPPORTED_WHEN[k][1]) for k in obj
                  if k in _UNSUPPORTED_WHEN and _UNSUPPORTED_WHEN[k][0](parsed)]
    if offenders:
        raise errors.unsupported_parameters(offenders, SUPPORTED_PARAMETERS)
    if parsed.model != served_model:
        raise errors.model_not_found(parsed.model, served_model)
    prompt = _prompt(parsed.prompt)
    if prompt == "":
        raise errors.invalid_value("'prompt' must not be empty.", "prompt")
    stop: list[str] = []
    for s in [parsed.stop] if isinstance(parsed.stop, str) else parsed.stop or ():
        if s and s not in stop:
            stop.append(s)
    stream = bool(parsed.stream)
    return CompletionRequest(
        prompt=prompt, suffix=parsed.suffix, stream=stream,
        include_usage=stream and bool(parsed.stream_options and parsed.stream_options.include_usage),
        max_tokens=min(parsed.max_tokens, limits.INT32_MAX) if parsed.max_tokens is not None
        else DEFAULT_MAX_TOKENS,
        temperature=1.0 if parsed.temperature is None else float(parsed.temperature),
        top_p=1.0 if parsed.top_p is None else float(parsed.top_p),
        top_k=0 if parsed.top_k is None else min(parsed.top_k, limits.INT32_MAX),
        seed=limits.worker_seed(parsed.seed), stop=tuple(stop),
        prompt_cache_key=parsed.prompt_cache_key, session_id=parsed.session_id)


@dataclass(frozen=True)
class TextStream:
    """A streamed answer: the SSE ``body`` and ``cancel`` (synchronous, idempotent), which
    the HTTP layer calls when the request ends, whether or not the body was iterated."""

    body: AsyncIterator[bytes]
    cancel: Callable[[], None]


def new_completion_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


class ServingCompletions:
    """Raw-prompt completions and the tokenizer endpoints over one SessionRuntime.

    ``configure_model`` is told, per worker incarnation, what the prompt rules need: the BOS
    rule (``prefix_rule``, the serving profile's), the FIM ids and the extra stop strings.
    """

    def __init__(self, *, model_id: str, runtime: SessionRuntime, max_body_bytes: int,
                 on_generation: Callable[[GenerationStats], None]) -> None:
        self.model_id = model_id
        self.runtime = runtime
        self.max_body_bytes = max_body_bytes
        self.on_generation = on_generation
        self.fim_ids: tuple[int, int, int] | None = None
        self.bos_token: str = ""  # prepended once to text prompts when the profile says so
        self.bos_id: int | None = None
        self.ready = False

    def configure(self, *, fim_ids: tuple[int, int, int] | None, bos_token: str,
                  bos_id: int | None) -> None:
        """Called when a worker becomes ready (after the chat adapter chose its profile)."""
        self.fim_ids = fim_ids
        self.bos_token = bos_token
        self.bos_id = bos_id
        self.ready = True

    # -- /v1/completions -------------------------------------------------------------------

    def _segments(self, req: CompletionRequest) -> tuple[Segment, ...]:
        def part(p: str | tuple[int, ...], special: bool) -> Segment:
            return TextSegment(p, special) if isinstance(p, str) else IdsSegment(p)

        if req.suffix is None:
            if isinstance(req.prompt, str) and self.bos_token and not req.prompt.startswith(self.bos_token):
                return (TextSegment(self.bos_token, True), TextSegment(req.prompt, True))
            return (part(req.prompt, True),)
        if self.fim_ids is None:
            raise errors.unsupported_parameters(
                [("suffix", "this model has no fill-in-the-middle tokens")], SUPPORTED_PARAMETERS)
        pre, suf, mid = self.fim_ids
        segs: list[Segment] = [IdsSegment((pre,))]
        if req.prompt:
            segs.append(part(req.prompt, False))
        segs.append(IdsSegment((suf,)))
        if req.suffix:
            segs.append(TextSegment(req.suffix, False))
        segs.append(IdsSegment((mid,)))
        return tuple(segs)

    async def create(self, body: bytes, *, completion_id: str, headers: Mapping[str, str] | None,
                     arrival: Arrival | None = None) -> dict[str, Any] | TextStream:
        """Serve one request: a JSON dict (non-stream) or a TextStream. Raises APIError for
        every failure known before the first byte of the response."""
        req = await prepare(partial(parse_completion_request, body, served_model=self.model_id,
                                    max_body_bytes=self.max_body_bytes),
                            large=len(body) > LARGE_BODY_BYTES)
        session = resolve_session_key(
            {"prompt_cache_key": req.prompt_cache_key, "session_id": req.session_id}, headers)
        if not self.ready:
            raise errors.worker_unavailable("the model worker is loading")
        segments = self._segments(req)
        params = GenerateParams(
            prompt="".join(s.text for s in segments if isinstance(s, TextSegment)),
            prompt_segments=segments, max_new_tokens=req.max_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
            stop=req.stop, session_id=session.key if session else None,
            retention="short" if session else None)
        timer = GenerationTimer()
        try:
            gen = self.runtime.submit(params, arrival=arrival)
        except GenerationError as exc:
            raise generation_error(exc) from None
        try:
            first = await gen.receive()
            timer.mark_first_output()
        except BaseException as exc:
            gen.cancel()
            self._report(completion_id, timer, gen)
            if isinstance(exc, GenerationError):
                raise generation_error(exc) from None
            raise
        created = int(time.time())
        if req.stream:
            def end() -> None:
                gen.cancel()
                self._report(completion_id, timer, gen)
            return TextStream(self._stream(req, gen, first, completion_id, created, timer), end)
        try:
            parts: list[str] = []
            piece = first
            while piece is not None:
                parts.append(piece)
                piece = await gen.receive()
        except GenerationError as exc:
            raise generation_error(exc) from None
        finally:
            gen.cancel()
            self._report(completion_id, timer, gen)
        return {"id": completion_id, "object": "text_completion", "created": created,
                "model": self.model_id,
                "choices": [{"text": "".join(parts), "index": 0, "logprobs": None,
                             "finish_reason": finish_reason(gen.done)}],
                "usage": usage(gen.done)}

    async def _stream(self, req: CompletionRequest, gen: Generation, first: str | None,
                      completion_id: str, created: int, timer: GenerationTimer) -> AsyncIterator[bytes]:
        """The SSE body: one chunk per piece, a final chunk with ``finish_reason``, the usage
        chunk when asked for, ``[DONE]``. A failure mid-stream is an error event, then
        ``[DONE]``."""
        head = {"id": completion_id, "object": "text_completion", "created": created,
                "model": self.model_id}
        extra = {"usage": None} if req.include_usage else {}

        def chunk(text: str, finish: str | None) -> bytes:
            return chunk_bytes({**head, "choices": [{"text": text, "index": 0, "logprobs": None,
                                                      "finish_reason": finish}], **extra})
        try:
            piece = first
            try:
                while piece is not None:
                    yield chunk(piece, None)
                    piece = await gen.receive()
                out = chunk("", finish_reason(gen.done))
                if req.include_usage:
                    out += chunk_bytes({**head, "choices": [], "usage": usage(gen.done)})
                yield out + DONE
            except GenerationError as exc:
                yield chunk_bytes(generation_error(exc).envelope()) + DONE
            except Exception:
                log.exception("stream %s failed", completion_id)
                error = errors.internal_error(f"the response could not be completed (request id "
                                              f"{completion_id}; details in the server log)")
                yield chunk_bytes(error.envelope()) + DONE
        finally:
            gen.cancel()
            self._report(completion_id, timer, gen)

    def _report(self, completion_id: str, timer: GenerationTimer, gen: Generation) -> None:
        timer.report_once(self.on_generation, completion_id, gen.done,
                          cancel_requested=gen.cancel_requested, worker=gen.worker)

    # -- /tokenize, /detokenize ------------------------------------------------------------

    async def tokenize(self, body: bytes, *, client: str = "") -> dict[str, Any]:
        """llama-server's ``/tokenize``: ``{"tokens": [ids]}``, or with ``with_pieces``
        ``{"tokens": [{"id", "piece"}]}`` (a piece that is not valid UTF-8 alone is its list
        of byte values). ``add_special`` prepends the model's BOS id when it has one;
        ``parse_special`` (default true) parses control-token text. ``client`` (the peer
        address) names whose share of the tokenizer queue it takes (tokenize_gate.py)."""
        obj, parsed = _validate(TokenizeBody, body, self.max_body_bytes)
        offenders = _unknown_keys(obj, TokenizeBody)
        if offenders:
            raise errors.unsupported_parameters(offenders, ("content", "add_special", "parse_special",
                                                            "with_pieces"))
        parse_special = parsed.parse_special is not False
        segments: list[Segment] = []
        if parsed.add_special and self.bos_id is not None:
            segments.append(IdsSegment((self.bos_id,)))
        if parsed.content:
            segments.append(TextSegment(parsed.content, parse_special))
        ids: tuple[int, ...] = ()
        if segments:
            reply = await self._call(Tokenize(prompt_segments=tuple(segments)), "content", client)
            assert isinstance(reply, Tokens)
            ids = reply.ids
        if not parsed.with_pieces:
            return {"tokens": list(ids)}
        pieces = await self._pieces(ids, client)
        return {"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces)]}

    async def detokenize(self, body: bytes, *, client: str = "") -> dict[str, Any]:
        """llama-server's ``/detokenize``: ``{"tokens": [ids]}`` → ``{"content": text}``."""
        obj, parsed = _validate(DetokenizeBody, body, self.max_body_bytes)
        offenders = _unknown_keys(obj, DetokenizeBody)
        if offenders:
            raise errors.unsupported_parameters(offenders, ("tokens",))
        if not parsed.tokens:
            return {"content": ""}
        reply = await self._call(Detokenize(tuple(parsed.tokens)), "tokens", client)
        assert isinstance(reply, Detokenized)
        return {"content": reply.text}

    async def _pieces(self, ids: tuple[int, ...], client: str) -> list[str | list[int]]:
        if not ids:
            return []
        reply = await self._call(Detokenize(ids, pieces=True), "tokens", client)
        assert isinstance(reply, Detokenized) and reply.pieces is not None
        out: list[str | list[int]] = []
        for raw in reply.pieces:
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(list(raw))
        return out

    async def _call(self, request: Tokenize | Detokenize, param: str, client: str) -> Any:
        """One tokenizer call for ``client``, through the runtime's tokenize gate
        (tokenize_gate.py: ``503 server_busy`` when the queue or the client's share is full)."""
        if not self.ready:
            raise errors.worker_unavailable("the model worker is loading")
        try:
            async with self.runtime.tokenize_gate.admit(client):
                return await self.runtime.call(request)
        except GateFull as exc:
            raise generation_error(tokenizer_busy(exc)) from None
        except GenerationError as exc:
            if exc.code == "invalid_token_id":
                raise errors.invalid_value(exc.message, param) from None
            raise generation_error(exc) from None


def finish_reason(done: Done | None) -> str:
    return done.finish_reason if done is not None else "stop"


def usage(done: Done | None) -> dict[str, Any]:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` (prompt tokens found resident),
    the same numbers the core reports for chat."""
    return usage_dict(usage_of(done))


def generation_error(exc: GenerationError) -> errors.APIError:
    """A runtime/worker failure as this endpoint's error (the core's mapping; ``prompt`` is
    the parameter a token-level failure names)."""
    if exc.code in ("empty_prompt", "invalid_token_id"):
        return errors.invalid_value(exc.message, "prompt")
    if exc.code == "context_length_exceeded":
        return errors.APIError(400, errors.INVALID_REQUEST,
                               f"This model's maximum context length is {exc.details.get('n_ctx')} "
                               f"tokens, but the prompt takes {'at least ' if exc.details.get('lower_bound') else ''}"
                               f"{exc.details.get('prompt_tokens')} "
                               "tokens. Shorten the prompt.",
                               code="context_length_exceeded", param="prompt")
    return api_error(exc)
