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

The codec is three modules, re-exported here as one: ``wire_records`` (constants, errors,
the records), ``record_decoder`` (bytes → records), ``wire_requests`` (requests → bytes).
"""

from __future__ import annotations

from trioserve.worker.record_decoder import CLOSED, NEED_DATA, RecordDecoder, decode_record
from trioserve.worker.wire_records import (
    CANCEL_FRAME,
    DEFAULT_MAX_LINE_BYTES,
    MAX_RECORD_BYTES,
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    TERMINAL,
    Ack,
    Detokenized,
    Done,
    Error,
    Pong,
    Progress,
    ProtocolViolation,
    Ready,
    Record,
    RequestRejected,
    StepPart,
    Token,
    Tokens,
    WorkerError,
    WorkerExited,
    WorkerHung,
)
from trioserve.worker.wire_requests import (
    Detokenize,
    Generate,
    GenerateParams,
    IdsSegment,
    Ping,
    PreparedRequest,
    Request,
    Segment,
    SessionClose,
    SessionOpen,
    SessionReset,
    Shutdown,
    TextSegment,
    Tokenize,
    encode_cancel,
    prepare,
    request_fields,
)

__all__ = [
    "PROTOCOL_VERSION", "DEFAULT_MAX_LINE_BYTES", "MAX_RECORD_BYTES", "MAX_REQUEST_ID",
    "WorkerError", "WorkerExited", "WorkerHung", "ProtocolViolation", "RequestRejected",
    "Ready", "Token", "Done", "Error", "Pong", "Ack", "Tokens", "Detokenized", "Progress",
    "StepPart", "Record",
    "RecordDecoder", "NEED_DATA", "CLOSED",
    "TextSegment", "IdsSegment", "GenerateParams", "Generate", "Ping", "Tokenize", "Detokenize",
    "SessionOpen", "SessionClose", "SessionReset", "Shutdown", "Request",
    "PreparedRequest", "prepare", "encode_cancel",
    "CANCEL_FRAME", "TERMINAL", "Segment", "decode_record", "request_fields",
]
