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

Timing and cancellation contracts are chat's (the chat adapter): ``complete`` returns only
after the worker's first record for the request, so every error known before generation is a
plain JSON error; a streamed answer's ``cancel`` runs when the HTTP request ends, however it
ends, so a client that disconnects frees its slot.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Callable, Mapping

from pydantic import BaseModel

from trioserve.core.model_names import ModelNames, check_model
from trioserve import errors, limits, strict_json
from trioserve.api.validation import set_other_than, validate_body
from trioserve.api.body import ROUTER_WRITTEN_DEFAULTS
from trioserve.core.pipeline import usage_of
from trioserve.core.logit_bias import LogitBias, parse_logit_bias
from trioserve.core.raw import RawRequest, RawTurn
from trioserve.core.runtime import Arrival
from trioserve.core.serving import ServingCore
from trioserve.core.offload import LARGE_BODY_BYTES, prepare
from trioserve.core.sessions import resolve_session_key
from trioserve.api.streaming import DONE, chunk_bytes, sse_body
from trioserve.api.answers import Answer, JsonResponse, StreamResponse, openai_usage
from trioserve.api.completions.models import CompletionBody, DetokenizeBody, TokenizeBody


__all__ = ["ServingCompletions", "CompletionRequest", "new_completion_id", "parse_completion_request"]

SUPPORTED_PARAMETERS = ("model", "prompt", "suffix", "stream", "stream_options.include_usage",
                        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logit_bias",
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
    # What SGLang-lineage routers write into every body they forward (api/body.py).
    **{name: (set_other_than(name, ROUTER_WRITTEN_DEFAULTS[name]),
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
    logit_bias: LogitBias
    prompt_cache_key: str | None
    session_id: str | None


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


def parse_completion_request(body: bytes, *, served_model: str, max_body_bytes: int,
                             names: ModelNames | None = None) -> CompletionRequest:
    """Validate a ``/v1/completions`` body (chat's order: size, JSON, types, unsupported,
    model). Raises APIError, never anything else."""
    obj, parsed = validate_body(CompletionBody, body, max_body_bytes)
    offenders = _unknown_keys(obj, CompletionBody)
    offenders += [(k, _UNSUPPORTED_WHEN[k][1]) for k in obj
                  if k in _UNSUPPORTED_WHEN and _UNSUPPORTED_WHEN[k][0](parsed)]
    if offenders:
        raise errors.unsupported_parameters(offenders, SUPPORTED_PARAMETERS)
    check_model(parsed.model, served_model, names, "completions")
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
        logit_bias=parse_logit_bias(parsed.logit_bias), prompt_cache_key=parsed.prompt_cache_key, session_id=parsed.session_id)


def new_completion_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


class ServingCompletions:
    """``/v1/completions``, ``/tokenize`` and ``/detokenize`` over the serving core's raw
    prompts (core/raw.py): this adapter parses and encodes; the core talks to the worker."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.raw = core.raw

    # -- /v1/completions -------------------------------------------------------------------

    async def create(self, body: bytes, *, request_id: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     arrival: Arrival | None = None) -> Answer:
        """Serve one request (``api.answers.GeneratingAPI``): the ``text_completion`` object
        (non-stream) or a stream of its chunks. Raises APIError for every failure known before
        the first byte of the response. ``request_id`` (default: a new one) is the ``cmpl-…`` id."""
        completion_id = request_id or new_completion_id()
        model_id = self.core.model_id
        req = await prepare(partial(parse_completion_request, body, served_model=model_id,
                                    names=self.core.names,
                                    max_body_bytes=self.core.settings.max_body_bytes),
                            large=len(body) > LARGE_BODY_BYTES)
        session = resolve_session_key(
            {"prompt_cache_key": req.prompt_cache_key, "session_id": req.session_id}, headers)
        raw = RawRequest(prompt=req.prompt, suffix=req.suffix, max_tokens=req.max_tokens,
                         temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         seed=req.seed, stop=req.stop, session_key=session.key if session else None,
                         logit_bias=req.logit_bias)
        turn = await self.raw.start(raw, request_id=completion_id, supported=SUPPORTED_PARAMETERS,
                                    arrival=arrival)
        created = int(time.time())
        if req.stream:
            return StreamResponse(self._stream(req, turn, completion_id, created), turn.close)
        try:
            parts: list[str] = []
            piece = turn.first
            while piece is not None:
                parts.append(piece)
                piece = await turn.receive()
        finally:
            turn.close()
        return JsonResponse({"id": completion_id, "object": "text_completion", "created": created,
                             "model": model_id,
                             "choices": [{"text": "".join(parts), "index": 0, "logprobs": None,
                                          "finish_reason": finish_reason(turn.done)}],
                             "usage": usage(turn.done)})

    def _stream(self, req: CompletionRequest, turn: RawTurn, completion_id: str,
                created: int) -> AsyncIterator[bytes]:
        """The SSE body (``api.streaming``): one chunk per piece, a final chunk with
        ``finish_reason``, the usage chunk when asked for, ``[DONE]``. A failure mid-stream
        is an error event, then ``[DONE]``."""
        head = {"id": completion_id, "object": "text_completion", "created": created,
                "model": self.core.model_id}
        return sse_body(_pieces(turn), _TextEncoder(head, req.include_usage, turn),
                        request_id=completion_id, close=turn.close)

    # -- /tokenize, /detokenize ------------------------------------------------------------

    async def tokenize(self, body: bytes, *, client: str = "") -> dict[str, Any]:
        """llama-server's ``/tokenize``: ``{"tokens": [ids]}``, or with ``with_pieces``
        ``{"tokens": [{"id", "piece"}]}`` (a piece that is not valid UTF-8 alone is its list
        of byte values). ``add_special`` prepends the model's BOS id when it has one;
        ``parse_special`` (default true) parses control-token text."""
        obj, parsed = validate_body(TokenizeBody, body, self.core.settings.max_body_bytes)
        offenders = _unknown_keys(obj, TokenizeBody)
        if offenders:
            raise errors.unsupported_parameters(offenders, ("content", "add_special", "parse_special",
                                                            "with_pieces", "model"))
        if parsed.model is not None:
            self.core.names.check(parsed.model, "tokenize")
        ids = await self.raw.tokenize(parsed.content or "", add_bos=bool(parsed.add_special),
                                      parse_special=parsed.parse_special is not False, client=client)
        if not parsed.with_pieces:
            return {"tokens": list(ids)}
        pieces: list[str | list[int]] = []
        for raw in await self.raw.pieces(ids, client):
            try:
                pieces.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                pieces.append(list(raw))
        return {"tokens": [{"id": i, "piece": p} for i, p in zip(ids, pieces)]}

    async def detokenize(self, body: bytes, *, client: str = "") -> dict[str, Any]:
        """llama-server's ``/detokenize``: ``{"tokens": [ids]}`` → ``{"content": text}``."""
        obj, parsed = validate_body(DetokenizeBody, body, self.core.settings.max_body_bytes)
        offenders = _unknown_keys(obj, DetokenizeBody)
        if offenders:
            raise errors.unsupported_parameters(offenders, ("tokens", "model"))
        if parsed.model is not None:
            self.core.names.check(parsed.model, "tokenize")
        return {"content": await self.raw.detokenize(tuple(parsed.tokens or ()), client)}


def finish_reason(done: Any) -> str:
    return done.finish_reason if done is not None else "stop"


def usage(done: Any) -> dict[str, Any]:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` (prompt tokens found resident),
    the same numbers the core reports for chat."""
    return openai_usage(usage_of(done))


async def _pieces(turn: RawTurn) -> AsyncIterator[str]:
    """The turn's text, piece by piece (each piece everything that arrived since the last)."""
    piece = turn.first
    while piece is not None:
        yield piece
        piece = await turn.receive()


@dataclass(frozen=True)
class _TextEncoder:
    """``text_completion`` chunks (``api.streaming.StreamEncoder``)."""

    head: dict[str, Any]
    include_usage: bool
    turn: RawTurn

    def _chunk(self, text: str, finish: str | None) -> bytes:
        extra = {"usage": None} if self.include_usage else {}
        return chunk_bytes({**self.head, "choices": [{"text": text, "index": 0, "logprobs": None,
                                                       "finish_reason": finish}], **extra})

    def start(self) -> bytes:
        return b""

    def encode(self, piece: str) -> bytes:
        return self._chunk(piece, None)

    def finish(self) -> bytes:
        out = self._chunk("", finish_reason(self.turn.done))
        if self.include_usage:
            out += chunk_bytes({**self.head, "choices": [], "usage": usage(self.turn.done)})
        return out + DONE

    def fail(self, error: errors.APIError) -> bytes:
        return chunk_bytes(error.envelope()) + DONE
