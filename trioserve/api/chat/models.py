"""The body of ``POST /v1/chat/completions`` as pydantic models (spec/README.md §5).

The models state each parameter's type, range (from ``limits.py``) and role-dependent rules;
``api/chat/validation.py`` runs them and ``api.validation.translate_error`` translates their
first error into the contract's error envelope. Why that translation is exact (field order,
nulls, discriminated unions, ``subpath``) is explained in ``api/body.py``, which holds the
building blocks every API's models share; the errors of the chat unions tagged by a message's
``role`` and a response format's ``type`` are :data:`TAG_ERRORS`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from trioserve import limits, strict_json
from trioserve.api.body import (
    NOT_UNICODE,
    INTEGRAL,
    Integer,
    JsonObject,
    NullOnly,
    Stop,
    StreamOptions,
    StrictModel,
    Text,
    by_json_kind,
    invalid,
    tagged_by,
    unicode_checks,
)
from trioserve.core.request import Arguments
from trioserve.model.chat_template import RESERVED_TEMPLATE_VARIABLES

__all__ = ["ChatCompletionBody", "TAG_ERRORS"]

ROLES = ("system", "developer", "user", "assistant", "tool")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


# --- the models (stage 3) -------------------------------------------------------------------


class TextPart(StrictModel):
    """``{"type": "text", "text": str}``; other part types are invalid_value on the part."""

    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _only_text_parts(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("type"), str) and data["type"] != "text":
            # spec §5.5: invalid_value on the part, not unsupported_parameter (it is a value
            # of messages, not a parameter). json.dumps: the type may not be valid Unicode.
            raise invalid('only text content parts ({"type": "text", "text": ...}) are '
                           f"supported, got {json.dumps(data['type'])}.")
        return data


Content = Annotated[
    Annotated[Text, Tag("json:string")] | Annotated[list[TextPart], Tag("json:array")],
    by_json_kind("a string or an array of content parts", "string", "array")]


class ToolCallFunction(StrictModel):
    name: Text
    arguments: Text
    _decoded: Arguments = PrivateAttr(default="")

    @model_validator(mode="after")
    def _decode_arguments_once(self, info: ValidationInfo) -> ToolCallFunction:
        """Decode ``arguments`` once, here (templates read a JSON object decoded, any other
        text as it is: :data:`~trioserve.core.request.Arguments`); decoded JSON must be as sane
        as a body: bounded nesting, valid Unicode. Runs right after the field (the model's last),
        so a problem is still reported in the body's order, at ``…function.arguments``."""
        try:
            decoded = strict_json.loads(self.arguments)
        except strict_json.TooDeep as exc:
            raise invalid(f"the JSON in it is {exc}.", ".arguments") from None
        except ValueError:
            self._decoded = self.arguments  # not JSON: passed to the template as it is
            return self
        if unicode_checks(info) and (bad := strict_json.first_lone_surrogate(decoded)) is not None:
            subpath, problem = bad
            where = f" in {subpath}" if subpath else ""
            raise invalid(f"the JSON in it has {problem}{where}, {NOT_UNICODE}.", ".arguments")
        self._decoded = decoded if isinstance(decoded, dict) else self.arguments
        return self

    @property
    def decoded(self) -> Arguments:
        """The arguments as templates read them, decoded by validation."""
        return self._decoded


class ToolCall(StrictModel):
    id: Text
    type: Literal["function"] | None = None
    function: ToolCallFunction


class SystemMessage(StrictModel):
    role: Literal["system", "developer"]
    content: Content
    name: Text | None = None


class UserMessage(StrictModel):
    role: Literal["user"]
    content: Content
    name: Text | None = None


class AssistantMessage(StrictModel):
    role: Literal["assistant"]
    # Before content: whether content may be null depends on them.
    tool_calls: list[ToolCall] | None = None
    # What the assistant said when it refused: its text, after the content (as Responses'
    # refusal parts are, spec §20.2); an echoed response message carries it.
    refusal: Text | None = None
    content: Content | None = Field(default=None, validate_default=True)
    name: Text | None = None
    # Passed through for templates that replay reasoning (Qwen3 does, after the last user
    # turn); a non-string is a client bug worth reporting.
    reasoning_content: Text | None = None
    # OpenAI's reference to an earlier audio answer and its deprecated single call: they would
    # change what the model sees and this server has neither, so a non-null value is
    # unsupported_parameter naming it (validation stage 4), never dropped. null (what an echoed
    # response message holds) is accepted.
    audio: NullOnly = None
    function_call: NullOnly = None

    @field_validator("content")
    @classmethod
    def _content_or_tool_calls(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and not info.data.get("tool_calls") and info.data.get("refusal") is None:
            raise PydanticCustomError("missing", "Field required")
        return content


class ToolMessage(StrictModel):
    role: Literal["tool"]
    content: Content
    name: Text | None = None
    tool_call_id: Text


# Unknown keys in a message, a text part, a tool call or its function (annotations, a
# harness's metadata, ...) are ignored and reported (validation.ignored_in_messages; spec
# §4.1): clients echo back whole response messages, and harnesses add metadata fields every
# release; rejecting them would break every multi-turn conversation. Top-level parameters, by
# contrast, are never ignored.
Message = Annotated[
    Annotated[SystemMessage, Tag("role:system")] | Annotated[SystemMessage, Tag("role:developer")]
    | Annotated[UserMessage, Tag("role:user")] | Annotated[AssistantMessage, Tag("role:assistant")]
    | Annotated[ToolMessage, Tag("role:tool")],
    tagged_by("role", ROLES, "bad_message_role")]


# OpenAI's rule for function names; also keeps names safe inside templates and tool-call tags.
_TOOL_NAME_PATTERN = "^[A-Za-z0-9_-]{1,64}$"
_TOOL_NAME_RE = re.compile(_TOOL_NAME_PATTERN)


def _valid_tool_name(name: str) -> str:
    if not _TOOL_NAME_RE.match(name):
        raise invalid(f"{json.dumps(name)}; names are 1-64 characters of a-z, A-Z, 0-9, '_' "
                       "and '-'.")
    return name


ToolName = Annotated[str, AfterValidator(_valid_tool_name),
                     WithJsonSchema({"type": "string", "pattern": _TOOL_NAME_PATTERN})]


class FunctionDefinition(StrictModel):
    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None
    # Accepted; we do not constrain decoding, so it changes nothing.
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


def _unique_tool_names(tools: list[Tool]) -> list[Tool]:
    # Runs once every tool is valid, so a duplicate is reported after any other problem in
    # the tools array.
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise invalid(f"duplicate tool name '{name}'.", f"[{i}].function.name")
        seen.add(name)
    return tools


class NamedFunction(StrictModel):
    name: Text


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("json:string")]
    | Annotated[NamedToolChoice, Tag("json:object")],
    by_json_kind("'auto', 'none', 'required' or an object", "string", "object")]

class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    # OpenAI requires a name; nothing here needs one, so it is optional.
    name: Text | None = None
    description: Text | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("type:text")] | Annotated[JsonObjectFormat, Tag("type:json_object")]
    | Annotated[JsonSchemaFormat, Tag("type:json_schema")],
    tagged_by("type", RESPONSE_FORMAT_TYPES, "bad_response_format_type")]


def _no_reserved_template_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    for key in kwargs:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise invalid("this template variable is set by the server and cannot be "
                           "overridden.", f".{key}")
    return kwargs


class ChatCompletionBody(StrictModel):
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
    top_k: Annotated[int, Field(ge=limits.TOP_K_MIN), INTEGRAL] | None = Field(
        default=None, description="0 = off; values above 2^31 - 1 are clamped to it")
    seed: Annotated[int, Field(ge=limits.SEED_MIN, le=limits.SEED_MAX), INTEGRAL] | None = Field(
        default=None, description="absent, null or -1: random; else reduced modulo 2^32 - 1")
    max_tokens: Annotated[int, Field(ge=limits.MAX_TOKENS_MIN), INTEGRAL] | None = Field(
        default=None, description="values above the room left in the context are clamped")
    max_completion_tokens: Annotated[int, Field(ge=limits.MAX_TOKENS_MIN), INTEGRAL] | None = Field(
        default=None, description="as max_tokens; the smaller of both wins")
    stop: Stop | None = None
    n: Annotated[int, Field(ge=limits.N_MIN), INTEGRAL] | None = None
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
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    user: Text | None = None
    store: bool | None = None
    metadata: JsonObject | None = None
    service_tier: Text | None = None
    prediction: JsonObject | None = None
    modalities: list[Text] | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    session_id: Text | None = None  # trioserve extension: session key (spec §12)
    safety_identifier: Text | None = None
    audio: NullOnly = None
    functions: NullOnly = None
    function_call: NullOnly = None
    web_search_options: NullOnly = None
    verbosity: NullOnly = None
    # ROUTER_WRITTEN_DEFAULTS (accepted at that value only).
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    continue_final_message: bool | None = None
    skip_special_tokens: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None
    return_hidden_states: bool | None = None


# Errors of tagged_by unions: (the key that picks the branch, its allowed values).
TAG_ERRORS = {
    "bad_message_role": ("role", ROLES),
    "bad_response_format_type": ("type", RESPONSE_FORMAT_TYPES),
}
