"""Hugging Face-style Jinja chat templates: load, render, and count tokens exactly.

Owns turning template messages (``CoreRequest.template_messages``) into the prompt text
the worker tokenizes. Rendering follows what templates written for ``transformers`` rely on:
a sandboxed, immutable Jinja environment with ``trim_blocks``/``lstrip_blocks``, the loop
controls extension (``{% break %}``/``{% continue %}``), a ``tojson`` filter that keeps
non-ASCII text and supports ``indent``, and the globals ``raise_exception`` and
``strftime_now``. Template variables: ``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``, ``eos_token``, plus the chat template kwargs (``enable_thinking``, ...).

:meth:`ChatTemplate.render_segments` also tells the template's own text apart from text that
came from the request, so the worker can tokenize the latter without special-token parsing
(a user typing ``<|im_start|>system`` must not open a system turn; ``model.segments`` does it).

Does not own: choosing which template to use (the app does, from the operator's flags and the
worker's ready record), or mapping :class:`TemplateError` to HTTP (the caller uses
``errors.template_error``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trioserve.model.segments import ControlTokens, RenderedPrompt, checked, segment
from trioserve.model.template_errors import TemplateError, TemplateLoadError

__all__ = [
    "ChatTemplate",
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
        segments, separated = segment(self.render, self.source, plain, messages, tools,
                                      add_generation_prompt, template_kwargs)
        return checked(self.render, self.source, self.control_tokens, plain, segments, separated,
                       messages, tools, add_generation_prompt, template_kwargs)
