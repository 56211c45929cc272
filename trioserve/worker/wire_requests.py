"""Typed requests → the bytes of one request line, and the cancel frame (``spec/worker-protocol.md``
§4, §7), sans-IO. A request that cannot be put on the wire raises ``RequestRejected`` before
a byte is written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Union

from trioserve.worker.wire_records import (
    CANCEL_FRAME,
    MAX_REQUEST_ID,
    RequestRejected,
    MAX_ID_DIGITS,
)

# -- requests (parent → worker) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextSegment:
    """Prompt text. ``special=False``: tokenized with special-token parsing off (user
    content: a typed ``<|im_start|>`` stays plain text); True: parsed (template text)."""

    text: str
    special: bool = True
    checkpoint: bool = False  # the worker keeps a state checkpoint where this segment ends (§6.3)


@dataclass(frozen=True, slots=True)
class IdsSegment:
    """Token ids used verbatim."""

    ids: tuple[int, ...]
    checkpoint: bool = False  # as TextSegment's


Segment = Union[TextSegment, IdsSegment]


@dataclass(frozen=True)
class GenerateParams:
    """A fully rendered generation request (worker protocol §4 fields, without the id).

    Exactly one of ``prompt`` (rendered text) and ``prompt_segments`` is used: segments
    win when given. ``grammar`` is a GBNF grammar with root rule ``root``. ``unique_keys``
    (None: off) asks the worker to keep every JSON object of the output free of repeated
    keys; its optional ``reasoning_start`` / ``reasoning_end`` say where the JSON starts.
    """

    prompt: str = ""
    max_new_tokens: int = -1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    session_id: str | None = None
    retention: str | None = None  # "short" | "long": spill priority of a named session (§6.1)
    prompt_segments: tuple[Segment, ...] | None = None
    grammar: str | None = None
    unique_keys: Mapping[str, str] | None = None
    # (token id, bias) pairs added to the logits before sampling (§4 ``logit_bias``); () = none.
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Generate:
    params: GenerateParams


@dataclass(frozen=True, slots=True)
class Ping:
    pass


@dataclass(frozen=True, slots=True)
class Tokenize:
    text: str | None = None
    prompt_segments: tuple[Segment, ...] | None = None
    count_only: bool = False  # the reply carries the count, not the ids (count_tokens)


@dataclass(frozen=True, slots=True)
class Detokenize:
    """Turn token ids into text; ``pieces``: also each id's raw bytes."""

    ids: tuple[int, ...]
    pieces: bool = False


@dataclass(frozen=True, slots=True)
class SessionOpen:
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionClose:
    session_id: str


@dataclass(frozen=True, slots=True)
class SessionReset:
    session_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Request = Union[Generate, Ping, Tokenize, Detokenize, SessionOpen, SessionClose, SessionReset, Shutdown]


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request encoded and checked, waiting only for its id.

    Ids must be strictly increasing in the order lines are written, so the id is chosen
    by whoever writes (under its write lock); everything that can fail has already been
    checked by ``prepare``, so ``line`` cannot fail for a valid id.
    """

    op: str
    body: bytes  # the JSON object without "id", starting with b"{"

    def line(self, request_id: int) -> bytes:
        """The request line, newline included, for ``request_id`` (1 ≤ id < 2^64)."""
        if not 1 <= request_id <= MAX_REQUEST_ID:
            raise ValueError(f"request id {request_id} out of range")
        return b'{"id":%d,%s\n' % (request_id, self.body[1:])


def prepare(request: Request, *, max_line_bytes: int) -> PreparedRequest:
    """Encode ``request`` (without its id) and check it fits the worker.

    Raises RequestRejected when the request cannot be encoded: a string with a lone
    surrogate (``invalid_unicode``), a float JSON cannot carry (``invalid_request``), or a
    line over ``max_line_bytes`` even with the widest id (``line_too_long``).
    """
    fields = request_fields(request)
    try:
        text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        where = _find(fields, lambda v: isinstance(v, float) and not math.isfinite(v))
        raise RequestRejected("invalid_request", f"{where or 'a number'} must be a finite number",
                              field=where) from None
    try:
        body = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _find(fields, _has_surrogate)
        char = f"U+{ord(exc.object[exc.start]):04X}"
        raise RequestRejected(
            "invalid_unicode",
            f"{where or 'the request'} contains a lone UTF-16 surrogate ({char}), which is not "
            "valid Unicode; send well-formed text", field=where) from None
    longest = len(body) + len('{"id":,') - 1 + MAX_ID_DIGITS
    if longest > max_line_bytes:
        raise RequestRejected(
            "line_too_long",
            f"the encoded request takes {len(body)} bytes; the worker accepts lines of at most "
            f"{max_line_bytes} bytes")
    return PreparedRequest(op=fields["op"], body=body)


def encode_cancel(request_id: int) -> bytes:
    """The 8-byte cancel frame for ``request_id`` (unsigned 64-bit little-endian)."""
    if not 1 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request id {request_id} out of range")
    return CANCEL_FRAME.pack(request_id)


def _segments(segments: tuple[Segment, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for seg in segments:
        if isinstance(seg, TextSegment):
            out.append({"text": seg.text, "special": seg.special, **({"checkpoint": True} if seg.checkpoint else {})})
        else:
            out.append({"ids": list(seg.ids), **({"checkpoint": True} if seg.checkpoint else {})})
    return out


def request_fields(request: Request) -> dict[str, Any]:
    """The wire fields of ``request`` other than ``id``; "op" always first."""
    if isinstance(request, Generate):
        p = request.params
        wire: dict[str, Any] = {"op": "generate"}
        if p.prompt_segments is not None:
            wire["prompt_segments"] = _segments(p.prompt_segments)
        else:
            wire["prompt"] = p.prompt
        wire.update(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                    top_k=p.top_k, stop=list(p.stop))
        if p.seed is not None:
            wire["seed"] = p.seed
        if p.logit_bias:
            wire["logit_bias"] = [[token, bias] for token, bias in p.logit_bias]
        if p.session_id is not None:
            wire["session_id"] = p.session_id
            if p.retention is not None:
                wire["retention"] = p.retention
        if p.grammar is not None:
            wire["grammar"] = p.grammar
        if p.unique_keys is not None:
            wire["unique_keys"] = dict(p.unique_keys)
        return wire
    if isinstance(request, Ping):
        return {"op": "ping"}
    if isinstance(request, Tokenize):
        tok: dict[str, Any] = {"op": "tokenize"}
        if request.count_only:
            tok["count_only"] = True
        if request.prompt_segments is not None:
            tok["prompt_segments"] = _segments(request.prompt_segments)
        else:
            tok["text"] = request.text or ""
        return tok
    if isinstance(request, Detokenize):
        return {"op": "detokenize", "ids": list(request.ids), "pieces": request.pieces}
    if isinstance(request, SessionOpen):
        return {"op": "session_open", "session_id": request.session_id}
    if isinstance(request, SessionClose):
        return {"op": "session_close", "session_id": request.session_id}
    if isinstance(request, SessionReset):
        return {"op": "session_reset", "session_id": request.session_id}
    if isinstance(request, Shutdown):
        return {"op": "shutdown"}
    raise TypeError(f"not a worker request: {request!r}")


def _has_surrogate(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _find(value: Any, bad: Any, path: str = "") -> str | None:
    """The path (``stop[1]``, ``prompt_segments[0].text``) of the first leaf ``bad`` accepts."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = _find(item, bad, f"{path}.{key}" if path else key)
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _find(item, bad, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return path if bad(value) else None
