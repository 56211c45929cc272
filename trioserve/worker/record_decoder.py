"""Worker stdout bytes → typed records (``spec/worker-protocol.md`` §3-§4), sans-IO.

``RecordDecoder`` buffers what the worker wrote and hands back the records of
``trioserve.worker.wire_records``, one at a time or every complete one at once; every
malformed line is a ``ProtocolViolation``.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any, Callable, Final, Mapping

from trioserve.worker.wire_records import (
    MAX_RECORD_BYTES,
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    DEFAULT_MAX_LINE_BYTES,
    Ack,
    Detokenized,
    Done,
    Error,
    Pong,
    Progress,
    ProtocolViolation,
    Ready,
    Record,
    StepPart,
    Token,
    Tokens,
)

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


# The token record exactly as the worker writes it (cpp/records.h ``write_token``), up to
# the opening quote of its text. One per token per stream, so it skips ``json.loads`` (whose
# Python-level encoding detection and decoder dispatch cost more than the parse): ~3 µs
# against ~6.5 µs a record. Anything else, or any doubt, takes the general path below.
# json's own string scanner (the C one where built), the one json.loads uses.
scanstring: Callable[[str, int, bool], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_TOKEN_HEAD = re.compile(rb'\{"type":"token","id":([1-9][0-9]{0,15}),"text":"')


def _token_fast(line: bytes) -> Token | None:
    """The Token of a line of exactly ``{"type":"token","id":N,"text":"..."}``, decoded as
    ``json.loads`` would; None for any other line (including every malformed one)."""
    head = _TOKEN_HEAD.match(line)
    if head is None or not line.endswith(b'"}'):
        return None
    rid = int(head.group(1))
    if rid > MAX_REQUEST_ID:
        return None
    try:
        quoted = line[head.end() - 1:-1].decode()  # strict UTF-8: json.loads passes surrogates
        text, end = scanstring(quoted, 1, True)  # json.loads' own string scanner, strict
    except ValueError:  # (UnicodeDecodeError is one)
        return None
    # The string must end exactly where the line's closing brace begins.
    return Token(rid, text) if end == len(quoted) else None


def decode_record(line: bytes) -> Record:
    """Decode one line (without its newline) into a typed record; ProtocolViolation if it is not one."""
    if line.startswith(b'{"type":"token"') and (token := _token_fast(line)) is not None:
        return token
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
