"""Where a prompt's state is worth keeping: the positions at which agent prompts diverge, told to
the worker as checkpoint marks on the prompt's segments (spec §6.3, worker protocol §6.3).

A recurrent (or small sliding-window) state cannot be cut back, so a later prompt that leaves
the slot's ids at position p resumes only from a checkpoint at or before p. The worker always
keeps one at a prompt's end; the control plane knows, from the rendered template, two more
places where the next prompts leave this one:

* the end of the leading system messages and tools: other sessions of the same agent (and
  its sub-agents) share exactly that prefix;
* the start of the answer: a thinking model's template drops the turn's reasoning when the
  conversation goes on, and some open ``<think>`` in the generation prompt itself, so the next
  prompt leaves this one right after the turn's header (``<|im_start|>assistant\n``).

Both are found by rendering the conversation again (with only the leading system messages;
without the generation prompt; with a stand-in answer, whose common prefix with the prompt is
where the next prompt leaves it) and keeping a render only when it is a prefix of the prompt; a template that renders them otherwise, or raises, gets no mark there (the prompt-end
checkpoint still works). Marks are measured from the prompt's start (system end) or its end
(turn start), so token-id replay of assistant turns between them, which changes the text in
the middle, does not move them. A mark never follows whitespace (it moves back before it: a
tokenizer merges whitespace with what follows, so the next prompt's ids would differ there).
Pure: no I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from trioserve.model.template_errors import TemplateError
from trioserve.worker.protocol import Segment, TextSegment

__all__ = ["CheckpointMarks", "find_marks", "mark_segments"]

SYSTEM_ROLES = frozenset({"system", "developer"})
_ANSWER = "\u2063"  # a stand-in answer no generation prompt continues with (INVISIBLE SEPARATOR)


@dataclass(frozen=True)
class CheckpointMarks:
    """Checkpoint positions in characters of the rendered prompt: ``from_start`` counted from
    its first character, ``from_end`` from its last (None: no mark)."""

    from_start: int | None = None
    from_end: int | None = None


def find_marks(render: Callable[[list[dict[str, Any]], bool], str], messages: list[dict[str, Any]],
               prompt: str) -> CheckpointMarks:
    """The marks of ``prompt``, which is ``render(messages, True)``.

    ``render(messages, add_generation_prompt)`` renders with the request's tools and template
    variables. A mark is kept only strictly inside the prompt (its two ends need none)."""
    def prefix_length(msgs: list[dict[str, Any]]) -> int | None:
        try:
            text = render(msgs, False)
        except (TemplateError, ValueError):
            return None
        return len(text) if 0 < len(text) < len(prompt) and prompt.startswith(text) else None

    n_system = 0
    while n_system < len(messages) and messages[n_system].get("role") in SYSTEM_ROLES:
        n_system += 1
    system_end = prefix_length(messages[:n_system]) if 0 < n_system < len(messages) else None
    turn_start = prefix_length(messages)
    if turn_start is not None:
        # The next prompt renders this turn's answer as a plain assistant message: it leaves
        # this one where that render stops matching, which may be past the turn's header.
        try:
            answered = render([*messages, {"role": "assistant", "content": _ANSWER}], False)
        except (TemplateError, ValueError):
            answered = ""
        common = len(os.path.commonprefix([prompt, answered]))
        if turn_start < common < len(prompt):
            turn_start = common
    system_end, turn_start = _before_whitespace(prompt, system_end), _before_whitespace(prompt, turn_start)
    return CheckpointMarks(from_start=system_end,
                           from_end=len(prompt) - turn_start if turn_start is not None else None)


def _before_whitespace(prompt: str, mark: int | None) -> int | None:
    """``mark`` moved back before the whitespace it follows. WHY: a checkpoint is found again by
    token ids, and a tokenizer merges a run of whitespace with what comes next: the ``\n``
    that ends ``<|im_start|>assistant\n`` here is ``\n\n`` in the next prompt when the answer
    is rendered after a blank line (Qwen3.5's tool calls), so a mark after it would never be a
    prefix of the next prompt's ids. Before the whitespace the ids are the same in both."""
    if mark is None:
        return None
    while mark > 0 and prompt[mark - 1] in " \t\r\n":
        mark -= 1
    return mark if mark > 0 else None


def mark_segments(segments: Sequence[Segment], marks: CheckpointMarks, shift: int = 0,
                  tail: int = 0) -> tuple[Segment, ...]:
    """``segments`` split at the marks, the segment that ends at each one flagged
    ``checkpoint``. ``shift``: characters the segments' text has more than the rendered prompt
    at its start (a BOS the profile added); ``tail``: characters appended after it (an answer
    prefix). Positions count text characters only: an ids segment (a replayed turn) counts
    none, so a mark from the start goes before the ids segments at its position and a mark
    from the end after them. A mark at either end of the prompt is dropped."""
    total = sum(len(s.text) for s in segments if isinstance(s, TextSegment))
    wanted = [(p, late) for p, late in ((None if marks.from_start is None else marks.from_start + shift, False),
                                        (None if marks.from_end is None else total - tail - marks.from_end, True))
              if p is not None and 0 < p < total]
    # Split text segments at every mark strictly inside them.
    pieces: list[Segment] = []
    pos = 0
    for seg in segments:
        if not isinstance(seg, TextSegment):
            pieces.append(seg)
            continue
        start = 0
        for cut in sorted({p - pos for p, _ in wanted if pos < p < pos + len(seg.text)}):
            pieces.append(replace(seg, text=seg.text[start:cut]))
            start = cut
        pieces.append(replace(seg, text=seg.text[start:]))
        pos += len(seg.text)
    # Flag the piece that ends at each mark: the first such (from the start), the last (from the end).
    ends, pos = [], 0
    for seg in pieces:
        pos += len(seg.text) if isinstance(seg, TextSegment) else 0
        ends.append(pos)
    for p, late in wanted:
        at = [k for k, end in enumerate(ends) if end == p]
        if at:
            k = at[-1] if late else at[0]
            pieces[k] = replace(pieces[k], checkpoint=True)
    return tuple(pieces)
