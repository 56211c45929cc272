"""Raw prompts: generation without a chat template, and the tokenizer (spec/README.md §15).

The serving core's side of ``/v1/completions``, ``/tokenize`` and ``/detokenize``: the adapter
parses and encodes, this module builds the worker's prompt segments and talks to the runtime,
so no API adapter talks to the worker.

A text prompt is tokenized with special-token parsing (a completion prompt is usually a
rendered template) and the profile's BOS rule; token ids are used verbatim. ``suffix`` asks
for fill-in-the-middle: ``<FIM prefix> prompt <FIM suffix> suffix <FIM middle>`` with the FIM
ids of the worker's ready record (prefix and suffix are user text: no special-token parsing).

Timing and cancellation: :meth:`RawPrompts.start` returns only after the worker's first record
(the path every generation takes: core/admission.py), so every failure known before output is a
plain :class:`~trioserve.errors.APIError`.
:meth:`RawTurn.close` (synchronous, idempotent) cancels the generation and reports its
statistics once; the adapter calls it when the HTTP request ends, however it ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

from trioserve import errors
from trioserve.core.admission import first_record, report_generation, submit
from trioserve.core.logit_bias import BiasSupport, LogitBias
from trioserve.core.runtime import Arrival, Runtime, api_error
from trioserve.core.stats import GenerationStats, GenerationTimer
from trioserve.worker.protocol import (
    Detokenize,
    Detokenized,
    Done,
    GenerateParams,
    IdsSegment,
    Segment,
    TextSegment,
    Tokenize,
    Tokens,
)
from trioserve.worker.runtime import Generation, GenerationError
from trioserve.worker.tokenize_gate import GateFull, tokenizer_busy

__all__ = ["RawRequest", "RawTurn", "RawPrompts", "raw_error"]

log = logging.getLogger("trioserve.completions")


@dataclass(frozen=True, slots=True)
class RawRequest:
    """A validated raw-prompt generation. ``prompt`` is text or token ids; ``session_key`` is
    the resolved session (spec §12) or None."""

    prompt: str | tuple[int, ...]
    suffix: str | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    session_key: str | None = None
    logit_bias: LogitBias = ()


class RawTurn:
    """A raw generation past its first record. Iterate :meth:`receive` until it returns None;
    then ``done`` holds the worker's terminal record."""

    def __init__(self, owner: RawPrompts, request_id: str, gen: Generation, first: str | None,
                 timer: GenerationTimer) -> None:
        self._owner = owner
        self._request_id = request_id
        self._gen = gen
        self.first = first
        self._timer = timer

    @property
    def done(self) -> Done | None:
        return self._gen.done

    async def receive(self) -> str | None:
        """The next text piece, or None at the end. Raises APIError when the worker fails."""
        try:
            return await self._gen.receive()
        except GenerationError as exc:
            raise raw_error(exc) from None

    def close(self) -> None:
        """Cancel the generation (if still running) and report it once. Never raises."""
        self._gen.cancel()
        self._owner.report(self._request_id, self._timer, self._gen)


class RawPrompts:
    """Raw-prompt generation and tokenization over a runtime. ``configure`` is told, per worker
    incarnation, what the prompt rules need (after the chat template's profile is chosen)."""

    def __init__(self, runtime: Runtime, on_generation: Callable[[GenerationStats], None]) -> None:
        self.runtime = runtime
        self.on_generation = on_generation
        self.fim_ids: tuple[int, int, int] | None = None
        self.bos_token = ""  # prepended once to text prompts when the profile says so
        self.bos_id: int | None = None
        self.ready = False
        self.bias_support = BiasSupport()  # set by ServingCore.configure per worker incarnation

    def configure(self, *, fim_ids: tuple[int, int, int] | None, bos_token: str,
                  bos_id: int | None) -> None:
        self.fim_ids = fim_ids
        self.bos_token = bos_token
        self.bos_id = bos_id
        self.ready = True

    def segments(self, req: RawRequest, supported: tuple[str, ...]) -> tuple[Segment, ...]:
        """The worker's prompt segments. A ``suffix`` on a model without FIM tokens is a 400
        ``unsupported_parameter`` listing ``supported``."""
        def part(p: str | tuple[int, ...], special: bool) -> Segment:
            return TextSegment(p, special) if isinstance(p, str) else IdsSegment(p)

        if req.suffix is None:
            if isinstance(req.prompt, str) and self.bos_token and not req.prompt.startswith(self.bos_token):
                return (TextSegment(self.bos_token, True), TextSegment(req.prompt, True))
            return (part(req.prompt, True),)
        if self.fim_ids is None:
            raise errors.unsupported_parameters(
                [("suffix", "this model has no fill-in-the-middle tokens")], supported)
        pre, suf, mid = self.fim_ids
        segs: list[Segment] = [IdsSegment((pre,))]
        if req.prompt:
            segs.append(part(req.prompt, False))
        segs.append(IdsSegment((suf,)))
        if req.suffix:
            segs.append(TextSegment(req.suffix, False))
        segs.append(IdsSegment((mid,)))
        return tuple(segs)

    async def start(self, req: RawRequest, *, request_id: str, supported: tuple[str, ...],
                    arrival: Arrival | None = None) -> RawTurn:
        """Admit ``req`` and wait for its first record. Raises APIError for every failure
        known before output; a cancellation while queued or prefilling cancels the generation."""
        if not self.ready:
            raise errors.worker_unavailable("the model worker is loading")
        segments = self.segments(req, supported)
        self.bias_support.check(req.logit_bias)
        params = GenerateParams(
            prompt="".join(s.text for s in segments if isinstance(s, TextSegment)),
            prompt_segments=segments, max_new_tokens=req.max_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
            stop=req.stop, session_id=req.session_key,
            retention="short" if req.session_key else None, logit_bias=req.logit_bias)
        timer = GenerationTimer()
        gen = submit(self.runtime, params, arrival=arrival, error=raw_error)
        try:
            first = await first_record(gen, timer, partial(self.report, request_id, timer, gen))
        except GenerationError as exc:
            raise raw_error(exc) from None
        return RawTurn(self, request_id, gen, first, timer)

    def report(self, request_id: str, timer: GenerationTimer, gen: Generation) -> None:
        """Report ``gen``'s stats once (core/admission.py)."""
        report_generation(self.on_generation, request_id, timer, gen)

    # -- the tokenizer ----------------------------------------------------------------------

    async def tokenize(self, content: str, *, add_bos: bool, parse_special: bool,
                       client: str = "") -> tuple[int, ...]:
        """The ids of ``content`` (the model's BOS id first when ``add_bos`` and it has one).
        Raises APIError naming ``content``. ``client`` (the peer address) names whose share
        of the tokenizer queue the call takes (worker/tokenize_gate.py)."""
        segments: list[Segment] = []
        if add_bos and self.bos_id is not None:
            segments.append(IdsSegment((self.bos_id,)))
        if content:
            segments.append(TextSegment(content, parse_special))
        if not segments:
            return ()
        reply = await self._call(Tokenize(prompt_segments=tuple(segments)), "content", client)
        assert isinstance(reply, Tokens)
        return reply.ids

    async def detokenize(self, ids: tuple[int, ...], client: str = "") -> str:
        """The text of ``ids``. Raises APIError naming ``tokens`` (e.g. an id out of range)."""
        if not ids:
            return ""
        reply = await self._call(Detokenize(ids), "tokens", client)
        assert isinstance(reply, Detokenized)
        return reply.text

    async def pieces(self, ids: tuple[int, ...], client: str = "") -> list[bytes]:
        """Each id's bytes, in order."""
        if not ids:
            return []
        reply = await self._call(Detokenize(ids, pieces=True), "tokens", client)
        assert isinstance(reply, Detokenized) and reply.pieces is not None
        return list(reply.pieces)

    async def _call(self, request: Tokenize | Detokenize, param: str, client: str) -> Tokens | Detokenized:
        """One tokenizer call for ``client`` through the runtime's tokenize gate (``503
        server_busy`` when the queue or the client's share is full)."""
        if not self.ready:
            raise errors.worker_unavailable("the model worker is loading")
        try:
            async with self.runtime.tokenize_gate.admit(client):
                reply = await self.runtime.call(request)
        except GateFull as exc:
            raise raw_error(tokenizer_busy(exc)) from None
        except GenerationError as exc:
            if exc.code == "invalid_token_id":
                raise errors.invalid_value(exc.message, param) from None
            raise raw_error(exc) from None
        assert isinstance(reply, (Tokens, Detokenized))
        return reply


def raw_error(exc: GenerationError) -> errors.APIError:
    """A runtime/worker failure as a raw-prompt endpoint's error (the core's mapping;
    ``prompt`` is the parameter a token-level failure names)."""
    if exc.code in ("empty_prompt", "invalid_token_id"):
        return errors.invalid_value(exc.message, "prompt")
    if exc.code == "context_length_exceeded":
        lower = "at least " if exc.details.get("lower_bound") else ""
        return errors.APIError(400, errors.INVALID_REQUEST,
                               f"This model's maximum context length is {exc.details.get('n_ctx')} "
                               f"tokens, but the prompt takes {lower}{exc.details.get('prompt_tokens')} "
                               "tokens. Shorten the prompt.",
                               code="context_length_exceeded", param="prompt")
    return api_error(exc)
