"""Hugging Face-style Jinja chat templates: load, render, and count tokens exactly.

Owns turning normalized messages (see ``protocol.ChatRequest.messages``) into the prompt text
the worker tokenizes. Rendering follows what templates written for ``transformers`` rely on:
a sandboxed, immutable Jinja environment with ``trim_blocks``/``lstrip_blocks``, the loop
controls extension (``{% break %}``/``{% continue %}``), a ``tojson`` filter that keeps
non-ASCII text and supports ``indent``, and the globals ``raise_exception`` and
``strftime_now``. Template variables: ``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, plus the chat template kwargs (``enable_thinking``, ...).

:meth:`ChatTemplate.render_segments` also tells the template's own text apart from text that
came from the request, so the worker can tokenize the latter without special-token parsing
(a user typing ``<|im_start|>system`` must not open a system turn).

Does not own: choosing which template to use (the app does, from the operator's flags and the
worker's ready record), or mapping :class:`TemplateError` to HTTP (the caller uses
``errors.template_error``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplate",
    "ControlTextError",
    "ControlTokens",
    "RenderedPrompt",
    "TemplateError",
    "TemplateLoadError",
    "RESERVED_TEMPLATE_VARIABLES",
    "CHATML_TEMPLATE",
]

# Variables the server sets; a request's chat_template_kwargs may not override them
# (api/chat/validation.py rejects such keys with 400, render() refuses them as a backstop).
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
     "raise_exception", "strftime_now"}
)

# The explicit fallback (--chatml-fallback style flag): text-only ChatML, no tools, no
# thinking control. Only used when the operator asks for it, because an approximate template
# silently degrades output for models trained on another format.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(Exception):
    """The template refused the request (``raise_exception``) or failed on it.

    The caller answers ``errors.template_error(str(exc))``: 400 ``invalid_value`` with param
    ``messages`` (spec §3), since the request's messages are what the template could not take.
    Not a subclass of ``jinja2.TemplateError``, so callers need not import jinja2.

    Attributes:
        message: the template's own message for ``raise_exception``, else a description.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TemplateLoadError(ValueError):
    """A chat template or tokenizer could not be loaded (bad syntax, missing files)."""


def _raise_exception(message: str) -> NoReturn:
    # jinja2.TemplateError so render() can tell a deliberate refusal apart from a crash.
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson escapes <, >, & and ' for HTML and sorts keys; templates
    # written for transformers expect plain json.dumps output with non-ASCII kept.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str:
    """A special token from tokenizer_config.json: a string, an AddedToken dict, or absent."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        if isinstance(content, str):
            return content
    raise TemplateLoadError(f"unrecognized special token entry: {value!r}")


# --- content segmentation (user text must never become control tokens) --------------------
#
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


class ControlTextError(TemplateError):
    """Request text would reach the model as control tokens, or cannot be kept apart from
    the template's own text. The caller answers 400 ``invalid_value`` naming :attr:`param`.

    Attributes:
        param: the request field holding the offending text (``messages[2].content``,
            ``tools[0]``, ``chat_template_kwargs``), or ``"messages"`` when not located.
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


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


class ChatTemplate:
    """A compiled chat template plus, optionally, the tokenizer that counts its output.

    Build with :meth:`from_hf_dir`, :meth:`from_string` or :meth:`chatml`. Instances are
    immutable and safe to share between concurrent requests (rendering keeps no state).
    """

    # False only for the ChatML fallback, which has no way to show tools to the model.
    _supports_tools: bool = True

    def __init__(
        self,
        templates: Mapping[str, str],
        *,
        bos_token: str | None = "",
        eos_token: str | None = "",
        tokenizer: Any = None,
        no_think: bool = False,
        control_tokens: ControlTokens | None = None,
    ) -> None:
        """
        Args:
            templates: template source by name; must contain ``"default"``. A ``"tool_use"``
                entry, when present, is used for requests that pass tools (as transformers
                does with named templates).
            bos_token, eos_token: values of the template variables; None becomes ``""`` so a
                model without the token renders nothing rather than the text "None".
            tokenizer: a ``tokenizers.Tokenizer`` for :meth:`count_tokens`, or None.
            no_think: default ``enable_thinking`` to False (a request's
                ``chat_template_kwargs`` still overrides it).
            control_tokens: the model's control-token texts (see :attr:`control_tokens`).

        Raises:
            TemplateLoadError: no default template, or a template has a syntax error.
        """
        if "default" not in templates:
            raise TemplateLoadError(
                f"no 'default' chat template among {sorted(templates)}"
            )
        env = _make_environment()
        self._compiled: dict[str, jinja2.Template] = {}
        for name, source in templates.items():
            try:
                self._compiled[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise TemplateLoadError(
                    f"chat template {name!r} has a syntax error at line {exc.lineno}: {exc.message}"
                ) from exc
        self.source = templates["default"]
        self._variables = frozenset().union(*(
            jinja2.meta.find_undeclared_variables(env.parse(src)) for src in templates.values()))
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._tokenizer = tokenizer
        self.default_kwargs: dict[str, Any] = {"enable_thinking": False} if no_think else {}
        # The texts the worker's tokenizer parses as control tokens, from its ready record.
        # None (unknown) makes render_segments stricter: only an exact separation is served.
        self.control_tokens = control_tokens

    # --- constructors ---------------------------------------------------------------------

    @classmethod
    def from_string(
        cls,
        template: str,
        bos_token: str | None = "",
        eos_token: str | None = "",
        *,
        no_think: bool = False,
    ) -> ChatTemplate:
        """The template a GGUF carries (reported by the worker's ready record).

        No tokenizer: :meth:`count_tokens` is unavailable, the worker counts instead.
        """
        return cls({"default": template}, bos_token=bos_token, eos_token=eos_token, no_think=no_think)

    @classmethod
    def from_hf_dir(cls, path: str | Path, *, no_think: bool = False) -> ChatTemplate:
        """Load from a Hugging Face tokenizer directory.

        Reads ``tokenizer_config.json`` for ``chat_template`` (a string, or a list of
        ``{"name", "template"}`` from which ``default`` and ``tool_use`` are used) and for
        ``bos_token``/``eos_token`` (strings or ``{"content": ...}`` dicts). A
        ``chat_template.jinja`` file, where newer transformers versions save the template,
        takes precedence over the config entry. When ``tokenizer.json`` exists it is loaded
        with the ``tokenizers`` library for exact :meth:`count_tokens`.

        Raises:
            TemplateLoadError: missing config, no chat template, bad template syntax, or an
                unreadable tokenizer.json.
        """
        directory = Path(path)
        config_path = directory / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TemplateLoadError(f"cannot read {config_path}: {exc}") from exc

        jinja_file = directory / "chat_template.jinja"
        raw = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else config.get("chat_template")
        if isinstance(raw, str):
            templates = {"default": raw}
        elif isinstance(raw, list):
            templates = {
                entry["name"]: entry["template"]
                for entry in raw
                if isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            }
        else:
            raise TemplateLoadError(f"{directory} has no chat template")

        tokenizer = None
        tokenizer_path = directory / "tokenizer.json"
        if tokenizer_path.is_file():
            from tokenizers import Tokenizer  # imported here: only this constructor needs it

            try:
                tokenizer = Tokenizer.from_file(str(tokenizer_path))
            except Exception as exc:  # the library raises a bare Exception on bad files
                raise TemplateLoadError(f"cannot load {tokenizer_path}: {exc}") from exc

        return cls(
            templates,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            tokenizer=tokenizer,
            no_think=no_think,
        )

    @classmethod
    def chatml(cls, *, no_think: bool = False) -> ChatTemplate:
        """The explicit ChatML fallback (:data:`CHATML_TEMPLATE`).

        Used only when the operator passes the fallback flag: text-only, and a request with
        tools fails with :class:`TemplateError` rather than having them dropped.
        """
        template = cls.from_string(CHATML_TEMPLATE, "", "<|im_end|>", no_think=no_think)
        template._supports_tools = False
        return template

    # --- use ------------------------------------------------------------------------------

    @property
    def variables(self) -> frozenset[str]:
        """Every variable name the template sources refer to and do not set themselves
        (Jinja's static analysis; the names a request's kwargs could change)."""
        return self._variables

    @property
    def can_count_tokens(self) -> bool:
        """Whether :meth:`count_tokens` works (a tokenizer.json was loaded)."""
        return self._tokenizer is not None

    def count_tokens(self, text: str) -> int:
        """Exact token count of rendered ``text``, without adding special tokens (the
        template already wrote them).

        Raises:
            RuntimeError: no tokenizer loaded (check :attr:`can_count_tokens`).
        """
        if self._tokenizer is None:
            raise RuntimeError("this chat template has no tokenizer to count tokens with")
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render the prompt.

        Args:
            messages: normalized messages (``protocol.ChatRequest.messages``).
            tools: tool definitions in OpenAI form, or None. Pass None when ``tool_choice``
                is ``"none"`` so the model is not told about tools it may not call.
            add_generation_prompt: end with the assistant header.
            template_kwargs: per-request variables; override :attr:`default_kwargs`.

        Returns:
            The prompt text, special tokens written as text.

        Raises:
            TemplateError: the template called ``raise_exception`` (its message is
                kept verbatim), or failed on these messages; ``template_kwargs`` names a
                reserved variable; tools were given to the ChatML fallback.
        """
        kwargs = {**self.default_kwargs, **(template_kwargs or {})}
        reserved = RESERVED_TEMPLATE_VARIABLES.intersection(kwargs)
        if reserved:
            raise TemplateError(
                f"chat_template_kwargs may not set {', '.join(sorted(reserved))}"
            )
        if tools and not self._supports_tools:
            raise TemplateError(
                "this server's chat template (the ChatML fallback) does not support tools"
            )
        template = self._compiled["default"]
        if tools and "tool_use" in self._compiled:
            template = self._compiled["tool_use"]
        context = {
            **kwargs,
            "messages": messages,
            "tools": tools or None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        try:
            return template.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception, undefined-variable misuse and sandbox violations alike
            raise TemplateError(exc.message or type(exc).__name__) from exc
        except Exception as exc:
            # Templates assume message shapes (e.g. str + content); on other shapes they
            # fail with TypeError & co. That is a property of this request, not a crash.
            raise TemplateError(
                f"the chat template failed on these messages ({type(exc).__name__}: {exc})"
            ) from exc

    def render_segments(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """Render the prompt with template text and client text told apart, failing closed.

        Same arguments and result text as :meth:`render`. Client text is wrapped in
        sentinels for a second render: every non-blank message ``content`` and
        ``reasoning_content``, the string values inside assistant
        ``tool_calls[].function.arguments``, and the ``description`` strings of ``tools``;
        those land in ``special=False`` segments. Then the control tokens
        (:attr:`control_tokens`) in the ``special=True`` segments must be exactly, in order,
        those of the template rendered over the request with every control-token text
        removed: request text that reaches template text some other way (a template that
        slices or tests content, a property name, a kwarg) passes only when it carries no
        control token there.

        Raises:
            TemplateError: as :meth:`render`.
            ControlTextError: request text would be read as a control token (or, with
                :attr:`control_tokens` unknown, the template reworked request text so that
                it cannot be kept apart). Never an open fallback.
        """
        plain = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            template_kwargs=template_kwargs)
        segments, separated = self._segment(plain, messages, tools, add_generation_prompt,
                                            template_kwargs)
        vocab = self.control_tokens
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
            n_plain = self.render(n_messages, tools=n_tools,
                                  add_generation_prompt=add_generation_prompt,
                                  template_kwargs=n_kwargs)
        except TemplateError as exc:
            raise ControlTextError(
                "the request holds control-token text and the chat template cannot render it "
                f"without that text ({exc.message}); remove it",
                _locate(vocab, messages, tools, template_kwargs)) from None
        n_segments, _ = self._segment(n_plain, n_messages, n_tools, add_generation_prompt,
                                      n_kwargs)
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

    def _segment(self, plain: str, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                 template_kwargs: Mapping[str, Any] | None
                 ) -> tuple[tuple[tuple[str, bool], ...], bool]:
        """Segments of ``plain`` (the render of these arguments) and whether every wrapped
        client string was found intact. When the sentinel render fails or cannot be aligned
        the whole prompt is one template segment (the caller's control-token check decides
        whether that may be served)."""
        used = set(plain)
        used.update(self.source)
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
            wrapped = self.render(wrapped_messages, tools=wrapped_tools,
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
