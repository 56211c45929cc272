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
(issue 9: a user typing ``<|im_start|>system`` must not open a system turn).

Does not own: choosing which template to use (the app does, from the operator's flags and the
worker's ready record), or mapping :class:`TemplateError` to HTTP (the caller uses
``errors.template_error``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "ChatTemplate",
    "RenderedPrompt",
    "TemplateError",
    "TemplateLoadError",
    "RESERVED_TEMPLATE_VARIABLES",
    "CHATML_TEMPLATE",
]

# Variables the server sets; a request's chat_template_kwargs may not override them
# (protocol.py rejects such keys with 400, render() refuses them as a backstop).
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
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TemplateLoadError(f"unrecognized special token entry: {value!r}")


# --- content segmentation (user text must never become control tokens) --------------------
#
# Each client-supplied string is wrapped in numbered sentinels before a second render:
# OPEN n SEP <text> CLOSE n SEP, with the markers in Supplementary Private Use Area-B, which
# no tokenizer or template gives a meaning. The sentinel render is split at intact pairs and
# aligned against the plain render, so the segments always concatenate to exactly the plain
# render (what the worker would get without segmentation).

_OPEN, _CLOSE, _SEP = "\U00100001", "\U00100002", "\U00100003"
_MARKER_RE = re.compile(f"([{_OPEN}{_CLOSE}])(\\d+){_SEP}")
_MARKER_CHARS = (_OPEN, _CLOSE, _SEP)


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt split into template text and client text.

    Attributes:
        text: the prompt, exactly as :meth:`ChatTemplate.render` returns it.
        segments: ``(text, special)`` pairs concatenating to ``text``, none empty, adjacent
            ones of different kinds: ``special=True`` for template text (the worker parses
            special tokens in it), ``False`` for text that came from the request (tokenized
            as plain text: ``<|im_start|>`` typed by a user stays characters).
        separated: True when every piece of client text in the prompt is in a
            ``special=False`` segment. False when some is not: the template cut a string
            apart (slicing, ``split``) — that piece stays in template text while the others
            are still separated — or the two renders could not be aligned at all (the
            template transformed content beyond trimming whitespace, or a string contained a
            sentinel character) — then ``segments`` is the whole prompt as one special
            segment, as before segmentation existed. Callers may log it.
    """

    text: str
    segments: tuple[tuple[str, bool], ...]
    separated: bool


class _Wrapper:
    """Wraps client strings in numbered sentinel pairs (a fresh number per string)."""

    def __init__(self) -> None:
        self.count = 0

    def text(self, value: Any) -> Any:
        # Blank strings are left alone: they cannot hold control tokens, and templates test
        # content for truthiness ({% if message.content %}), which wrapping would change.
        if not isinstance(value, str) or not value.strip():
            return value
        n = self.count
        self.count += 1
        return f"{_OPEN}{n}{_SEP}{value}{_CLOSE}{n}{_SEP}"

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


def _pieces(wrapped: str) -> tuple[list[tuple[str, bool]], int]:
    """Split a sentinel render at intact pairs: ``(text, is_client_text)`` pieces,
    alternating template/client and starting and ending with template text, and the number
    of markers dropped.

    A pair is intact when an OPEN n is directly followed (no other marker between) by
    CLOSE n. Any other marker — a pair the template cut apart, e.g. by slicing or
    ``split()`` on the content — is dropped, and its text counts as template text.
    """
    parts = _MARKER_RE.split(wrapped)  # text, kind, n, text, kind, n, ..., text
    texts, kinds, numbers = parts[0::3], parts[1::3], parts[2::3]
    pieces: list[tuple[str, bool]] = []
    template = [texts[0]]
    dropped = 0
    i = 0
    while i < len(kinds):
        if (kinds[i] == _OPEN and i + 1 < len(kinds) and kinds[i + 1] == _CLOSE
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
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._tokenizer = tokenizer
        self.default_kwargs: dict[str, Any] = {"enable_thinking": False} if no_think else {}

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
        """Render the prompt with template text and client text told apart.

        Same arguments, result text and errors as :meth:`render`. Client text is every
        non-blank message ``content`` and ``reasoning_content``, the string values inside
        assistant ``tool_calls[].function.arguments``, and the ``description`` strings of
        ``tools``. The template is rendered twice (plain, and with each client string
        wrapped in sentinels); see :class:`RenderedPrompt` for the result and for what
        happens when the two renders cannot be aligned.
        """
        plain = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                            template_kwargs=template_kwargs)
        whole = RenderedPrompt(plain, ((plain, True),) if plain else (), separated=False)
        if any(c in plain for c in _MARKER_CHARS):
            return whole  # a client string holds a sentinel character: cannot tell apart
        wrap = _Wrapper()
        wrapped_messages = [wrap.message(m) for m in messages]
        wrapped_tools = [wrap.descriptions(t) for t in tools] if tools else tools
        if wrap.count == 0:
            return RenderedPrompt(plain, whole.segments, separated=True)  # nothing from the client
        try:
            wrapped = self.render(wrapped_messages, tools=wrapped_tools,
                                  add_generation_prompt=add_generation_prompt,
                                  template_kwargs=template_kwargs)
        except TemplateError:
            return whole  # the template rejects the wrapped strings (e.g. checks their form)
        pieces, dropped = _pieces(wrapped)
        aligned = _align(plain, pieces)
        if aligned is None:
            return whole
        segments = _merge(aligned)
        assert "".join(t for t, _ in segments) == plain  # _align consumed exactly `plain`
        return RenderedPrompt(plain, segments, separated=dropped == 0)
