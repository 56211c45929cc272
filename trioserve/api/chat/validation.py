"""Validation of ``POST /v1/chat/completions`` bodies into a normalized :class:`ChatRequest`.

Owns the request half of the HTTP contract (spec/README.md §4 validation order, §5 request
parameters). Pure: bytes in, a frozen :class:`ChatRequest` or an :class:`APIError` out.
It does not render templates, count tokens or check the context (later stages; see
``model/chat_template.py`` and the serving layer). Numeric ranges come from ``limits.py``.

Validation order, each stage finishing before the next starts:

1. body size (413 ``request_too_large``);
2. JSON: UTF-8, then ``strict_json.loads`` (RFC 8259, finite numbers, nesting and integer
   literals within ``limits``), and the body must be an object (400 ``invalid_json``);
3. types and values of every known parameter: the pydantic model
   :class:`~trioserve.api.chat.models.ChatCompletionBody` declares them in spec §5.4's order,
   then the accepted-and-ignored ones, and the **first** error pydantic reports is translated
   by ``api.validation.translate_error`` (400 ``invalid_value``, or ``missing_required_parameter`` when absent
   or null);
4. unsupported parameters and values (:data:`_UNSUPPORTED_WHEN` and unknown keys; inside a
   message, a non-null ``audio`` or ``function_call``), **all** reported in one 400
   ``unsupported_parameter`` whose ``param`` is the first offender in body order;
5. ``model`` (404 ``model_not_found``).

Unknown keys inside a message, its text parts and its tool calls are not errors: they are
collected (:func:`ignored_in_messages`) for the ``x-trioserve-ignored-fields`` header (spec
§4.1, ``api.ignored_fields``).

Why pydantic's first error is the contract's first error, with the contract's code and
``param`` path, is explained in ``api/body.py``.

Conventions: an explicit JSON ``null`` for an optional parameter means "not given" (OpenAI's
schema marks them nullable). ``bool`` is never accepted as a number (the models are strict).
Integer parameters accept integral floats (``100.0``) because some JSON encoders emit them;
``100.5`` is rejected. Every string must be valid Unicode: JSON's ``\\ud800`` escape can
smuggle a lone surrogate into a Python str, which could not be encoded for the worker or the
response; it is ``invalid_value`` naming the exact path.

``python -m trioserve.api.chat.validation`` prints the request JSON Schema (spec/request.schema.json).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any


from trioserve.core.model_names import ModelNames, check_model
from trioserve import errors, limits
from trioserve.api.body import ROUTER_WRITTEN_DEFAULTS
from trioserve.api.chat.models import (
    TAG_ERRORS,
    AssistantMessage,
    ChatCompletionBody,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
    SystemMessage,
    TextFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolMessage,
    UserMessage,
)
from trioserve.api.ignored_fields import IgnoredFields
from trioserve.api.validation import printable, set_other_than, translate_error, validate_body
from trioserve.core.logit_bias import LogitBias, parse_logit_bias

__all__ = [
    "ChatRequest",
    "ignored_in_messages",
    "parse_chat_request",
    "request_json_schema",
    "SUPPORTED_PARAMETERS",
]

# Named in the unsupported_parameter message so the client learns what it may send instead.
SUPPORTED_PARAMETERS: tuple[str, ...] = (
    "model",
    "messages",
    "stream",
    "stream_options.include_usage",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logit_bias",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
)

_SCHEMA_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated, normalized chat completion request.

    Attributes:
        model: the requested model id (equal to the served id).
        messages: template-ready dicts with ``role`` (``developer`` is normalized to
            ``system``: few chat templates know it, and OpenAI defines it as the new name for
            system instructions), ``content`` (always a str: text parts joined with ``"\\n"``;
            ``""`` for an assistant turn that only carries tool calls) and, where given,
            ``name``, ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
            "arguments"}}]`` with ``arguments`` JSON-decoded into an object when it is a valid
            JSON object, because HF templates iterate or ``tojson`` it), ``tool_call_id``,
            ``reasoning_content``. Treat as read-only.
        stream: whether to answer with server-sent events.
        include_usage: ``stream_options.include_usage``; always False when not streaming
            (spec §5.1: stream_options is ignored then).
        temperature: in [0, 2]; default 1.0. 0 means greedy.
        top_p: in (0, 1]; default 1.0.
        top_k: in [0, 2^31); default 0 (off). Larger request values are clamped.
        seed: None for a random seed, else the worker seed in [0, 2^32 - 1), derived from the
            request's int64/uint64 seed by :func:`limits.worker_seed` (``-1`` means random).
        max_tokens: completion budget, or None for "until the context is full". The smaller
            of ``max_tokens`` and ``max_completion_tokens`` when both are given; at most
            2^31 - 1.
        stop: distinct, non-empty stop strings in request order (empty strings in the
            request are ignored, spec §5.1; at most 16 entries are accepted).
        tools: the declared function tools, normalized to ``{"type": "function",
            "function": {"name", "description"?, "parameters"?}}``, or None.
        tool_choice: ``"auto"``, ``"none"``, ``"required"``, or ``"function"`` for a named
            function (its name in ``tool_choice_function``). Only the first two pass
            validation today (spec §5.3).
        tool_choice_function: the forced function's name when ``tool_choice`` is
            ``"function"``, else None.
        chat_template_kwargs: extra template variables (for example ``enable_thinking``).
        parallel_tool_calls: the request's value (default True). False: at most one call
            (a grammar holds forced calls to one; under ``auto`` the first complete call ends
            the answer, spec §10).
        response_format: None for plain text (absent, null or ``{"type": "text"}``), else
            ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name"?,
            "description"?, "schema"?, "strict"?}}`` (unsupported today).
        reasoning_effort: ``"none"``, ``"minimal"``, ``"low"``, ``"medium"``, ``"high"``,
            ``"xhigh"`` or None; honoured where the model's template can (the chat adapter, spec §11).
        prompt_cache_key, prompt_cache_retention, session_id: the client's session and cache
            hints (spec §12: the key names a worker session; the retention is
            ``"in_memory"`` or ``"24h"``). Hints never change the output, so they take no
            part in equality.
        ignored_fields: the unknown keys inside messages, their text parts and tool calls,
            accepted and not used (spec §4.1); no part in equality either.
    """

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: LogitBias = ()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"
    tool_choice_function: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = field(default=None, compare=False)
    prompt_cache_retention: str | None = field(default=None, compare=False)
    session_id: str | None = field(default=None, compare=False)
    ignored_fields: IgnoredFields = field(default_factory=IgnoredFields, compare=False)

    @property
    def tools_enabled(self) -> bool:
        """True when tools are declared and ``tool_choice`` is not ``none``: only then are
        tools passed to the template and tool calls parsed out of the output."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> frozenset[str]:
        """Names of the declared tools (empty without tools)."""
        return frozenset(t["function"]["name"] for t in self.tools or ())


def parse_chat_request(body: bytes, *, served_model: str, max_body_bytes: int,
                       names: ModelNames | None = None) -> ChatRequest:
    """Validate a chat completion request body.

    Args:
        body: the raw request body.
        served_model: the model id this route answers to.
        names: when given, the names the model answers instead (aliases; spec §2.1).
        max_body_bytes: the body size limit (``TRIOSERVE_MAX_BODY_BYTES``).

    Returns:
        The normalized request.

    Raises:
        APIError: the first failing stage of the validation order (module docstring). Never
            anything else, whatever the bytes.
    """
    obj, parsed = validate_body(ChatCompletionBody, body, max_body_bytes, _translate)
    unsupported = _unsupported_in_body_order(obj, parsed)
    if unsupported:
        raise errors.unsupported_parameters(unsupported, _supported_parameters())
    check_model(parsed.model, served_model, names, "chat")
    return _normalize(parsed, ignored_in_messages(obj["messages"]))


def request_json_schema() -> dict[str, Any]:
    """The JSON Schema of a request body, generated from the models (spec/request.schema.json).

    It states types, ranges and required fields; which values are *unsupported* (stage 4)
    and the role-dependent message rules are in spec §5.
    """
    return ChatCompletionBody.model_json_schema()


# Stages 1-3 are api/validation.py's; chat's unions tag a message's ``role`` and a response
# format's ``type``, whose errors name the key and its allowed values.
_translate = partial(translate_error, tag_errors=TAG_ERRORS)


# --- stage 4: unsupported -------------------------------------------------------------------

# Parameter → (is this value unsupported?, why). Checked only for keys present in the body.
# A parameter modelled ahead of its feature (_MODELLED_AHEAD) becomes supported by deleting
# its line here: its parsed value already reaches ChatRequest, and the unsupported_parameter
# message then lists it among the supported ones.
_UNSUPPORTED_WHEN: dict[str, tuple[Callable[[ChatCompletionBody], bool], str]] = {
    "n": (lambda b: b.n not in (None, 1), "only n=1 is supported"),
    "logprobs": (lambda b: b.logprobs is True, "log probabilities are not supported"),
    "top_logprobs": (lambda b: b.top_logprobs is not None, "log probabilities are not supported"),
    "frequency_penalty": (lambda b: b.frequency_penalty not in (None, 0), "only 0 is supported"),
    "presence_penalty": (lambda b: b.presence_penalty not in (None, 0), "only 0 is supported"),
    "prediction": (lambda b: b.prediction is not None, "predicted outputs are not supported"),
    "modalities": (lambda b: b.modalities not in (None, ["text"]), "only [\"text\"] is supported"),
    # OpenAI parameters with no implementation here: any non-null value.
    **{name: (set_other_than(name), "not supported by this server")
       for name in ("audio", "functions", "function_call", "web_search_options", "verbosity")},
    # What SGLang-lineage routers write into every body they forward (api/chat/models.py).
    **{name: (set_other_than(name, ok), f"only {str(ok).lower()} is supported")
       for name, ok in ROUTER_WRITTEN_DEFAULTS.items()},
}


_MODELLED_AHEAD = ("response_format", "reasoning_effort", "parallel_tool_calls",
                   "prompt_cache_retention")


def _supported_parameters() -> tuple[str, ...]:
    """What the unsupported_parameter message lists as supported."""
    return SUPPORTED_PARAMETERS + tuple(
        name for name in _MODELLED_AHEAD if name not in _UNSUPPORTED_WHEN)


def _unsupported_in_body_order(body: dict[str, Any],
                               parsed: ChatCompletionBody) -> list[tuple[str, str]]:
    """Every unsupported parameter, ordered as the client's body orders its keys (those
    inside messages where ``messages`` is)."""
    out: list[tuple[str, str]] = []
    for key in body:
        if key not in ChatCompletionBody.model_fields:
            out.append((printable(key), "unknown parameter"))
        elif key in _UNSUPPORTED_WHEN and _UNSUPPORTED_WHEN[key][0](parsed):
            out.append((key, _UNSUPPORTED_WHEN[key][1]))
        elif key == "messages":
            out += _unsupported_in_messages(parsed)
    return out


# Known assistant-message keys that would change what the model sees and that this server
# cannot honour: any non-null value is unsupported (models.AssistantMessage).
_UNSUPPORTED_IN_ASSISTANT = {
    "audio": "an earlier audio answer cannot be replayed by this server",
    "function_call": "deprecated; send the call in 'tool_calls' instead",
}


def _unsupported_in_messages(parsed: ChatCompletionBody) -> list[tuple[str, str]]:
    return [(f"messages[{i}].{key}", why)
            for i, message in enumerate(parsed.messages) if isinstance(message, AssistantMessage)
            for key, why in _UNSUPPORTED_IN_ASSISTANT.items() if getattr(message, key) is not None]


# --- fields inside messages (spec §4.1) --------------------------------------------------------

# The keys each message type knows: the models' fields (what _message uses, plus the assistant's
# audio and function_call, refused when not null). Any other key is ignored and reported.
_MESSAGE_KEYS: dict[str, frozenset[str]] = {
    role: frozenset(model.model_fields)
    for role, model in (("system", SystemMessage), ("developer", SystemMessage),
                        ("user", UserMessage), ("assistant", AssistantMessage),
                        ("tool", ToolMessage))}
_PART_KEYS = frozenset(TextPart.model_fields)
_TOOL_CALL_KEYS = frozenset(ToolCall.model_fields)
_FUNCTION_KEYS = frozenset(ToolCallFunction.model_fields)


def ignored_in_messages(messages: list[Any]) -> IgnoredFields:
    """The unknown keys of the (validated) ``messages``: in each message, each text part of
    its content, each tool call and its ``function``."""
    ignored = IgnoredFields()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        ignored.note(message, _MESSAGE_KEYS[message["role"]], where)
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            ignored.note(part, _PART_KEYS, f"{where}.content[{j}]")
        for k, call in enumerate(message.get("tool_calls") or ()):
            ignored.note(call, _TOOL_CALL_KEYS, f"{where}.tool_calls[{k}]")
            ignored.note(call["function"], _FUNCTION_KEYS, f"{where}.tool_calls[{k}].function")
    return ignored


# --- normalization ----------------------------------------------------------------------------


def _text(content: str | list[TextPart]) -> str:
    if isinstance(content, str):
        return content
    # "\n" as separator: parts are usually separate passages (instructions, a document,
    # a question); gluing them with "" would merge the last word of one into the next.
    return "\n".join(part.text for part in content)


def _message(msg: SystemMessage | UserMessage | AssistantMessage | ToolMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
    # Templates concatenate content; None would break them.
    out["content"] = "" if msg.content is None else _text(msg.content)
    if isinstance(msg, AssistantMessage) and msg.refusal is not None:
        out["content"] = "\n".join(text for text in (out["content"], msg.refusal) if text)
    if msg.name is not None:
        out["name"] = msg.name
    if isinstance(msg, AssistantMessage):
        if msg.tool_calls:
            out["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": call.function.decoded}}
                for call in msg.tool_calls]
        if msg.reasoning_content is not None:
            out["reasoning_content"] = msg.reasoning_content
    if isinstance(msg, ToolMessage):
        out["tool_call_id"] = msg.tool_call_id
    return out


def _tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    if tool.function.parameters is not None:
        function["parameters"] = tool.function.parameters
    return {"type": "function", "function": function}


def _response_format(
        fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> dict[str, Any] | None:
    """The normalized ``response_format``; a ``json_schema`` needs a ``name`` (OpenAI's rule
    for it) and a ``schema`` to enforce."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json_object"}
    spec = fmt.json_schema.model_dump(by_alias=True, exclude_none=True)
    where = "response_format.json_schema"
    if "name" not in spec:
        raise errors.missing_required_parameter(f"{where}.name")
    if not _SCHEMA_NAME_RE.match(spec["name"]):
        raise errors.invalid_value(f"Invalid value for '{where}.name': 1-64 characters of a-z, "
                                   "A-Z, 0-9, '_' and '-'.", f"{where}.name")
    if "schema" not in spec:
        raise errors.missing_required_parameter(f"{where}.schema")
    return {"type": "json_schema", "json_schema": spec}


def _normalize(body: ChatCompletionBody, ignored_fields: IgnoredFields) -> ChatRequest:
    stream = bool(body.stream)
    # Huge values are clamped, not rejected (spec §9.1 clamps max_tokens to the room left
    # anyway): beyond int32 they mean "no limit" (max_tokens) or "off" (top_k, as any value
    # ≥ the vocabulary size), and the worker's fields are 32-bit.
    budgets = [min(v, limits.INT32_MAX) for v in (body.max_tokens, body.max_completion_tokens)
               if v is not None]
    stop: list[str] = []
    for s in [body.stop] if isinstance(body.stop, str) else body.stop or ():
        # spec §5.1: empty strings are ignored (they would match everywhere).
        if s and s not in stop:
            stop.append(s)
    tool_choice, tool_choice_function = "auto", None
    if isinstance(body.tool_choice, NamedToolChoice):
        tool_choice, tool_choice_function = "function", body.tool_choice.function.name
    elif body.tool_choice is not None:
        tool_choice = body.tool_choice
    return ChatRequest(
        model=body.model,
        messages=[_message(m) for m in body.messages],
        stream=stream,
        include_usage=stream and bool(body.stream_options and body.stream_options.include_usage),
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=0 if body.top_k is None else min(body.top_k, limits.INT32_MAX),
        seed=limits.worker_seed(body.seed),
        logit_bias=parse_logit_bias(body.logit_bias),
        max_tokens=min(budgets) if budgets else None,
        stop=tuple(stop),
        # An empty array declares no tools; same as omitting it.
        tools=[_tool(t) for t in body.tools] if body.tools else None,
        tool_choice=tool_choice,
        tool_choice_function=tool_choice_function,
        chat_template_kwargs=dict(body.chat_template_kwargs or {}),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=_response_format(body.response_format),
        reasoning_effort=body.reasoning_effort,
        prompt_cache_key=body.prompt_cache_key,
        prompt_cache_retention=body.prompt_cache_retention,
        session_id=body.session_id,
        ignored_fields=ignored_fields,
    )


if __name__ == "__main__":
    print(json.dumps(request_json_schema(), indent=2, ensure_ascii=False))
