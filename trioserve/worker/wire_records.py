"""Worker protocol v2: its constants, the error types and the records a worker writes.

The typed, frozen values of ``spec/worker-protocol.md`` §3-§4 (worker → parent) and the
errors that say whose fault a failure is (``trioserve.worker.protocol`` has the tree).
No I/O, no parsing: ``record_decoder`` makes these from bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

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
MAX_ID_DIGITS = len(str(MAX_REQUEST_ID))
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
