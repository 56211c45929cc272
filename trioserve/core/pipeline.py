"""The output pipeline: worker text in, typed events (``core.events``) out.

One instance per generation. Each piece of text the worker sent goes, in order, through

1. the stop guard (a control-plane backstop: the worker already never emits a stop string;
   this re-checks across piece boundaries and cuts if one slipped through),
2. the reasoning splitter (the profile's thinking markers, spec §11),
3. the profile's tool-call parser, when tools are enabled (spec §10),

and comes out as :class:`TextDelta` / :class:`ReasoningDelta` / tool-call events. ``finish``
flushes what was held back and decides the ending (:class:`Finished`). Streaming, whole
responses and the session replay all read these same events, so they cannot disagree.

Exact endings (spec §10, "Endings"):

- the finish reason is ``length`` whenever the worker says the token budget (or the context)
  ended the generation — also when complete tool calls came before;
- text the parser still holds when the budget ended it — an opened call block, or the start
  of a call marker — is an unfinished tool call: it is dropped, never returned as content
  (``Finished.dropped_text`` says what was dropped, for logs and the replay);
- with ``single_call`` (``parallel_tool_calls: false`` / ``disable_parallel_tool_use``), the
  first complete call ends the answer: nothing after it is returned (``call_limit_hit``: the
  caller stops the generation, as for a stop string), and the finish reason is
  ``tool_calls`` (spec §10, "At most one call").

Pure and synchronous: no I/O, no clock; the async driver is ``core.serving.Turn``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

from trioserve.model.reasoning import ReasoningSplitter
from trioserve.model.stream_text import partial_marker_len
from trioserve.model.tool_formats import ParseEvent, ToolCallParser
from trioserve.worker.protocol import Done
from trioserve.core.events import (
    Event,
    Finished,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)

__all__ = ["StopGuard", "OutputPipeline", "usage_of", "new_call_id"]

log = logging.getLogger("trioserve.pipeline")


def new_call_id() -> str:
    """A fresh ``call_<24 hex>`` id (the parsers' form, ``tool_formats.make_tool_call``)."""
    return "call_" + secrets.token_hex(12)


class StopGuard:
    """Cuts the output at the first stop string, across piece boundaries. ``hit`` is the stop
    string that matched (None until one does); everything after it is dropped."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.tail = ""
        self.hit: str | None = None

    def feed(self, piece: str) -> str:
        if self.hit is not None:
            return ""
        if not self.stops:
            return piece
        window = self.tail + piece
        found = [(i, s) for s in self.stops if (i := window.find(s)) >= 0]
        if found:
            cut, stop = min(found)
            self.hit = stop
            return piece[: max(0, cut - len(self.tail))]
        self.tail = window[-self.keep:] if self.keep else ""
        return piece


def usage_of(done: Done | None) -> Usage:
    """The usage of a generation's terminal record (zeros when none arrived)."""
    if done is None:
        return Usage()
    prompt = done.prompt_tokens
    cached = max(0, min(done.reused_prompt_tokens, prompt))
    return Usage(prompt_tokens=prompt, completion_tokens=done.completion_tokens,
                 cached_tokens=cached, drafted_tokens=done.drafted_tokens,
                 accepted_draft_tokens=done.accepted_draft_tokens)


class OutputPipeline:
    """Turns one generation's text into events.

    Args:
        stops: every stop string in force (the request's and the profile's).
        request_stops: the request's own stop strings (``Finished.stop_sequence`` names one
            of these only; a profile's end-of-turn string is a plain ``stop``).
        prompt: the rendered prompt (its end may already open a reasoning block).
        reasoning_markers: ``(start, end)`` of the reasoning block, or None.
        tool_parser: a fresh parser of the profile's format for the declared tools, or None
            when calls are not parsed (no tools, or ``tool_choice: "none"``).
        single_call: at most one tool call: the first complete call ends the output.
        stream_arguments: send a call's arguments as they are written (its start once its
            tool name is known, then pieces of the canonical arguments; spec §10 "Streamed
            arguments"). Only where a grammar holds the output to valid calls: a block the
            parser later rejected would have been half-sent as a call.
    """

    def __init__(self, *, stops: Sequence[str], request_stops: Sequence[str] = (),
                 prompt: str = "", reasoning_markers: tuple[str, str] | None = None,
                 tool_parser: ToolCallParser | None = None, single_call: bool = False,
                 stream_arguments: bool = False) -> None:
        self.guard = StopGuard(stops)
        self._stream_arguments = stream_arguments and tool_parser is not None
        # The call being streamed: (index, call id, arguments sent so far).
        self._streaming: tuple[int, str, str] | None = None
        self._single_call = single_call and tool_parser is not None
        self.call_limit_hit = False
        self._request_stops = frozenset(request_stops)
        self._thinking = ReasoningSplitter(prompt=prompt, markers=reasoning_markers)
        self._tools = tool_parser
        self._calls = 0  # calls started (their indexes)
        self._done_calls = 0
        self._finished = False

    @property
    def stop_hit(self) -> bool:
        """A stop string cut the output, or the one allowed call is complete: the caller
        stops the generation (nothing after it is ever sent)."""
        return self.guard.hit is not None or self.call_limit_hit

    def feed(self, piece: str) -> list[Event]:
        """The events of one piece of worker text (may be none: text is held while it could
        still be a marker)."""
        if self.call_limit_hit:
            return []
        reasoning, text = self._thinking.feed(self.guard.feed(piece))
        out: list[Event] = []
        if reasoning:
            out.append(ReasoningDelta(reasoning))
        if self._tools is None:
            if text:
                out.append(TextDelta(text))
        else:
            self._parsed(self._tools.feed_events(text), out)
            if self._stream_arguments and not self.call_limit_hit:
                self._preview(out)
        return out

    def _preview(self, out: list[Event]) -> None:
        """Start the call being written and send its new argument text (stream_arguments)."""
        assert self._tools is not None
        preview = self._tools.preview()
        if preview is None:
            return
        name, prefix = preview
        if self._streaming is None:
            index, call_id = self._calls, new_call_id()
            self._calls += 1
            out.append(ToolCallStarted(index, call_id, name))
            self._streaming = (index, call_id, "")
        index, call_id, sent = self._streaming
        if len(prefix) > len(sent) and prefix.startswith(sent):
            out.append(ToolCallArgumentsDelta(index, prefix[len(sent):]))
            self._streaming = (index, call_id, prefix)

    def finish(self, done: Done | None) -> list[Event]:
        """Flush held text and end: the last events, :class:`Finished` last. ``done`` is the
        worker's terminal record (None when none arrived, e.g. a stop-string cut whose
        cancel was not confirmed). Raises RuntimeError if called twice."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out: list[Event] = []
        reasoning, rest = self._thinking.finish()
        if reasoning and not self.call_limit_hit:
            out.append(ReasoningDelta(reasoning))
        budget_ended = (self.guard.hit is None and not self.call_limit_hit and done is not None
                        and not done.cancelled and done.finish_reason == "length")
        dropped = ""
        if self.call_limit_hit:
            pass  # the answer ended with its one call; what the worker sent after it is not output
        elif self._tools is None:
            if rest:
                out.append(TextDelta(rest))
        else:
            events = self._tools.feed_events(rest) + self._tools.finish_events()
            if budget_ended:
                events, dropped = _drop_unfinished_call(events, self._tools.call_start_markers)
            self._parsed(events, out)
        reason: FinishReason = ("length" if budget_ended else "tool_calls" if self._done_calls
                                else "stop")
        stop = self.guard.hit
        if stop is None and done is not None and not done.cancelled and not self.call_limit_hit:
            stop = done.stop_string
        out.append(Finished(reason=reason, usage=usage_of(done),
                            stop_sequence=stop if stop in self._request_stops else None,
                            dropped_text=dropped))
        return out

    def _parsed(self, events: list[ParseEvent], out: list[Event]) -> None:
        for event in events:
            if self.call_limit_hit:
                return  # single_call: nothing after the one call is output
            if isinstance(event, str):
                if self._streaming is not None:
                    # Only a grammar-held output streams arguments, and it cannot write a
                    # block the parser rejects; should it happen, say so in the log.
                    log.error("a streamed tool call's block was not accepted as a call")
                    self._streaming = None
                out.append(TextDelta(event))
                continue
            function = event["function"]
            arguments = function["arguments"]
            if self._streaming is not None:
                index, call_id, sent = self._streaming
                self._streaming = None
                if not arguments.startswith(sent):
                    log.error("streamed arguments of call %d are not a prefix of the call's "
                              "arguments", index)
                    sent = ""
                rest = arguments[len(sent):]
                if rest:
                    out.append(ToolCallArgumentsDelta(index, rest))
            else:
                index, call_id = self._calls, event["id"]
                self._calls += 1
                out.append(ToolCallStarted(index, call_id, function["name"]))
                out.append(ToolCallArgumentsDelta(index, arguments))
            out.append(ToolCallDone(index, call_id, function["name"], arguments))
            self._done_calls += 1
            if self._single_call:
                self.call_limit_hit = True


def _drop_unfinished_call(events: list[ParseEvent],
                          markers: Sequence[str]) -> tuple[list[ParseEvent], str]:
    """Cut the content that ends the output from the first call start marker on (an opened,
    unfinished call block), or a trailing partial marker. Only text the parser released at
    the end can hold such a block (it holds every block until it resolves), so earlier
    content is never touched. Returns the kept events and the dropped text."""
    last_call = max((i for i, e in enumerate(events) if not isinstance(e, str)), default=-1)
    head = events[: last_call + 1]
    tail = "".join(e for e in events[last_call + 1:] if isinstance(e, str))
    cut = min((i for i in (tail.find(m) for m in markers) if i >= 0), default=-1)
    if cut < 0:
        body = tail.rstrip()
        cut = len(body) - partial_marker_len(body, markers) if body else 0
        if cut == len(body):
            return events, ""
    kept = tail[:cut].rstrip()  # the whitespace only separated it from the call
    return head + ([kept] if kept else []), tail[cut:]
