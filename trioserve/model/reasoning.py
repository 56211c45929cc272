"""Split a thinking model's reasoning block out of its output (spec §11).

The block is delimited by the model profile's markers (``<think>``/``</think>`` by default;
Gemma 4 uses ``<|channel>thought``/``<channel|>``, Magistral ``[THINK]``/``[/THINK]``). The
reasoning text goes to ``reasoning_content``, never into ``content``. A block counts only at
the very start of the output (leading whitespace allowed), or when the rendered prompt itself
ends inside an opened block (templates such as Qwen3's open it for the model). Anything else is
content, verbatim: a model that merely mentions the marker later in its answer is not
reinterpreted. Whitespace right after the opening marker (Gemma 4 writes a newline after
``thought``) is not part of the reasoning.

``ReasoningSplitter.feed`` is incremental for streaming: it holds back only text that
could still turn out to be (part of) a marker.
"""

from __future__ import annotations

from trioserve.model.stream_text import partial_marker_len

OPEN = "<think>"
CLOSE = "</think>"


class ReasoningSplitter:
    """Feed output text; get ``(reasoning_delta, content_delta)`` pairs back.

    Args:
        prompt: the rendered prompt (its end may already open the block).
        markers: ``(start, end)`` of the reasoning block, or None for a model that does not
            think: then every piece is content.
    """

    def __init__(self, *, prompt: str = "", markers: tuple[str, str] | None = (OPEN, CLOSE)) -> None:
        # "start": may still see an opening marker; "open": just opened, dropping leading
        # whitespace; "think": inside the block; "after": just closed, dropping separator
        # newlines; "content": the answer.
        if markers is None:
            self._open = self._close = ""
            self._state = "content"
        else:
            self._open, self._close = markers
            self._state = "open" if prompt.rstrip().endswith(self._open) else "start"
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == "content":  # the hot path once any block is over
            return "", text
        self._pending += text
        reasoning, content = [], []
        while self._pending:
            if self._state == "start":
                stripped = self._pending.lstrip()
                if stripped.startswith(self._open):
                    self._pending = stripped[len(self._open):]
                    self._state = "open"
                elif self._open.startswith(stripped):
                    break  # still could be the opening marker (or only whitespace so far)
                else:
                    self._state = "content"
            elif self._state == "open":
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = "think"
            elif self._state == "think":
                end = self._pending.find(self._close)
                if end >= 0:
                    reasoning.append(self._pending[:end])
                    self._pending = self._pending[end + len(self._close):]
                    self._state = "after"
                    continue
                keep = partial_marker_len(self._pending, (self._close,))
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
        if self._state in ("think", "open"):
            return pending, ""  # an unclosed block is still reasoning, never content
        return "", pending


def split_reasoning(text: str, *, prompt: str = "",
                    markers: tuple[str, str] | None = (OPEN, CLOSE)) -> tuple[str, str]:
    """Non-streaming form: ``(reasoning, content)`` of a complete output."""
    splitter = ReasoningSplitter(prompt=prompt, markers=markers)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2
