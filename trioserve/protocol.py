"""Validation of ``POST /v1/chat/completions`` bodies into a normalized :class:`ChatRequest`.

Owns the request half of the HTTP contract (spec/README.md §4 validation order, §5 request
parameters). Pure: bytes in, a frozen :class:`ChatRequest` or an :class:`APIError` out.
It does not render templates, count tokens or check the context (later stages; see
``chat_template.py`` and the serving layer). Numeric ranges come from ``limits.py``.

Validation order, each stage finishing before the next starts:

1. body size (413 ``request_too_large``);
2. JSON: UTF-8, RFC 8259 (no NaN/Infinity), finite numbers, nesting and integer literals
   within ``limits``, and the body must be an object (400 ``invalid_json``);
3. types and values of every known parameter: the pydantic model :class:`ChatCompletionBody`
   declares them in spec §5.4's order, then the accepted-and-ignored ones, and the **first**
   error pydantic reports is translated (400 ``invalid_value``, or
   ``missing_required_parameter`` when absent or null);
4. unsupported parameters and values (:data:`_UNSUPPORTED_WHEN` and unknown keys), **all**
   reported in one 400 ``unsupported_parameter`` whose ``param`` is the first offender in body
   order;
5. ``model`` (404 ``model_not_found``).

How the models keep the contract's error shape (the translator is :func:`_translate`):

- *First error in a fixed order*: pydantic validates fields in declaration order, list items
  in index order, and lists its errors in that order; we report ``errors()[0]``.
- *Missing told apart from wrong*: required fields (no default) that are absent are
  pydantic's ``missing``; an explicit null for a field that does not allow null can only be a
  required field's, and the translator reports it as missing too (spec §3: "absent or null").
- *Exact param paths*: every union is discriminated by a function that picks one branch from
  the value (its JSON type, a message's ``role``, a response format's ``type``), so an error
  comes from that one branch only; the branch's tag appears in pydantic's location and is
  dropped by the translator (tags are the strings in :data:`_UNION_TAGS`, which contain a
  ``:`` that no field name has). Errors inside free-form objects carry the rest of the path
  in their context (``subpath``).

Conventions: an explicit JSON ``null`` for an optional parameter means "not given" (OpenAI's
schema marks them nullable). ``bool`` is never accepted as a number (the models are strict).
Integer parameters accept integral floats (``100.0``) because some JSON encoders emit them;
``100.5`` is rejected. Every string must be valid Unicode: JSON's ``\\ud800`` escape can
smuggle a lone surrogate into a Python str, which could not be encoded for the worker or the
response; it is ``invalid_value`` naming the exact path.

``python -m trioserve.protocol`` prints the request JSON Schema (spec/request.schema.json).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from . import errors, limits
from .chat_template import RESERVED_TEMPLATE_VARIABLES

__all__ = [
    "ChatRequest",
    "parse_chat_request",
    "request_json_schema",
    "SUPPORTED_PARAMETERS",
]

_ROLES = ("system", "developer", "user", "assistant", "tool")
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")

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
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "tools",
    "tool_choice ('auto' or 'none')",
    "chat_template_kwargs",
)


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
        parallel_tool_calls: the request's value (default True; False is unsupported today).
        response_format: None for plain text (absent, null or ``{"type": "text"}``), else
            ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name"?,
            "description"?, "schema"?, "strict"?}}`` (unsupported today).
        reasoning_effort: ``"none"``, ``"minimal"``, ``"low"``, ``"medium"``, ``"high"`` or None
            (non-null is unsupported today).
        prompt_cache_key, prompt_cache_retention: the client's cache hints (the retention is
            ``"in_memory"`` or ``"24h"``; non-null is unsupported today). Hints never change
            the output, so they take no part in equality.
    """

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
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

    @property
    def tools_enabled(self) -> bool:
        """True when tools are declared and ``tool_choice`` is not ``none``: only then are
        tools passed to the template and tool calls parsed out of the output."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> frozenset[str]:
        """Names of the declared tools (empty without tools)."""
        return frozenset(t["function"]["name"] for t in self.tools or ())


def parse_chat_request(body: bytes, *, served_model: str, max_body_bytes: int) -> ChatRequest:
    """Validate a chat completion request body.

    Args:
        body: the raw request body.
        served_model: the only model id this server answers to.
        max_body_bytes: the body size limit (``TRIOSERVE_MAX_BODY_BYTES``).

    Returns:
        The normalized request.

    Raises:
        APIError: the first failing stage of the validation order (module docstring). Never
            anything else, whatever the bytes.
    """
    if len(body) > max_body_bytes:
        raise errors.request_too_large(max_body_bytes)
    obj = _load_json_object(body)
    try:
        checks = _SURROGATE_ESCAPE.search(body) is not None
        parsed = ChatCompletionBody.model_validate(obj, context={"unicode_checks": checks})
    except ValidationError as exc:
        raise _translate(exc.errors(include_url=False)[0]) from None
    unsupported = _unsupported_in_body_order(obj, parsed)
    if unsupported:
        raise errors.unsupported_parameters(unsupported, _supported_parameters())
    if parsed.model != served_model:
        raise errors.model_not_found(parsed.model, served_model)
    return _normalize(parsed)


def request_json_schema() -> dict[str, Any]:
    """The JSON Schema of a request body, generated from the models (spec/request.schema.json).

    It states types, ranges and required fields; which values are *unsupported* (stage 4)
    and the role-dependent message rules are in spec §5.
    """
    return ChatCompletionBody.model_json_schema()


# --- JSON (stage 2) -------------------------------------------------------------------------


class _BodyRuleError(ValueError):
    """A stage-2 rule beyond JSON's grammar was broken; the message is for the client."""


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity, which are not JSON (RFC 8259) and no client should send.
    raise _BodyRuleError(f"{name} is not valid JSON")


class _TooDeep(_BodyRuleError):
    """JSON nested deeper than ``limits.MAX_JSON_DEPTH``."""


_TOO_DEEP = f"nested deeper than {limits.MAX_JSON_DEPTH} levels"
_INFINITY = float("inf")


def _check_tree(value: Any) -> None:
    """Raise _BodyRuleError when a decoded JSON value nests deeper than the limit or holds a
    number beyond double range (``1e400`` decodes to infinity). One pass, one nesting level at
    a time (iterative: any depth is safe), with only C-level work per scalar."""
    level, depth = [value], 1
    while level:
        if depth > limits.MAX_JSON_DEPTH:
            raise _TooDeep(_TOO_DEEP)
        deeper = []
        for container in level:
            for child in container.values() if type(container) is dict else container:
                kind = type(child)
                if kind is dict or kind is list:
                    deeper.append(child)
                elif kind is float and (child == _INFINITY or child == -_INFINITY):
                    raise _BodyRuleError("a number is out of range (beyond double precision)")
        level, depth = deeper, depth + 1


def _loads(text: str) -> Any:
    """``json.loads`` under the body rules (stage 2): RFC 8259 only, finite numbers, integer
    literals and nesting within ``limits``. Every failure is a ValueError whose message can be
    shown to the client; never RecursionError."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:  # the C scanner recurses once per nesting level
        raise _TooDeep(_TOO_DEEP) from None
    except (json.JSONDecodeError, _BodyRuleError):
        raise
    except ValueError:  # int(): over the interpreter's digit limit; its message is about Python
        raise _BodyRuleError(
            f"an integer literal has more than {limits.MAX_INTEGER_DIGITS} digits") from None
    if type(value) is dict or type(value) is list:
        _check_tree(value)
    elif type(value) is float and value in (_INFINITY, -_INFINITY):
        raise _BodyRuleError("a number is out of range (beyond double precision)")
    return value


# A lone surrogate can only come from a \uD800-\uDFFF escape (the body is decoded as UTF-8,
# which has no surrogates), at any level of escaping. Bodies without one — nearly all — skip
# the per-string Unicode checks (validation context key "unicode_checks").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _load_json_object(body: bytes) -> dict[str, Any]:
    try:
        # Decode explicitly: json.loads(bytes) would also guess UTF-16/32, which the spec
        # (§3, "not UTF-8" is invalid_json) does not allow.
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.invalid_json("the body is not valid UTF-8") from None
    if not text.strip():
        raise errors.invalid_json("the body is empty")
    try:
        obj = _loads(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise errors.invalid_json(str(exc)) from None
    if not isinstance(obj, dict):
        raise errors.invalid_json(f"the body must be a JSON object, got {_type_name(obj)}")
    return obj


# --- field types --------------------------------------------------------------------------


def _invalid(detail: str, subpath: str = "") -> PydanticCustomError:
    """An ``invalid_value`` error for the translator; ``subpath`` extends the field's path
    (for problems inside free-form objects). ``detail`` is a context value, not the
    template, so braces in it are not format fields."""
    return PydanticCustomError("invalid_value", "{detail}", {"detail": detail, "subpath": subpath})


def _lone_surrogate(text: str) -> str | None:
    """Where the first lone surrogate in ``text`` is (``"U+D800 at offset 3"``), or None when
    ``text`` is valid Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"U+{ord(text[exc.start]):04X} at offset {exc.start}"
    return None


_NOT_UNICODE = "which is not valid Unicode"


def _unicode_checks(info: ValidationInfo) -> bool:
    """Whether this validation must look for lone surrogates (always, unless the caller knows
    the body has no surrogate escape)."""
    return info.context is None or info.context.get("unicode_checks", True)


def _valid_unicode(text: str, info: ValidationInfo) -> str:
    if _unicode_checks(info) and (where := _lone_surrogate(text)) is not None:
        raise _invalid(f"contains a lone surrogate ({where}), {_NOT_UNICODE}.")
    return text


# Every string of the request: valid Unicode (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]


def _first_bad_string(value: Any) -> tuple[str, str] | None:
    """``(subpath, problem)`` of the first key or string in a decoded JSON value (document
    order) that is not valid Unicode, or None. Iterative; the body's nesting is bounded."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if (where := _lone_surrogate(item)) is not None:
                return path, f"a lone surrogate ({where})"
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if (where := _lone_surrogate(key)) is not None:
                    return path, f"a key with a lone surrogate ({where})"
                children.append((child, f"{path}.{key}"))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend(reversed([(child, f"{path}[{i}]") for i, child in enumerate(item)]))
    return None


def _valid_unicode_json(value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
    if _unicode_checks(info) and (bad := _first_bad_string(value)) is not None:
        subpath, problem = bad
        raise _invalid(f"contains {problem}, {_NOT_UNICODE}.", subpath)
    return value


# A free-form JSON object (tool parameters, chat_template_kwargs, metadata, ...).
JsonObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode_json)]


def _integral_float(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _integer(**bounds: int) -> Any:
    """An integer parameter within ``bounds`` (``ge``, ``le``); integral floats (100.0) are
    accepted, booleans are not. The bounds come before the float conversion in the
    annotation so that the JSON Schema states them as minimum/maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral_float)]


Integer = _integer()

# OpenAI parameters trioserve does not implement: accepted when null, unsupported otherwise
# (stage 4), whatever the type.
NullOnly = Annotated[Any, WithJsonSchema({"type": "null"})]

_JSON_KINDS = {str: "string", list: "array", dict: "object"}


def _by_json_kind(expected: str, **branches: Any) -> Any:
    """A union that picks its branch by the value's JSON type (keywords ``string``, ``array``,
    ``object``); any other type is ``Invalid type for ...: expected <expected>``."""

    def kind(value: Any) -> str | None:
        name = _JSON_KINDS.get(type(value))
        return f"json:{name}" if name in branches else None

    choices = tuple(Annotated[branch, Tag(f"json:{name}")] for name, branch in branches.items())
    return Annotated[Union[choices], Discriminator(  # type: ignore[valid-type]
        kind, custom_error_type="wrong_type", custom_error_message=expected)]


def _tagged_by(key: str, allowed: tuple[str, ...], error_type: str,
               branches: dict[str, Any]) -> Any:
    """A union that picks its branch by the string in the object's ``key`` (``role``,
    ``type``): ``branches`` maps each allowed value to its model. ``error_type`` names the
    failure for :data:`_TAGGED_BY` (not an object, tag missing, tag not allowed)."""

    def tag(value: Any) -> str | None:
        if isinstance(value, dict) and isinstance(value.get(key), str) and value[key] in allowed:
            return f"{key}:{value[key]}"
        return None

    choices = tuple(Annotated[model, Tag(f"{key}:{name}")] for name, model in branches.items())
    return Annotated[Union[choices], Discriminator(  # type: ignore[valid-type]
        tag, custom_error_type=error_type, custom_error_message=f"invalid '{key}'")]


# --- the models (stage 3) -------------------------------------------------------------------


class _Model(BaseModel):
    # strict: no "1" → 1, no true → 1.0; extra keys ignored (unknown keys inside a message or
    # stream_options are accepted, spec §5.2; top-level ones are stage 4's).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Model):
    """``{"type": "text", "text": str}``; other part types are invalid_value on the part."""

    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _only_text_parts(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "text":
            # spec §5.5: invalid_value on the part, not unsupported_parameter (it is a value
            # of messages, not a parameter). json.dumps: the type may not be valid Unicode.
            raise _invalid('only text content parts ({"type": "text", "text": ...}) are '
                           f"supported, got {json.dumps(data['type'])}.")
        return data


Content = _by_json_kind("a string or an array of content parts",
                        string=Text, array=list[TextPart])


class ToolCallFunction(_Model):
    name: Text
    arguments: Text

    @field_validator("arguments")
    @classmethod
    def _arguments_decode_safely(cls, arguments: str, info: ValidationInfo) -> str:
        """Arguments that are JSON are decoded for templates (see :func:`_decode_arguments`);
        the decoded value must be as sane as a body: bounded nesting, valid Unicode."""
        try:
            decoded = _loads(arguments)
        except _TooDeep as exc:
            raise _invalid(f"the JSON in it is {exc}.") from None
        except ValueError:
            return arguments  # not JSON: passed to the template as the string it is
        if _unicode_checks(info) and (bad := _first_bad_string(decoded)) is not None:
            subpath, problem = bad
            where = f" in {subpath}" if subpath else ""
            raise _invalid(f"the JSON in it has {problem}{where}, {_NOT_UNICODE}.")
        return arguments


class ToolCall(_Model):
    id: Text
    type: Literal["function"] | None = None
    function: ToolCallFunction


class SystemMessage(_Model):
    role: Literal["system", "developer"]
    content: Content
    name: Text | None = None


class UserMessage(_Model):
    role: Literal["user"]
    content: Content
    name: Text | None = None


class AssistantMessage(_Model):
    role: Literal["assistant"]
    # Before content: whether content may be null depends on it.
    tool_calls: list[ToolCall] | None = None
    content: Content | None = Field(default=None, validate_default=True)
    name: Text | None = None
    # Passed through for templates that replay reasoning (Qwen3 does, after the last user
    # turn); a non-string is a client bug worth reporting.
    reasoning_content: Text | None = None

    @field_validator("content")
    @classmethod
    def _content_or_tool_calls(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and not info.data.get("tool_calls"):
            raise PydanticCustomError("missing", "Field required")
        return content


class ToolMessage(_Model):
    role: Literal["tool"]
    content: Content
    name: Text | None = None
    tool_call_id: Text


# Unknown message keys (refusal, annotations, audio, function_call: null, ...) are ignored:
# clients echo back whole response messages, and rejecting them would break every
# multi-turn conversation. Top-level parameters, by contrast, are never ignored.
Message = _tagged_by("role", _ROLES, "bad_message_role", {
    "system": SystemMessage, "developer": SystemMessage, "user": UserMessage,
    "assistant": AssistantMessage, "tool": ToolMessage})


# OpenAI's rule for function names; also keeps names safe inside templates and tool-call tags.
_TOOL_NAME_PATTERN = "^[A-Za-z0-9_-]{1,64}$"
_TOOL_NAME_RE = re.compile(_TOOL_NAME_PATTERN)


def _valid_tool_name(name: str) -> str:
    if not _TOOL_NAME_RE.match(name):
        raise _invalid(f"{json.dumps(name)}; names are 1-64 characters of a-z, A-Z, 0-9, '_' "
                       "and '-'.")
    return name


ToolName = Annotated[str, AfterValidator(_valid_tool_name),
                     WithJsonSchema({"type": "string", "pattern": _TOOL_NAME_PATTERN})]


class FunctionDefinition(_Model):
    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None
    # Accepted; we do not constrain decoding, so it changes nothing.
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


def _unique_tool_names(tools: list[Tool]) -> list[Tool]:
    # Runs once every tool is valid, so a duplicate is reported after any other problem in
    # the tools array.
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise _invalid(f"duplicate tool name '{name}'.", f"[{i}].function.name")
        seen.add(name)
    return tools


class NamedFunction(_Model):
    name: Text


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = _by_json_kind("'auto', 'none', 'required' or an object",
                           string=Literal["auto", "none", "required"], object=NamedToolChoice)

Stop = _by_json_kind("a string or an array of strings", string=Text,
                     array=Annotated[list[Text], Field(max_length=limits.MAX_STOP_STRINGS)])


class StreamOptions(_Model):
    include_usage: bool | None = None


class TextFormat(_Model):
    type: Literal["text"]


class JsonObjectFormat(_Model):
    type: Literal["json_object"]


class JsonSchemaSpec(_Model):
    # OpenAI requires a name; nothing here needs one, so it is optional.
    name: Text | None = None
    description: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = _tagged_by("type", _RESPONSE_FORMAT_TYPES, "bad_response_format_type", {
    "text": TextFormat, "json_object": JsonObjectFormat, "json_schema": JsonSchemaFormat})


def _no_reserved_template_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    for key in kwargs:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise _invalid("this template variable is set by the server and cannot be "
                           "overridden.", f".{key}")
    return kwargs


class ChatCompletionBody(_Model):
    """The body of ``POST /v1/chat/completions`` (spec §5). Fields are declared in the order
    stage 3 reports problems in (§5.4, then the accepted-and-ignored parameters)."""

    model_config = ConfigDict(title="ChatCompletionRequest",
                              json_schema_extra={"additionalProperties": False})

    model: Text
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=limits.TEMPERATURE_MIN,
                                         le=limits.TEMPERATURE_MAX)] | None = None
    top_p: Annotated[float, Field(gt=limits.TOP_P_MIN_EXCLUSIVE, le=limits.TOP_P_MAX)] | None = None
    top_k: _integer(ge=limits.TOP_K_MIN) | None = Field(
        default=None, description="0 = off; values above 2^31 - 1 are clamped to it")
    seed: _integer(ge=limits.SEED_MIN, le=limits.SEED_MAX) | None = Field(
        default=None, description="absent, null or -1: random; else reduced modulo 2^32 - 1")
    max_tokens: _integer(ge=limits.MAX_TOKENS_MIN) | None = Field(
        default=None, description="values above the room left in the context are clamped")
    max_completion_tokens: _integer(ge=limits.MAX_TOKENS_MIN) | None = Field(
        default=None, description="as max_tokens; the smaller of both wins")
    stop: Stop | None = None
    n: _integer(ge=limits.N_MIN) | None = None
    tools: Annotated[list[Tool], AfterValidator(_unique_tool_names)] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: Annotated[JsonObject,
                                    AfterValidator(_no_reserved_template_variables)] | None = None
    # Accepted; ignored at their neutral value and unsupported otherwise (_UNSUPPORTED_WHEN).
    # Only their types are checked: any well-typed non-neutral value is unsupported, whatever
    # its range (spec §5.3).
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Integer | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: JsonObject | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    user: Text | None = None
    store: bool | None = None
    metadata: JsonObject | None = None
    service_tier: Text | None = None
    prediction: JsonObject | None = None
    modalities: list[Text] | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: Text | None = None
    audio: NullOnly = None
    functions: NullOnly = None
    function_call: NullOnly = None
    web_search_options: NullOnly = None
    verbosity: NullOnly = None


# --- error translation ----------------------------------------------------------------------

# Discriminator tags (see _by_json_kind and _tagged_by): pydantic puts the chosen branch's tag
# in an error's location; it is not part of the client's path.
_UNION_TAGS = frozenset(
    {f"json:{kind}" for kind in _JSON_KINDS.values()}
    | {f"role:{role}" for role in _ROLES}
    | {f"type:{kind}" for kind in _RESPONSE_FORMAT_TYPES}
)

# Errors of _tagged_by unions: (the key that picks the branch, its allowed values).
_TAGGED_BY = {
    "bad_message_role": ("role", _ROLES),
    "bad_response_format_type": ("type", _RESPONSE_FORMAT_TYPES),
}

# pydantic's type errors, by the JSON type that was expected.
_EXPECTED_TYPE = {
    "string_type": "a string",
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a number",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "an array",
}

_BOUNDS = {"greater_than_equal": ("ge", "≥"), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "≤"), "less_than": ("lt", "<")}


def _type_name(value: Any) -> str:
    """JSON type name of a decoded value, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _printable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX``: error messages and params are
    encoded to UTF-8 for the response, which a lone surrogate would make fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _param(loc: tuple[int | str, ...]) -> str:
    path = ""
    for segment in loc:
        if isinstance(segment, int):
            path += f"[{segment}]"
        elif segment not in _UNION_TAGS:
            path += f".{segment}" if path else segment
    return path


def _wrong_type(param: str, expected: str, value: Any) -> errors.APIError:
    return errors.invalid_value(
        f"Invalid type for '{param}': expected {expected}, got {_type_name(value)}.", param)


def _translate(error: ErrorDetails) -> errors.APIError:
    """The APIError for one pydantic error (module docstring: the contract's error shape)."""
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    param = _printable(_param(error["loc"]) + ctx.get("subpath", ""))
    kind, value = error["type"], error["input"]

    if kind in _TAGGED_BY:
        key, allowed = _TAGGED_BY[kind]
        if not isinstance(value, dict):
            return _wrong_type(param, "an object", value)
        tag_param = f"{param}.{key}"
        if value.get(key) is None:
            return errors.missing_required_parameter(tag_param)
        tag = value[key]
        shown = json.dumps(tag) if isinstance(tag, str) else _type_name(tag)
        return errors.invalid_value(
            f"Invalid value for '{tag_param}': {shown}; expected one of {', '.join(allowed)}.",
            tag_param)
    if kind == "missing" or (value is None and kind != "invalid_value"
                             and error["loc"] and isinstance(error["loc"][-1], str)):
        # A null where null is not allowed: optional fields allow it, so this field is
        # required. (A null list item, whose location ends with an index, is a wrong type.)
        return errors.missing_required_parameter(param)
    if kind in _EXPECTED_TYPE:
        return _wrong_type(param, _EXPECTED_TYPE[kind], value)
    if kind == "wrong_type":  # _by_json_kind: the message is what was expected
        return _wrong_type(param, error["msg"], value)
    if kind == "literal_error":
        if not isinstance(value, str):
            return _wrong_type(param, ctx["expected"], value)
        detail = f"{json.dumps(value)}; expected {ctx['expected']}."
    elif kind == "invalid_value":
        detail = ctx["detail"]
    elif kind in _BOUNDS:
        key, symbol = _BOUNDS[kind]
        detail = f"{_number(value)} is not {symbol} {_number(ctx[key])}."
    elif kind == "too_short":
        least = ctx["min_length"]
        detail = f"expected at least {least} {'entry' if least == 1 else 'entries'}, got {ctx['actual_length']}."
    elif kind == "too_long":
        detail = f"at most {ctx['max_length']} entries, got {ctx['actual_length']}."
    elif kind == "finite_number":
        detail = "must be a finite number."
    else:  # a rule without its own wording: pydantic's message, which has no internals
        detail = f"{error['msg']}."
    return errors.invalid_value(f"Invalid value for '{param}': {_printable(detail)}", param)


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
    "logit_bias": (lambda b: bool(b.logit_bias), "only an empty object is supported"),
    "prediction": (lambda b: b.prediction is not None, "predicted outputs are not supported"),
    "modalities": (lambda b: b.modalities not in (None, ["text"]), "only [\"text\"] is supported"),
    # Modelled for features to come (typed and validated already):
    "response_format": (lambda b: not isinstance(b.response_format, (TextFormat, type(None))),
                        "only {\"type\": \"text\"} is supported"),
    "reasoning_effort": (lambda b: b.reasoning_effort is not None,
                         "not supported; use chat_template_kwargs (e.g. enable_thinking)"),
    "tool_choice": (lambda b: b.tool_choice not in (None, "auto", "none"),
                    "only 'auto' or 'none'; 'required' and forcing a named function are not "
                    "supported"),
    "parallel_tool_calls": (lambda b: b.parallel_tool_calls is False, "only true is supported"),
    "prompt_cache_retention": (lambda b: b.prompt_cache_retention is not None,
                               "prompt cache retention is not supported"),
    # OpenAI parameters with no implementation here: any non-null value.
    **{name: ((lambda b, name=name: getattr(b, name) is not None), "not supported by this server")
       for name in ("audio", "functions", "function_call", "web_search_options", "verbosity")},
}


_MODELLED_AHEAD = ("response_format", "reasoning_effort", "parallel_tool_calls",
                   "prompt_cache_retention")


def _supported_parameters() -> tuple[str, ...]:
    """What the unsupported_parameter message lists as supported."""
    return SUPPORTED_PARAMETERS + tuple(
        name for name in _MODELLED_AHEAD if name not in _UNSUPPORTED_WHEN)


def _unsupported_in_body_order(body: dict[str, Any],
                               parsed: ChatCompletionBody) -> list[tuple[str, str]]:
    """Every unsupported parameter, ordered as the client's body orders its keys."""
    out: list[tuple[str, str]] = []
    for key in body:
        if key not in ChatCompletionBody.model_fields:
            out.append((_printable(key), "unknown parameter"))
        elif key in _UNSUPPORTED_WHEN and _UNSUPPORTED_WHEN[key][0](parsed):
            out.append((key, _UNSUPPORTED_WHEN[key][1]))
    return out


# --- normalization ----------------------------------------------------------------------------


def _text(content: str | list[TextPart]) -> str:
    if isinstance(content, str):
        return content
    # "\n" as separator: parts are usually separate passages (instructions, a document,
    # a question); gluing them with "" would merge the last word of one into the next.
    return "\n".join(part.text for part in content)


def _decode_arguments(arguments: str) -> Any:
    """Tool-call arguments for templates: a dict when ``arguments`` is a JSON object, else the
    string unchanged (HF templates either iterate the object or print the string). Validation
    already made sure decoding is safe."""
    try:
        decoded = _loads(arguments)
    except ValueError:
        return arguments
    return decoded if isinstance(decoded, dict) else arguments


def _message(msg: SystemMessage | UserMessage | AssistantMessage | ToolMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role}
    # Templates concatenate content; None would break them.
    out["content"] = "" if msg.content is None else _text(msg.content)
    if msg.name is not None:
        out["name"] = msg.name
    if isinstance(msg, AssistantMessage):
        if msg.tool_calls:
            out["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _decode_arguments(call.function.arguments)}}
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


def _response_format(fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> dict[str, Any] | None:
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, JsonObjectFormat):
        return {"type": "json_object"}
    spec = fmt.json_schema.model_dump(by_alias=True, exclude_none=True)
    return {"type": "json_schema", "json_schema": spec}


def _normalize(body: ChatCompletionBody) -> ChatRequest:
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
    )


if __name__ == "__main__":
    print(json.dumps(request_json_schema(), indent=2, ensure_ascii=False))
