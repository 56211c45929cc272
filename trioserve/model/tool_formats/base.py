"""The one interface every tool-call format implements, and the engine they share.

A format parser splits model output into *content* (text for the user) and *tool calls*
(OpenAI-shaped dicts, :func:`make_tool_call`). It is fed the output as it is generated and
answers, per delta, the content that can be sent now and the calls completed by that delta;
:meth:`ToolCallParser.parse` is the same machine fed once, so a stream and a whole text always
give the same content and the same calls.

Engine (shared by all formats): outside a call, text is content, except for

- a tail that could still be the start of one of the format's ``call_start_markers`` (held
  until the next delta tells), and
- trailing whitespace (held; dropped if a call follows, sent with the next text otherwise,
  dropped at the end of the output if any call was found).

At a start marker the format's :class:`BlockScanner` takes over and, as text arrives, answers
:data:`PENDING` (hold everything from the marker on), :class:`Accept` (these characters were
calls) or :class:`Reject` (these characters are content after all; scanning resumes right
after them, so a later marker still counts). Right after a call, the format's
``call_suffixes`` (e.g. a closing tag that is not needed to end the call) are dropped if they
come next, whitespace aside.

Degradation rules (small models get tool syntax wrong often): malformed markup, a call to an
undeclared tool, or a call cut off by the end of the output stays in the content verbatim,
markup included; nothing raises (deep nesting included: ``RecursionError`` is caught where
JSON is decoded or encoded) and no text is dropped except the markup of recognized calls and
the whitespace that only separated them from the content.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Protocol, TypedDict

from trioserve.model.stream_text import partial_marker_len
from trioserve.model.tool_formats.grammar import CallRules, GrammarPart, UnsupportedInFormat

__all__ = [
    "ToolCall",
    "ToolCallFunction",
    "ToolSchemas",
    "ToolCallParser",
    "ParseEvent",
    "BlockScanner",
    "Accept",
    "Reject",
    "PENDING",
    "make_tool_call",
    "tool_schemas",
]


class ToolCallFunction(TypedDict):
    name: str
    arguments: str  # a JSON object, serialized (OpenAI's wire format)


class ToolCall(TypedDict):
    """One call in OpenAI's ``message.tool_calls`` shape; a plain dict at runtime, so it can
    be put in a response as is."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


ParseEvent = str | ToolCall
"""One item of :meth:`ToolCallParser.feed_events`: released content (a non-empty ``str``) or
a completed call (a :class:`ToolCall` dict)."""

ToolSchemas = Mapping[str, Mapping[str, Any] | None]
"""Declared tools: name -> JSON schema of the parameters (``function.parameters``), or None
when the tool declares none."""


def make_tool_call(name: str, arguments: dict[str, Any]) -> ToolCall:
    """A call with a fresh ``call_<24 hex>`` id and ``arguments`` serialized with non-ASCII
    kept (``ensure_ascii=False``), as OpenAI does. Raises ``RecursionError`` on arguments
    nested too deeply to encode; parsers use :func:`build_call`, which does not."""
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def build_call(name: str, arguments: dict[str, Any]) -> ToolCall | None:
    """:func:`make_tool_call`, or None if the arguments cannot be encoded (too deep)."""
    try:
        return make_tool_call(name, arguments)
    except (RecursionError, ValueError):
        return None


def tool_schemas(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any] | None]:
    """The :data:`ToolSchemas` of a request's normalized ``tools`` list
    (``[{"type": "function", "function": {"name", "parameters"?}}]``); ``{}`` for None."""
    return {t["function"]["name"]: t["function"].get("parameters") for t in tools or ()}


# --- scanner results ------------------------------------------------------------------------


class _Pending:
    __slots__ = ()

    def __repr__(self) -> str:
        return "PENDING"


PENDING: Final = _Pending()
"""The block is not resolved yet: hold it and call ``step`` again with more text."""


@dataclass(frozen=True, slots=True)
class Accept:
    """``buf[:end]`` was one or more calls (in order); its text is dropped."""

    end: int
    calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class Reject:
    """``buf[:end]`` is content after all (``end >= 1``); scanning resumes at ``end``."""

    end: int


StepResult = _Pending | Accept | Reject


class BlockScanner(Protocol):
    """Resolves one candidate call that starts at a start marker.

    ``step(buf, eof)`` is called with the text from the marker on (``buf`` only ever grows
    between calls to the same scanner, so a scanner may keep positions into it), after each
    delta and once more with ``eof=True`` at the end of the output, when it must not answer
    :data:`PENDING`. A scanner is used for one block only.
    """

    def step(self, buf: str, eof: bool) -> StepResult: ...


# --- the parser ------------------------------------------------------------------------------


class ToolCallParser(ABC):
    """Base class of every tool-call format: incremental, never raises on model output.

    Class attributes (read by the model-profile registry):

    - ``format_name``: the registry name (``hermes``, ``qwen_xml``, ``gemma4``,
      ``llama3_json``, ``mistral``).
    - ``call_start_markers``: the literal strings at which a call can start; text is held
      back only while it could still be one of them.
    - ``markers``: every marker string the format reads (tags, special tokens, string
      delimiters; not JSON punctuation). They must reach the parser as text: a detokenizer
      that hides special tokens would make calls invisible.
    - ``call_suffixes``: markup dropped when it directly follows a call (whitespace aside).
    - ``constrained_calls_are_json``: the calls :meth:`constrain` admits are JSON with markup
      around them that holds no quote and only balanced brackets, so the worker can keep their
      objects free of repeated keys (``unique_keys``, spec §5.6); False for raw-text syntaxes.

    Usage: construct one parser per generation with the request's declared tools, call
    :meth:`feed` with each text delta and :meth:`finish` once at the end; or call
    :meth:`parse` once on a complete text. Calls to names not in ``tools`` are content.
    """

    format_name: ClassVar[str]
    call_start_markers: ClassVar[tuple[str, ...]]
    markers: ClassVar[tuple[str, ...]]
    call_suffixes: ClassVar[tuple[str, ...]] = ()
    constrained_calls_are_json: ClassVar[bool] = False

    @classmethod
    def constrain(cls, calls: Sequence[CallRules], parallel: bool) -> GrammarPart:
        """GBNF for calls in this format to one of ``calls`` (one call, or one or more
        when ``parallel``), written exactly as :meth:`parse` reads them back.

        Raises:
            UnsupportedInFormat: a parameter schema this syntax cannot enforce.
        """
        raise UnsupportedInFormat(f"constraining {cls.format_name} tool calls is not supported",
                                  "tool_choice")

    def __init__(self, tools: ToolSchemas) -> None:
        """``tools``: name -> JSON schema of its parameters (None if it declares none); see
        :func:`tool_schemas`. Formats that coerce argument values (Qwen XML) read the
        schemas; the others only the names."""
        if not isinstance(tools, Mapping):
            raise TypeError("tools must map each tool name to its parameters schema (or None); "
                            "see tool_schemas()")
        self.tools: Mapping[str, Mapping[str, Any] | None] = dict(tools)
        self._buf = ""  # unresolved text: a held marker prefix, or the current block
        self._block: BlockScanner | None = None
        self._ws = ""  # trailing whitespace of the content, not yet sent
        self._after_call = False  # only whitespace since the last call: suffixes may follow
        self._any_calls = False
        self._finished = False

    # --- public interface --------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Consume a delta. Returns ``(content, calls)``: the content that can be sent now
        (may be empty) and the calls completed by this delta, in output order. Raises
        ``RuntimeError`` after :meth:`finish` (a caller bug, never model output)."""
        return _split(self.feed_events(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: returns the remaining content and the calls completed by it (a
        block that is a complete call although its closing tag never came). Whatever is
        still unresolved is content. Raises ``RuntimeError`` if called twice."""
        return _split(self.finish_events())

    def feed_events(self, text: str) -> list[ParseEvent]:
        """:meth:`feed` with content and calls interleaved in output order: a delta that
        holds the rest of one call, some text and a second call gives ``[call, text,
        call]``, so a stream can send each call before the content that follows it.
        Content items are non-empty; consecutive ones are not merged."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        events: list[ParseEvent] = []
        self._run(events, eof=False)
        return events

    def finish_events(self) -> list[ParseEvent]:
        """:meth:`finish` in output order (see :meth:`feed_events`)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        events: list[ParseEvent] = []
        self._run(events, eof=True)
        if not self._any_calls and self._ws:
            events.append(self._ws)  # no call follows: the whitespace was content after all
        self._ws = ""
        return events

    def preview(self) -> tuple[str, str] | None:
        """The first call of the block being read, as far as it is certain: ``(name,
        arguments_prefix)`` where ``name`` is a declared tool and ``arguments_prefix`` is a
        prefix of the ``arguments`` the call will have *if* the block is accepted with it
        first. None when no block is open, its head is not complete yet, or the format gives
        no preview. Only sound to stream where the block cannot be rejected (a grammar holds
        the output to calls; spec §10 "Streamed arguments")."""
        if self._block is None:
            return None
        return self._preview(self._block, self._buf)

    def _preview(self, block: BlockScanner, buf: str) -> tuple[str, str] | None:
        """Format hook for :meth:`preview`; ``buf`` is the open block's text from its marker."""
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split a complete output: :meth:`feed` once, then :meth:`finish`. Use on a fresh
        parser (it finishes it). ``content`` equals ``text`` when there are no calls."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        return content + rest, calls + more

    # --- for subclasses -------------------------------------------------------------------

    @abstractmethod
    def _open_block(self, marker: str) -> BlockScanner:
        """A scanner for a block that starts with ``marker`` (one of the start markers)."""

    # --- engine ---------------------------------------------------------------------------

    def _run(self, out: list[ParseEvent], eof: bool) -> None:
        """Resolve what ``_buf`` allows; content and calls go to ``out`` in output order."""
        while True:
            if self._block is not None:
                if not self._step_block(out, eof):
                    return
            elif self._after_call and self.call_suffixes and self._take_suffix(eof):
                if self._after_call:  # a suffix may still come: hold what is left
                    return
            elif not self._scan_content(out, eof):
                return

    def _scan_content(self, out: list[ParseEvent], eof: bool) -> bool:
        """Send content up to the next start marker and open its block; True if one opened."""
        buf = self._buf
        best, best_marker = -1, ""
        for marker in self.call_start_markers:
            i = buf.find(marker)
            if i >= 0 and (best < 0 or i < best or (i == best and len(marker) > len(best_marker))):
                best, best_marker = i, marker
        if best < 0:
            keep = 0 if eof else partial_marker_len(buf, self.call_start_markers)
            self._emit(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep :]
            return False
        self._emit(buf[:best], out)
        self._buf = buf[best:]
        self._block = self._open_block(best_marker)
        return True

    def _take_suffix(self, eof: bool) -> bool:
        """Right after a call: drop a suffix that comes next. Returns True if it consumed or
        must hold text (``_after_call`` still set means: hold, wait for more)."""
        stripped = self._buf.lstrip()
        lead = self._buf[: len(self._buf) - len(stripped)]
        for suffix in self.call_suffixes:
            if stripped.startswith(suffix):
                self._buf = stripped[len(suffix) :]
                self._ws = ""  # it only separated the call from its suffix
                self._after_call = False
                return True
        if not eof and any(s.startswith(stripped) for s in self.call_suffixes):
            self._emit(lead, [])  # whitespace only: held in _ws, nothing is sent
            self._buf = stripped
            return True
        # Something else follows: it ends the window once it is sent as content (or it is
        # another call, which opens a new window).
        return False

    def _step_block(self, out: list[ParseEvent], eof: bool) -> bool:
        """Advance the open block; True if it resolved (scanning continues)."""
        assert self._block is not None
        result = self._block.step(self._buf, eof)
        if isinstance(result, Accept):
            out.extend(result.calls)
            self._buf = self._buf[result.end :]
            self._ws = ""  # it only separated the content from this call
            self._any_calls = self._after_call = True
        elif isinstance(result, Reject):
            assert result.end >= 1, "a rejected block must release at least one character"
            self._emit(self._buf[: result.end], out)
            self._buf = self._buf[result.end :]
        elif eof:  # a scanner bug; still never drop the text
            self._emit(self._buf, out)
            self._buf = ""
        else:
            return False
        self._block = None
        return True

    def _emit(self, text: str, out: list[ParseEvent]) -> None:
        """Send content, holding back its trailing whitespace."""
        if not text:
            return
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            out.append(body)
            self._after_call = False


def _split(events: list[ParseEvent]) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of an event list: all its text joined, all its calls."""
    return ("".join(e for e in events if isinstance(e, str)),
            [e for e in events if not isinstance(e, str)])
