"""Content segmentation: telling the template's own text apart from text that came from the
request, so the worker tokenizes the latter without special-token parsing (a user typing
``<|im_start|>system`` must not open a system turn). Pure; used by
:meth:`ChatTemplate.render_segments <trioserve.model.chat_template.ChatTemplate.render_segments>`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trioserve.model.template_errors import ControlTextError, TemplateError

__all__ = ["ControlTokens", "RenderedPrompt", "Render", "segment", "checked"]

# ChatTemplate.render: (messages, *, tools, add_generation_prompt, template_kwargs) -> prompt.
Render = Callable[..., str]

# Each client-supplied string is wrapped in numbered sentinels before a second render:
# OPEN n SEP <text> CLOSE n SEP. The three marker characters are chosen per render among the
# private-use code points that occur nowhere in the request, the template or its plain
# render, so no client string can forge or break a marker. The sentinel render is split at
# intact pairs and aligned against the plain render, so the segments always concatenate to
# exactly the plain render (what the worker would get without segmentation).
#
# Segmentation alone cannot see client text the template reworks (slices, splits, tests) nor
# client strings that are not wrapped (property names, enum values, ...). So the result is
# checked against the model's control-token vocabulary: the control tokens found in the
# special (template) segments must be exactly those of the template rendered over neutral
# data (the request with every control-token string removed). Anything else is refused with
# ControlTextError: the render fails closed, never open.

# Supplementary Private Use Area-B, then -A: no tokenizer or template gives them a meaning.
_MARKER_RANGES = ((0x100000, 0x10FFFD), (0xF0000, 0xFFFFD))


class ControlTokens:
    """The texts a model's tokenizer turns into control tokens when it parses special tokens
    (the worker reports them: ready record ``special_tokens.control``).

    Immutable; :meth:`find` is linear in the text times the number of distinct token lengths.
    """

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = frozenset(t for t in texts if t)
        by_first: dict[str, set[int]] = {}
        for t in self.texts:
            by_first.setdefault(t[0], set()).add(len(t))
        # per first character: candidate lengths, longest first
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in by_first.items()}
        self._starts = (re.compile("[" + "".join(re.escape(c) for c in sorted(by_first)) + "]")
                        if by_first else None)

    def find(self, text: str) -> list[str]:
        """Every occurrence (overlapping ones too) of a control-token text in ``text``, in
        order of position then length. Counting every occurrence, not just the ones a
        tokenizer would pick, keeps the comparison in :meth:`ChatTemplate.render_segments`
        conservative."""
        if self._starts is None:
            return []
        found = []
        for m in self._starts.finditer(text):
            i = m.start()
            for n in self._lengths[text[i]]:
                piece = text[i:i + n]
                if len(piece) == n and piece in self.texts:
                    found.append(piece)
        return found

    def without(self, text: str) -> str:
        """``text`` with every control-token text removed (repeatedly, so that removing one
        cannot join two halves into another)."""
        while True:
            found = self.find(text)
            if not found:
                return text
            for piece in sorted(set(found), key=len, reverse=True):
                text = text.replace(piece, "")

    def neutral(self, value: Any) -> Any:
        """``value`` with :meth:`without` applied to every string, dict keys included."""
        if isinstance(value, str):
            return self.without(value)
        if isinstance(value, Mapping):
            return {self.neutral(k): self.neutral(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.neutral(v) for v in value]
        return value


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value``: dict keys and values, list items, at any depth."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _pick_markers(used: set[str]) -> tuple[str, str, str]:
    """Three private-use characters not in ``used``.

    Raises:
        ControlTextError: the request holds nearly every private-use character, so no marker
            is free (only a request built for it does).
    """
    free: list[str] = []
    for lo, hi in _MARKER_RANGES:
        for cp in range(lo, hi + 1):
            if chr(cp) not in used:
                free.append(chr(cp))
                if len(free) == 3:
                    return free[0], free[1], free[2]
    raise ControlTextError("the request uses so many private-use characters that its text "
                           "cannot be told apart from the chat template's")


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt split into template text and client text.

    Attributes:
        text: the prompt, exactly as :meth:`ChatTemplate.render` returns it.
        segments: ``(text, special)`` pairs concatenating to ``text``, none empty, adjacent
            ones of different kinds: ``special=True`` for template text (the worker parses
            special tokens in it), ``False`` for text that came from the request (tokenized
            as plain text: ``<|im_start|>`` typed by a user stays characters).
        separated: True when every wrapped client string is in a ``special=False`` segment.
            False when the template reworked some (sliced, split or tested it) so that its
            text stays in template text; that is only returned when the control-token check
            passed (no request text reaches the model as a control token), else the render
            is refused. Callers may log it.
    """

    text: str
    segments: tuple[tuple[str, bool], ...]
    separated: bool


class _Wrapper:
    """Wraps client strings in numbered sentinel pairs (a fresh number per string)."""

    def __init__(self, markers: tuple[str, str, str]) -> None:
        self.count = 0
        self.open, self.close, self.sep = markers

    def text(self, value: Any) -> Any:
        # Blank strings are left alone: they cannot hold control tokens, and templates test
        # content for truthiness ({% if message.content %}), which wrapping would change.
        if not isinstance(value, str) or not value.strip():
            return value
        n = self.count
        self.count += 1
        return f"{self.open}{n}{self.sep}{value}{self.close}{n}{self.sep}"

    def leaves(self, value: Any) -> Any:
        """String values anywhere inside dicts/lists (keys are structure: left alone)."""
        if isinstance(value, Mapping):
            return {k: self.leaves(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.leaves(v) for v in value]
        return self.text(value)

    def descriptions(self, value: Any) -> Any:
        """Only the values of ``description`` keys, at any depth (JSON schemas compare
        ``type``, ``required`` and enum values structurally, so those stay untouched)."""
        if isinstance(value, Mapping):
            return {k: (self.text(v) if k == "description" and isinstance(v, str)
                        else self.descriptions(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.descriptions(v) for v in value]
        return value

    def message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(message)
        for key in ("content", "reasoning_content"):
            if key in out:
                out[key] = self.text(out[key])
        if isinstance(out.get("tool_calls"), list):
            calls = []
            for call in out["tool_calls"]:
                call = dict(call)
                if isinstance(call.get("function"), Mapping):
                    function = dict(call["function"])
                    if "arguments" in function:
                        function["arguments"] = self.leaves(function["arguments"])
                    call["function"] = function
                calls.append(call)
            out["tool_calls"] = calls
        return out


def _pieces(wrapped: str, markers: tuple[str, str, str]) -> tuple[list[tuple[str, bool]], int]:
    """Split a sentinel render at intact pairs: ``(text, is_client_text)`` pieces,
    alternating template/client and starting and ending with template text, and the number
    of markers dropped.

    A pair is intact when an OPEN n is directly followed (no other marker between) by
    CLOSE n. Any other marker — a pair the template cut apart, e.g. by slicing or
    ``split()`` on the content — is dropped, and its text counts as template text.
    """
    open_, close, sep = markers
    marker_re = re.compile(f"([{open_}{close}])(\\d+){sep}")
    parts = marker_re.split(wrapped)  # text, kind, n, text, kind, n, ..., text
    texts, kinds, numbers = parts[0::3], parts[1::3], parts[2::3]
    pieces: list[tuple[str, bool]] = []
    template = [texts[0]]
    dropped = 0
    i = 0
    while i < len(kinds):
        if (kinds[i] == open_ and i + 1 < len(kinds) and kinds[i + 1] == close
                and numbers[i] == numbers[i + 1]):
            pieces.append(("".join(template), False))
            pieces.append((texts[i + 1], True))
            template = [texts[i + 2]]
            i += 2
        else:
            template.append(texts[i + 1])
            dropped += 1
            i += 1
    pieces.append(("".join(template), False))
    return pieces, dropped


def _trim_variants(text: str) -> list[str]:
    """``text`` and the forms whitespace trimming can give it, most complete first.

    Templates commonly ``trim``/``strip`` content; the sentinels stop that from happening in
    the sentinel render, so the plain render may hold a trimmed form of the client text.
    """
    n = len(text)
    lead = {0, n - len(text.lstrip()), n - len(text.lstrip("\n"))}
    trail = {n, len(text.rstrip()), len(text.rstrip("\n"))}
    spans = sorted({(a, b) for a in lead for b in trail if a <= b}, key=lambda ab: ab[0] - ab[1])
    return [text[a:b] for a, b in spans]


def _align(plain: str, pieces: list[tuple[str, bool]]) -> list[tuple[str, bool]] | None:
    """Map sentinel-render pieces onto the plain render; None when they do not fit.

    Template pieces must occur verbatim at the current position. A client piece may occur
    trimmed (:func:`_trim_variants`); the variant chosen is the first one after which the
    next template piece fits.
    """
    pos = 0
    out: list[tuple[str, bool]] = []
    for k, (text, is_client) in enumerate(pieces):
        if not is_client:
            if not plain.startswith(text, pos):
                return None
            out.append((text, True))
            pos += len(text)
            continue
        following = pieces[k + 1][0]  # template text: a client piece is never last
        for variant in _trim_variants(text):
            if plain.startswith(variant, pos) and plain.startswith(following, pos + len(variant)):
                out.append((variant, False))
                pos += len(variant)
                break
        else:
            return None
    return out if pos == len(plain) else None


def _merge(segments: Sequence[tuple[str, bool]]) -> tuple[tuple[str, bool], ...]:
    merged: list[tuple[str, bool]] = []
    for text, special in segments:
        if not text:
            continue
        if merged and merged[-1][1] == special:
            merged[-1] = (merged[-1][0] + text, special)
        else:
            merged.append((text, special))
    return tuple(merged)


def segment(render: Render, source: str, plain: str, messages: Sequence[Mapping[str, Any]],
            tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
            template_kwargs: Mapping[str, Any] | None) -> tuple[tuple[tuple[str, bool], ...], bool]:
    """Segments of ``plain`` (``render`` of these arguments by the template whose text is
    ``source``) and whether every wrapped client string was found intact. When the sentinel
    render fails or cannot be aligned the whole prompt is one template segment (the
    control-token check of :func:`checked` decides whether that may be served)."""
    used = set(plain)
    used.update(source)
    for text in _strings((list(messages), list(tools or ()), dict(template_kwargs or {}))):
        used.update(text)
    markers = _pick_markers(used)
    wrap = _Wrapper(markers)
    wrapped_messages = [wrap.message(m) for m in messages]
    wrapped_tools = [wrap.descriptions(t) for t in tools] if tools else tools
    whole = ((plain, True),) if plain else ()
    if wrap.count == 0:
        return whole, True  # nothing from the client to separate
    try:
        wrapped = render(wrapped_messages, tools=wrapped_tools,
                              add_generation_prompt=add_generation_prompt,
                              template_kwargs=template_kwargs)
    except TemplateError:
        return whole, False  # the template rejects wrapped strings (e.g. checks their form)
    pieces, dropped = _pieces(wrapped, markers)
    aligned = _align(plain, pieces)
    if aligned is None:
        return whole, False
    segments = _merge(aligned)
    assert "".join(t for t, _ in segments) == plain  # _align consumed exactly `plain`
    return segments, dropped == 0


def checked(render: Render, source: str, vocab: ControlTokens | None, plain: str,
            segments: tuple[tuple[str, bool], ...], separated: bool,
            messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
            add_generation_prompt: bool,
            template_kwargs: Mapping[str, Any] | None) -> RenderedPrompt:
    """``plain`` and its :func:`segment` result as a :class:`RenderedPrompt` once the
    control-token check passed: the control tokens (``vocab``) in the template segments must
    be exactly, in order, those of the template rendered over the request with every
    control-token text removed. Raises ControlTextError otherwise, or when ``vocab`` is
    unknown and the template reworked request text (never an open fallback)."""
    if vocab is None:
        if not separated:
            raise ControlTextError(
                "the chat template reworks request text (slices, splits or tests it) and "
                "the model's control tokens are unknown, so that text cannot be kept apart "
                "from the template's own")
        return RenderedPrompt(plain, segments, separated)
    n_messages = vocab.neutral(list(messages))
    n_tools = vocab.neutral(list(tools)) if tools else None
    n_kwargs = vocab.neutral(dict(template_kwargs or {}))
    if (n_messages == list(messages) and n_tools == (list(tools) if tools else None)
            and n_kwargs == dict(template_kwargs or {})):
        # No request string holds a control-token text: the special segments hold what
        # the template renders over neutral data, because the request is neutral data.
        return RenderedPrompt(plain, segments, separated)
    in_template = _control_sequence(vocab, segments)
    try:
        n_plain = render(n_messages, tools=n_tools,
                              add_generation_prompt=add_generation_prompt,
                              template_kwargs=n_kwargs)
    except TemplateError as exc:
        raise ControlTextError(
            "the request holds control-token text and the chat template cannot render it "
            f"without that text ({exc.message}); remove it",
            _locate(vocab, messages, tools, template_kwargs)) from None
    n_segments, _ = segment(render, source, n_plain, n_messages, n_tools,
                            add_generation_prompt, n_kwargs)
    expected = _control_sequence(vocab, n_segments)
    if in_template != expected:
        extra = Counter(in_template) - Counter(expected)
        shown = ", ".join(repr(t) for t in sorted(extra)[:3]) or "in other places than its own"
        raise ControlTextError(
            f"request text would reach the model as the control token(s) {shown}: the chat "
            "template does not keep this text apart from its own (it reworks, tests or "
            "embeds it outside message content); remove the control-token text",
            _locate(vocab, messages, tools, template_kwargs))
    return RenderedPrompt(plain, segments, separated)


def _control_sequence(vocab: ControlTokens, segments: Sequence[tuple[str, bool]]) -> list[str]:
    """The control-token texts in the special segments, in order (each segment is
    tokenized on its own, so none spans two)."""
    return [tok for text, special in segments if special for tok in vocab.find(text)]


def _locate(vocab: ControlTokens, messages: Sequence[Mapping[str, Any]],
            tools: Sequence[Mapping[str, Any]] | None,
            template_kwargs: Mapping[str, Any] | None) -> str:
    """The request field of the first client string holding a control-token text."""
    for i, message in enumerate(messages):
        for key, value in message.items():
            if any(vocab.find(t) for t in _strings({key: value})):
                return f"messages[{i}].{key}"
    for i, tool in enumerate(tools or ()):
        if any(vocab.find(t) for t in _strings(tool)):
            return f"tools[{i}]"
    if any(vocab.find(t) for t in _strings(dict(template_kwargs or {}))):
        return "chat_template_kwargs"
    return "messages"
