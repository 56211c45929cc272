"""The typed events of one generation, and the fold that turns them into a whole answer.

The output pipeline (``core.pipeline``) turns worker text into these events; every API
adapter turns them into its own wire format: streaming adapters translate each event as it
comes, non-streaming ones (and the session replay) read the :class:`TurnResult` that
:class:`Accumulator` folds them into. So a stream and a whole response always say the same.

Order guarantees (what adapters may rely on):

- text and reasoning arrive as deltas, never empty;
- each tool call arrives as ``ToolCallStarted``, then one or more ``ToolCallArgumentsDelta``,
  then ``ToolCallDone``, before anything that follows it in the output; ``index`` counts the
  calls of the generation from 0;
- ``Finished`` comes last, exactly once, carrying the finish reason and the usage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Literal, Union

__all__ = [
    "TextDelta",
    "ReasoningDelta",
    "ToolCallStarted",
    "ToolCallArgumentsDelta",
    "ToolCallDone",
    "Usage",
    "FinishReason",
    "Finished",
    "Event",
    "TurnResult",
    "Accumulator",
]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Answer text (content) for the user."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Text of the model's reasoning block (never part of the answer)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    """A tool call begins: its position among the generation's calls, id and tool name."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    """A piece of the serialized JSON arguments of call ``index``."""

    index: int
    delta: str


@dataclass(frozen=True, slots=True)
class ToolCallDone:
    """Call ``index`` is complete; ``arguments`` is its whole serialized JSON object."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of the generation. ``cached_tokens``: prompt tokens the worker did not
    compute for this request (resident in its slot or restored from a spilled session), at
    most ``prompt_tokens``."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Self-speculative decoding (spec §8 "usage"): draft tokens the worker verified and
    # accepted; None when the generation was not drafted.
    drafted_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    # Where the prompt stopped matching its session (spec §12 "Divergence report"): the
    # usage extension ``trioserve_divergence``; None when it did not.
    divergence: Mapping[str, Any] | None = None

    @property
    def rejected_draft_tokens(self) -> int | None:
        if self.drafted_tokens is None:
            return None
        return max(0, self.drafted_tokens - (self.accepted_draft_tokens or 0))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True, slots=True)
class Finished:
    """The generation ended.

    ``reason``: ``length`` whenever the token budget (or the context) ended the turn, also
    after complete tool calls; else ``tool_calls`` when the answer holds calls; else ``stop``
    (end of turn, a stop string, or a cancel). ``stop_sequence``: the request's stop string
    that ended it, when one did. ``dropped_text``: output the pipeline did not return
    because the budget cut it inside an unfinished tool call.
    """

    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None
    dropped_text: str = ""


Event = Union[TextDelta, ReasoningDelta, ToolCallStarted, ToolCallArgumentsDelta, ToolCallDone,
              Finished]


@dataclass
class TurnResult:
    """A whole answer: the content, the reasoning, the calls in order, and (once the
    generation ended) its :class:`Finished` event."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDone] = field(default_factory=list)
    finished: Finished | None = None


class Accumulator:
    """Folds events into a :class:`TurnResult`; feed every event in order, read ``result``."""

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCallDone] = []
        self.finished: Finished | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            self._text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        elif isinstance(event, ToolCallDone):
            self._calls.append(event)
        elif isinstance(event, Finished):
            self.finished = event

    def extend(self, events: list[Event]) -> None:
        for event in events:
            self.add(event)

    @property
    def result(self) -> TurnResult:
        """What was folded so far (a fresh object on each read)."""
        return TurnResult("".join(self._text), "".join(self._reasoning), list(self._calls),
                          self.finished)
