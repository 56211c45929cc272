"""Split a thinking model's ``<think>…</think>`` block out of its output (spec §11).

The reasoning text goes to ``reasoning_content``, never into ``content``. A block counts
only at the very start of the output (leading whitespace allowed), or when the rendered
prompt itself ends inside an opened ``<think>`` (templates such as Qwen3's open the block
for the model). Anything else is content, verbatim: a model that merely mentions the tag
later in its answer is not reinterpreted.

``ReasoningSplitter.feed`` is incremental for streaming: it holds back only text that
could still turn out to be (part of) a tag.
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"


class ReasoningSplitter:
    """Feed output text; get ``(reasoning_delta, content_delta)`` pairs back."""

    def __init__(self, *, prompt: str = "") -> None:
        tail = prompt.rstrip()
        # "start": may still see an opening tag; "think": inside the block; "after": just
        # closed, dropping separator newlines; "content": the answer.
        self._state = "think" if tail.endswith(OPEN) else "start"
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == "content":  # the hot path once any block is over
            return "", text
        self._pending += text
        reasoning, content = [], []
        while self._pending:
            if self._state == "start":
                stripped = self._pending.lstrip()
                if stripped.startswith(OPEN):
                    self._pending = stripped[len(OPEN):]
                    self._state = "think"
                elif OPEN.startswith(stripped):
                    break  # still could be the opening tag (or only whitespace so far)
                else:
                    self._state = "content"
            elif self._state == "think":
                end = self._pending.find(CLOSE)
                if end >= 0:
                    reasoning.append(self._pending[:end])
                    self._pending = self._pending[end + len(CLOSE):]
                    self._state = "after"
                    continue
                keep = _partial_suffix(self._pending, CLOSE)
                reasoning.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            elif self._state == "after":
                # Templates put newlines between the block and the answer; they belong to
                # neither, whichever piece they arrive in.
                self._pending = self._pending.lstrip("\n")
                if self._pending:
                    self._state = "content"
            else:
                content.append(self._pending)
                self._pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the output."""
        pending, self._pending = self._pending, ""
        if self._state == "think":
            return pending, ""  # an unclosed block is still reasoning, never content
        return "", pending


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, *, prompt: str = "") -> tuple[str, str]:
    """Non-streaming form: ``(reasoning, content)`` of a complete output."""
    splitter = ReasoningSplitter(prompt=prompt)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2
