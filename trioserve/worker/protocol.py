"""The parent side of worker protocol v2 as a sans-IO codec (bytes ↔ typed values).

This module is the only place that knows the wire format of ``spec/worker-protocol.md``.
It does no I/O and keeps no clock: ``RecordDecoder`` takes the bytes the worker wrote and
hands back typed, frozen records; ``prepare`` turns a typed request into the bytes of one
request line; ``encode_cancel`` builds the 8-byte cancel frame. ``WorkerClient`` moves
those bytes, ``SessionRuntime`` decides what the records mean.

Who is at fault decides the error type::

    Exception
    ├── WorkerError            the worker as a whole failed and must be replaced
    │   ├── WorkerExited       it closed stdout (it exited or is exiting)
    │   ├── WorkerHung         it missed a deadline (raised by the layers that keep clocks)
    │   └── ProtocolViolation  it wrote something that is not a v2 record
    └── RequestRejected        one request cannot be put on the wire; only it fails

A request that cannot be encoded (text that is not valid Unicode, a line longer than the
worker accepts) is always the request's fault, never the worker's: ``prepare`` raises
``RequestRejected`` before a byte is written, so such a request can neither reach the worker
nor desynchronise the line stream.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Mapping, Union

__all__ = [
    "PROTOCOL_VERSION", "DEFAULT_MAX_LINE_BYTES", "MAX_RECORD_BYTES", "MAX_REQUEST_ID",
    "WorkerError", "WorkerExited", "WorkerHung", "ProtocolViolation", "RequestRejected",
    "Ready", "Token", "Done", "Error", "Pong", "Ack", "Tokens", "Detokenized", "Progress",
    "StepPart", "Record",
    "RecordDecoder", "NEED_DATA", "CLOSED",
    "TextSegment", "IdsSegment", "GenerateParams", "Generate", "Ping", "Tokenize", "Detokenize",
    "SessionOpen", "SessionClose", "SessionReset", "Shutdown", "Request",
    "PreparedRequest", "prepare", "encode_cancel",
]

PROTOCOL_VERSION = 2
# What a v2 worker accepts when its ready record does not say (spec: 16 MiB).
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024
# The longest record the parent reads. Generous, because a ready record carries a chat
# template and a done record can carry a whole context window of generated ids; bounded,
# so a runaway worker can never make the parent buffer without limit.
MAX_RECORD_BYTES = 8 * 1024 * 1024
MAX_REQUEST_ID = 2**64 - 1
# Decimal digits of the largest id: a prepared line is checked against the worker's
# limit with the widest id it could be sent with.
_MAX_ID_DIGITS = len(str(MAX_REQUEST_ID))
CANCEL_FRAME = struct.Struct("<Q")


# -- errors ---------------------------------------------------------------------------


class WorkerError(Exception):
    """The worker process failed as a whole (died, hung, or broke the protocol).

    Distinct from a per-request error record, which the worker survives.
    """


class WorkerExited(WorkerError):
    """The worker closed stdout: it exited or is exiting.

    ``returncode`` is its exit status when it was already reaped (negative: killed by that
    signal), else None; ``during_startup`` says it never sent its ready record.
    """

    def __init__(self, message: str, *, returncode: int | None = None,
                 during_startup: bool = False) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.during_startup = during_startup


class WorkerHung(WorkerError):
    """The worker missed a deadline (cancel grace, health check, stdin write) and must be killed."""


class ProtocolViolation(WorkerError):
    """The worker wrote something that is not a protocol v2 record."""


class RequestRejected(Exception):
    """One request cannot be encoded; it fails alone and nothing reaches the worker.

    ``code`` is stable: ``invalid_unicode`` (a string holds a lone UTF-16 surrogate),
    ``invalid_request`` (a number JSON cannot carry, e.g. NaN) or ``line_too_long`` (the
    encoded line exceeds the worker's ``max_line_bytes``). ``field`` names the offending
    request field (``prompt``, ``stop[1]``, ``prompt_segments[0].text``) when one is to
    blame, else None.
    """

    def __init__(self, code: str, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


# -- records (worker → parent) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker's first record: what it serves and how much it takes at once."""

    protocol: int
    engine: str
    model_name: str
    n_ctx: int
    n_vocab: int
    capacity: int  # generations the worker runs at once (slots)
    max_line_bytes: int  # longest request line it accepts, newline excluded
    max_batch_tokens: int  # per-step token budget (informational; 0 when not reported)
    capabilities: Mapping[str, Any]
    special_tokens: Mapping[str, Any]
    chat_template: str | None
    raw: Mapping[str, Any] = field(repr=False, compare=False)
    architecture: str | None = None  # the model's GGUF architecture (``model.architecture``)

    @property
    def supports_grammar(self) -> bool:
        """The worker enforces GBNF grammars (``capabilities.grammar``)."""
        return self.capabilities.get("grammar") is True

    @property
    def supports_unique_keys(self) -> bool:
        """The worker keeps JSON keys unique per object (``capabilities.unique_keys``)."""
        return self.capabilities.get("unique_keys") is True

    @property
    def supports_cancel(self) -> bool:
        return self.capabilities.get("supports_cancel") is True

    @property
    def multiplexed(self) -> bool:
        return self.capabilities.get("multiplexed") is True

    @property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle (prefix, suffix, middle) token ids, or None when the model
        has no complete set (``special_tokens.fim_*_id``, §3)."""
        ids = tuple(self.special_tokens.get(k) for k in ("fim_pre_id", "fim_suf_id", "fim_mid_id"))
        if all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_vocab for i in ids):
            return ids  # type: ignore[return-value]
        return None


@dataclass(frozen=True, slots=True)
class Token:
    """A piece of generated text (complete UTF-8, never empty) for generation ``id``."""

    id: int
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    """Terminal record of a generation that ended normally, by a stop, length or cancel."""

    id: int
    finish_reason: str
    cancelled: bool
    stop_string: str | None
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float | None  # worker read the generate → its first step
    ttft_ms: float | None  # worker read the generate → its first token record
    raw: Mapping[str, Any] = field(repr=False, compare=False)
    # Prompt tokens found resident in the slot (or restored from a spilled session): not
    # computed for this request. 0 when the worker did not say.
    reused_prompt_tokens: int = 0
    # The ids the generation sampled, in order, when the worker reports them (it omits them
    # when a stop string or a cancel cut the output: they would not match what was sent).
    generated_token_ids: tuple[int, ...] | None = None
    session_id: str | None = None  # the named session it ran in
    # Load reporting (spec §4.2): tokens resident over all slots after this generation (None:
    # the worker did not say); prompt tokens restored from a spilled session (None: nothing
    # was restored); whether admitting it evicted a session whose state was kept.
    resident_tokens: int | None = None
    restored_prompt_tokens: int | None = None
    spilled_session: bool = False
    # Self-speculative decoding (spec §4.6): draft tokens verified and accepted; None when the
    # generation was not drafted (speculation off, or a grammar / unique_keys stage).
    drafted_tokens: int | None = None
    accepted_draft_tokens: int | None = None

    @property
    def record(self) -> Mapping[str, Any]:
        """The whole record as the worker wrote it, for diagnostics only (the runtime's
        ``history``); code that acts on a field reads the typed one."""
        return self.raw


@dataclass(frozen=True, slots=True)
class Error:
    """An error for request ``id``; ``id`` is None when the worker could not parse a line
    far enough to find one (only a broken parent causes that)."""

    id: int | None
    code: str
    message: str
    details: Mapping[str, Any]  # every other field of the record (prompt_tokens, n_ctx, …)


@dataclass(frozen=True, slots=True)
class Pong:
    id: int


@dataclass(frozen=True, slots=True)
class Ack:
    id: int
    op: str
    session_id: str | None
    found: bool | None = None  # session_close/reset: the session was bound or spilled


@dataclass(frozen=True, slots=True)
class Tokens:
    """Reply to ``tokenize``: the ids, or with ``count_only`` just their number (``ids``
    then empty). ``count``: the number of tokens either way."""

    id: int
    ids: tuple[int, ...]
    count: int = -1

    def __post_init__(self) -> None:
        if self.count < 0:
            object.__setattr__(self, "count", len(self.ids))


@dataclass(frozen=True, slots=True)
class Detokenized:
    """Reply to ``detokenize``: the ids' text (invalid UTF-8 as U+FFFD) and, when asked
    for, each id's raw bytes."""

    id: int
    text: str
    pieces: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class StepPart:
    """One generation's part of a running step: ``tokens`` prompt tokens (``prefill``) or
    one decode token."""

    id: int
    prefill: bool
    tokens: int


@dataclass(frozen=True, slots=True)
class Progress:
    """A heartbeat from inside a long step (spec §4.4); answers no request.

    ``step`` numbers the worker's steps; ``work`` counts the engine's units of work over the
    worker's life (graph nodes computed; never decreasing, 0 when the engine counts none).
    The worker made progress since an earlier progress record when either differs.
    ``elapsed_ms``: how long the step has run; ``stalled_ms``: how long its counter has
    stood still; ``batch``: what the step holds.
    """

    step: int
    work: int
    elapsed_ms: float
    stalled_ms: float
    batch: tuple[StepPart, ...]

    def advanced_since(self, earlier: Progress | None) -> bool:
        """Whether the worker computed something since ``earlier`` (None: nothing seen yet)."""
        return earlier is None or self.step != earlier.step or self.work > earlier.work

    def describe(self) -> str:
        """The step in words for a log line: ``2 prefill pieces (256+256 tokens: ids 3, 4),
        1 decode (id 2); 513 tokens``."""
        pre = [p for p in self.batch if p.prefill]
        dec = [p for p in self.batch if not p.prefill]
        parts = []
        if pre:
            ids = ", ".join(str(p.id) for p in pre)
            parts.append(f"{len(pre)} prefill piece{'s' if len(pre) > 1 else ''} "
                         f"({'+'.join(str(p.tokens) for p in pre)} tokens: "
                         f"id{'s' if len(pre) > 1 else ''} {ids})")
        if dec:
            ids = ", ".join(str(p.id) for p in dec)
            parts.append(f"{len(dec)} decode{'s' if len(dec) > 1 else ''} "
                         f"(id{'s' if len(dec) > 1 else ''} {ids})")
        total = sum(p.tokens for p in self.batch)
        return f"{', '.join(parts) or 'empty'}; {total} tokens"


Record = Union[Ready, Token, Done, Error, Pong, Ack, Tokens, Detokenized, Progress]

# Records that end a generation: nothing for that id follows them.
TERMINAL = (Done, Error)


class _Signal(enum.Enum):
    NEED_DATA = "need data"  # no complete line buffered: feed more bytes
    CLOSED = "closed"  # the worker closed stdout between records


NEED_DATA: Final = _Signal.NEED_DATA
CLOSED: Final = _Signal.CLOSED


class _DecoderState(enum.Enum):
    AWAITING_READY = "awaiting ready"  # the first record must be a v2 ready record
    SERVING = "serving"  # every other record type; a second ready is a violation
    FAILED = "failed"  # a violation was raised; every later call raises again


class RecordDecoder:
    """Turns the worker's stdout bytes into records, h11 style.

    ``receive_data(data)`` buffers bytes (``b""`` means EOF); ``next_record()`` returns the
    next Record, ``NEED_DATA`` when no complete line is buffered, or ``CLOSED`` at EOF
    between records. Scanning is O(n) in the bytes received.

    Raises ProtocolViolation for: a line longer than ``max_record_bytes`` (raised as soon as
    that many bytes are buffered without a newline, so memory stays bounded), a line that is
    not a JSON object with a known string ``type``, a record whose fields have the wrong
    types, a first record that is not a ready record of protocol 2, a second ready record,
    and bytes of an unterminated record at EOF (the worker died mid-write). After a
    violation the decoder stays failed: every later call raises again.

    Unknown record *types* are violations rather than skipped: the parent and worker speak
    the same protocol version (checked on ready), and silently skipping a record that might
    have been some generation's terminal record would leave that generation waiting forever.
    Unknown *fields* are ignored (forward compatibility, spec §3).
    """

    def __init__(self, *, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.max_record_bytes = max_record_bytes
        self._buf = bytearray()
        self._scan_from = 0  # bytes before this offset hold no newline
        self._eof = False
        self._state = _DecoderState.AWAITING_READY
        self._failure: ProtocolViolation | None = None
        self._deferred: ProtocolViolation | None = None  # raised by the next next_records()

    def receive_data(self, data: bytes) -> None:
        if self._eof:
            raise RuntimeError("receive_data after EOF")
        if data:
            self._buf += data
        else:
            self._eof = True

    def next_record(self) -> Record | _Signal:
        if self._failure is not None:
            raise ProtocolViolation(f"decoder already failed: {self._failure}")
        try:
            return self._next_record()
        except ProtocolViolation as exc:
            self._state = _DecoderState.FAILED
            self._failure = exc
            raise

    def next_records(self) -> list[Record] | _Signal:
        """Every complete record buffered, in order (a non-empty list), or ``NEED_DATA`` /
        ``CLOSED`` as :meth:`next_record` when none is complete. The buffer is cut once for
        all of them (not once per record). A violation after good records is raised by the
        next call, so the good records (a step's tokens, say) are delivered first."""
        if self._deferred is not None:
            failure, self._deferred = self._deferred, None
            raise failure
        end = self._buf.rfind(b"\n")
        if end < 0 or self._state is not _DecoderState.SERVING:
            one = self.next_record()  # the ready record, and every "no complete line" case
            return one if isinstance(one, _Signal) else [one]
        chunk = bytes(self._buf[:end])
        del self._buf[: end + 1]
        self._scan_from = 0
        out: list[Record] = []
        for line in chunk.split(b"\n"):
            try:
                if len(line) > self.max_record_bytes:
                    raise ProtocolViolation(
                        f"worker wrote a line longer than {self.max_record_bytes} bytes")
                record = decode_record(line)
                if type(record) is Ready:
                    raise ProtocolViolation("worker sent a second ready record")
            except ProtocolViolation as exc:
                self._state = _DecoderState.FAILED
                self._failure = exc
                if not out:
                    raise
                self._deferred = exc
                return out
            out.append(record)
        return out

    def _next_record(self) -> Record | _Signal:
        nl = self._buf.find(b"\n", self._scan_from)
        if nl < 0:
            self._scan_from = len(self._buf)
            if len(self._buf) > self.max_record_bytes:
                raise ProtocolViolation(
                    f"worker wrote a line longer than {self.max_record_bytes} bytes")
            if not self._eof:
                return NEED_DATA
            if self._buf:
                raise ProtocolViolation(
                    f"worker closed stdout inside a record ({len(self._buf)} bytes unterminated: "
                    f"{bytes(self._buf[:200])!r})")
            return CLOSED
        if nl > self.max_record_bytes:
            raise ProtocolViolation(f"worker wrote a line longer than {self.max_record_bytes} bytes")
        line = bytes(self._buf[:nl])
        del self._buf[: nl + 1]
        self._scan_from = 0
        record = decode_record(line)
        if self._state is _DecoderState.AWAITING_READY:
            if not isinstance(record, Ready):
                raise ProtocolViolation(f"worker's first record is not 'ready': {line[:200]!r}")
            self._state = _DecoderState.SERVING
        elif isinstance(record, Ready):
            raise ProtocolViolation("worker sent a second ready record")
        return record


def decode_record(line: bytes) -> Record:
    """Decode one line (without its newline) into a typed record; ProtocolViolation if it is not one."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolViolation(f"worker wrote a line that is not JSON: {line[:200]!r}") from exc
    if type(obj) is dict and obj.get("type") == "token":
        # The hot path (one record per token): checked inline, same rules as _decode_token.
        rid, text = obj.get("id"), obj.get("text")
        if type(rid) is int and 1 <= rid <= MAX_REQUEST_ID and type(text) is str:
            return Token(rid, text)
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ProtocolViolation(f"worker wrote a record without a type: {line[:200]!r}")
    decode = _DECODERS.get(obj["type"])
    if decode is None:
        raise ProtocolViolation(f"worker wrote a record of unknown type {obj['type']!r}: {line[:200]!r}")
    try:
        return decode(obj)
    except _FieldError as exc:
        raise ProtocolViolation(f"malformed {obj['type']!r} record ({exc}): {line[:200]!r}") from None


class _FieldError(Exception):
    pass


def _field(obj: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = ...,
           nullable: bool = False) -> Any:
    """A typed field; bool is never accepted where a number is expected (JSON true ≠ 1)."""
    if name not in obj or (obj[name] is None and default is not ...):
        if default is ...:
            raise _FieldError(f"missing {name!r}")
        return default
    value = obj[name]
    if value is None and nullable:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _FieldError(f"{name!r} is a boolean")
    if not isinstance(value, kind):
        raise _FieldError(f"{name!r} has type {type(value).__name__}")
    return value


def _request_id_or_none(obj: Mapping[str, Any]) -> int | None:
    rid: int | None = _field(obj, "id", int, nullable=True)
    if rid is not None and not 1 <= rid <= MAX_REQUEST_ID:
        raise _FieldError(f"id {rid} out of range")
    return rid


def _request_id(obj: Mapping[str, Any]) -> int:
    rid: int = _field(obj, "id", int)
    if not 1 <= rid <= MAX_REQUEST_ID:
        raise _FieldError(f"id {rid} out of range")
    return rid


def _decode_ready(obj: dict[str, Any]) -> Ready:
    protocol = _field(obj, "protocol", int)
    if protocol != PROTOCOL_VERSION:
        raise ProtocolViolation(
            f"worker speaks protocol {protocol!r}; this server speaks {PROTOCOL_VERSION}")
    capacity = _field(obj, "capacity", int, default=1)
    max_line = _field(obj, "max_line_bytes", int, default=DEFAULT_MAX_LINE_BYTES)
    if capacity < 1 or max_line < 1:
        raise _FieldError("capacity and max_line_bytes must be positive")
    model = _field(obj, "model", dict, default=None) or {}
    return Ready(
        protocol=protocol,
        engine=_field(obj, "engine", str, default=""),
        model_name=str(model["name"]) if isinstance(model.get("name"), str) and model["name"] else "model",
        n_ctx=_field(obj, "n_ctx", int, default=0),
        n_vocab=_field(obj, "n_vocab", int, default=0),
        capacity=capacity,
        max_line_bytes=max_line,
        max_batch_tokens=_field(obj, "max_batch_tokens", int, default=0),
        capabilities=_field(obj, "capabilities", dict, default=None) or {},
        special_tokens=_field(obj, "special_tokens", dict, default=None) or {},
        chat_template=_field(obj, "chat_template", str, default=None) or None,
        raw=obj,
        architecture=model.get("architecture") if isinstance(model.get("architecture"), str) else None,
    )


def _decode_token(obj: dict[str, Any]) -> Token:
    return Token(id=_request_id(obj), text=_field(obj, "text", str))


def _decode_done(obj: dict[str, Any]) -> Done:
    return Done(
        id=_request_id(obj),
        finish_reason=_field(obj, "finish_reason", str),
        cancelled=_field(obj, "cancelled", bool, default=False),
        stop_string=_field(obj, "stop_string", str, default=None),
        prompt_tokens=_field(obj, "prompt_tokens", int, default=0),
        completion_tokens=_field(obj, "completion_tokens", int, default=0),
        queue_ms=_optional_float(obj, "queue_ms"),
        ttft_ms=_optional_float(obj, "ttft_ms"),
        raw=obj,
        reused_prompt_tokens=_field(obj, "reused_prompt_tokens", int, default=0),
        generated_token_ids=_token_ids(obj, "generated_token_ids"),
        session_id=_field(obj, "session_id", str, default=None),
        resident_tokens=_field(obj, "resident_tokens", int, default=None),
        restored_prompt_tokens=_field(obj, "restored_prompt_tokens", int, default=None),
        spilled_session=_field(obj, "spilled_session", bool, default=False),
        drafted_tokens=_field(obj, "drafted_tokens", int, default=None),
        accepted_draft_tokens=_field(obj, "accepted_draft_tokens", int, default=None),
    )


def _token_ids(obj: Mapping[str, Any], name: str) -> tuple[int, ...] | None:
    ids = _field(obj, name, list, default=None)
    if ids is None:
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _FieldError(f"{name!r} holds a non-integer")
    return tuple(ids)


def _optional_float(obj: Mapping[str, Any], name: str) -> float | None:
    value = _field(obj, name, (int, float), default=None)
    return None if value is None else float(value)


def _decode_error(obj: dict[str, Any]) -> Error:
    return Error(
        id=_request_id_or_none(obj),
        code=_field(obj, "code", str),
        message=_field(obj, "message", str, default=""),
        details={k: v for k, v in obj.items() if k not in ("type", "id", "code", "message")},
    )


def _decode_pong(obj: dict[str, Any]) -> Pong:
    return Pong(id=_request_id(obj))


def _decode_ack(obj: dict[str, Any]) -> Ack:
    found = obj.get("found")
    return Ack(id=_request_id(obj), op=_field(obj, "op", str),
               session_id=_field(obj, "session_id", str, default=None),
               found=found if isinstance(found, bool) else None)


def _decode_tokens(obj: dict[str, Any]) -> Tokens:
    if "ids" not in obj and "count" in obj:  # a count_only reply
        count = _field(obj, "count", int)
        if isinstance(count, bool) or count < 0:
            raise _FieldError("'count' must be a non-negative integer")
        return Tokens(id=_request_id(obj), ids=(), count=count)
    ids = _field(obj, "ids", list)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _FieldError("'ids' holds a non-integer")
    return Tokens(id=_request_id(obj), ids=tuple(ids))


def _decode_text(obj: dict[str, Any]) -> Detokenized:
    text = _field(obj, "text", str)
    pieces = _field(obj, "pieces", list, default=None)
    decoded: tuple[bytes, ...] | None = None
    if pieces is not None:
        try:
            decoded = tuple(bytes(p) for p in pieces)
        except (TypeError, ValueError):
            raise _FieldError("'pieces' must be lists of byte values") from None
    return Detokenized(id=_request_id(obj), text=text, pieces=decoded)


def _decode_progress(obj: dict[str, Any]) -> Progress:
    batch = []
    for item in _field(obj, "batch", list, default=None) or []:
        if not isinstance(item, dict):
            raise _FieldError("'batch' holds a non-object")
        kind = _field(item, "kind", str)
        if kind not in ("prefill", "decode"):
            raise _FieldError(f"batch kind {kind!r}")
        batch.append(StepPart(id=_request_id(item), prefill=kind == "prefill",
                              tokens=_field(item, "tokens", int)))
    step = _field(obj, "step", int)
    work = _field(obj, "work", int)
    if step < 0 or work < 0:
        raise _FieldError("'step' and 'work' must not be negative")
    return Progress(step=step, work=work,
                    elapsed_ms=float(_field(obj, "elapsed_ms", (int, float), default=0)),
                    stalled_ms=float(_field(obj, "stalled_ms", (int, float), default=0)),
                    batch=tuple(batch))


_DECODERS: dict[str, Callable[[dict[str, Any]], Record]] = {
    "ready": _decode_ready,
    "token": _decode_token,
    "done": _decode_done,
    "error": _decode_error,
    "pong": _decode_pong,
    "ack": _decode_ack,
    "tokens": _decode_tokens,
    "text": _decode_text,
    "progress": _decode_progress,
}


# -- requests (parent → worker) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextSegment:
    """Prompt text. ``special=False``: tokenized with special-token parsing off (user
    content: a typed ``<|im_start|>`` stays plain text); True: parsed (template text)."""

    text: str
    special: bool = True


@dataclass(frozen=True, slots=True)
class IdsSegment:
    """Token ids used verbatim."""

    ids: tuple[int, ...]


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
    fields = _request_fields(request)
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
    longest = len(body) + len('{"id":,') - 1 + _MAX_ID_DIGITS
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
            out.append({"text": seg.text, "special": seg.special})
        else:
            out.append({"ids": list(seg.ids)})
    return out


def _request_fields(request: Request) -> dict[str, Any]:
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
