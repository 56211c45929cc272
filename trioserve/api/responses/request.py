"""Validation of ``POST /v1/responses`` bodies into the API-neutral ``CoreRequest`` (spec §20).

Pure: a parsed JSON object in, a :class:`ResponsesRequest` or an ``APIError`` out. Every problem
is a 400 in OpenAI's error shape naming the exact path (``input[2].content[0].type``,
``tools[3]``); a field or item type this server does not implement is ``unsupported_parameter``
naming it, never silently dropped — except hosted tools (``web_search`` …), which the server
cannot run: they are not offered to the model and are listed in ``ignored_tools`` for the
response header (spec §20.4); and keys an input item or content part does not know (harness
metadata), listed in ``ignored_fields`` for theirs (spec §4.1).

Mapping (spec §20.2):

- ``instructions`` and ``system``/``developer`` messages → system messages (a run of them at the
  start of the conversation is joined into one: many chat templates accept a single leading
  system message only);
- ``message`` items with ``input_text``/``output_text``/``refusal`` parts → user/assistant text;
- consecutive ``reasoning``, assistant ``message``, ``function_call`` and ``custom_tool_call``
  items → ONE assistant turn (reasoning text, content, calls in order);
- ``function_call_output`` / ``custom_tool_call_output`` → tool results;
- ``function`` tools → function tools; ``namespace`` tools → their function tools flattened as
  ``<namespace>__<name>`` (calls map back to ``name`` + ``namespace``); freeform ``custom`` tools
  with ``format: text`` (or none) → a function taking ``{"input": string}`` (calls map back to
  ``custom_tool_call`` items); a custom tool with a grammar format → 400 naming the tool (this
  server cannot enforce Lark or regex grammars).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trioserve.core.model_names import ModelNames, check_model
from trioserve import errors, limits
from trioserve.core.request import (
    CoreRequest,
    FunctionTool,
    JsonObjectOutput,
    JsonSchemaOutput,
    Message,
    OutputFormat,
    ParamPaths,
    Sampling,
    ToolChoice,
)
from trioserve.core.sessions import SessionKey, worker_retention
from trioserve.api.ignored_fields import IgnoredFields
from trioserve.api.responses.input import input_item_list, parse_input
from trioserve.api.responses.tools import ToolMapping, parse_tool_choice, parse_tools
from trioserve.api.responses.values import (
    bool_value,
    integer_value,
    invalid,
    number_value,
    object_value,
    optional_string,
    printable,
    string_value,
    type_name,
    wrong_type,
)

__all__ = ["ResponsesRequest", "parse_responses_body", "PARAM_PATHS"]

log = logging.getLogger("trioserve.responses")


# Where a Responses body keeps the fields the core's errors name (the client's own paths;
# function tools carry their own ``parameters_param``: hosted tools are dropped, namespaces
# flattened, so a tool's position in the core request is not its position in the body).
PARAM_PATHS = ParamPaths(messages="input", tool_parameters="tools[{index}].parameters",
                         forced_tool="tool_choice.name", output_format="text.format",
                         output_schema="text.format.schema", reasoning_effort="reasoning.effort")


_SCHEMA_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_INCLUDES_ACCEPTED = frozenset({"reasoning.encrypted_content"})
_MAX_METADATA_PAIRS = 16

# Every top-level key this API knows; anything else is unsupported (named in the 400).
_KNOWN = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
          "text", "reasoning", "max_output_tokens", "temperature", "top_p", "stream",
          "stream_options", "store", "previous_response_id", "include", "metadata",
          "client_metadata", "prompt_cache_key", "prompt_cache_retention", "user",
          "safety_identifier", "service_tier", "truncation", "top_logprobs", "background",
          "max_tool_calls", "conversation", "prompt")




@dataclass
class ResponsesRequest:
    """A validated Responses request: the core request's parts plus what the response echoes."""

    model: str
    messages: list[Message]  # this request's input (instructions excluded)
    instructions: str | None
    tools: tuple[FunctionTool, ...]
    tool_map: dict[str, ToolMapping]  # model-facing name -> the client's tool
    ignored_tools: list[str]  # hosted tool types not offered to the model
    tool_choice: ToolChoice
    tool_choice_echo: Any
    parallel_tool_calls: bool
    output_format: OutputFormat | None
    text_echo: dict[str, Any]
    reasoning_effort: str | None
    reasoning_echo: dict[str, Any]
    max_output_tokens: int | None
    temperature: float
    top_p: float
    stream: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    prompt_cache_key: str | None
    prompt_cache_retention: str | None
    user: str | None
    tools_echo: list[Any] = field(default_factory=list)
    # The input as OpenAI lists a stored response's input items (GET …/input_items).
    input_items: list[dict[str, Any]] = field(default_factory=list)
    # Keys inside input items and content parts that were not used (spec §4.1).
    ignored_fields: IgnoredFields = field(default_factory=IgnoredFields)

    def core_request(self, history: tuple[Message, ...], session: SessionKey | None) -> CoreRequest:
        """The API-neutral request: instructions, then ``history`` (the stored conversation of
        ``previous_response_id``), then this request's input."""
        messages = list(history) + self.messages
        if self.instructions:
            messages.insert(0, Message("system", self.instructions))
        return CoreRequest(
            messages=tuple(_join_leading_system(messages)), tools=self.tools,
            tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls,
            output_format=self.output_format,
            sampling=Sampling(temperature=self.temperature, top_p=self.top_p),
            max_tokens=self.max_output_tokens, session=session,
            retention=worker_retention(self.prompt_cache_retention),
            reasoning_effort=self.reasoning_effort, params=PARAM_PATHS)


def _join_leading_system(messages: list[Message]) -> list[Message]:
    head: list[str] = []
    while len(head) < len(messages) and messages[len(head)].role == "system":
        head.append(messages[len(head)].text)
    if len(head) < 2:
        return messages
    return [Message("system", "\n\n".join(head))] + messages[len(head):]


# --- the body ---------------------------------------------------------------------------------


def parse_responses_body(obj: dict[str, Any], *, served_model: str,
                         names: ModelNames | None = None) -> ResponsesRequest:
    """Validate a decoded body (a JSON object). Raises APIError: unsupported parameters first
    (all of them in one 400), then the first invalid value, then an unknown model (404)."""
    unknown = [(printable(k), "unknown parameter") for k in obj if k not in _KNOWN]
    unknown += _unsupported_values(obj)
    if unknown:
        raise errors.unsupported_parameters(unknown)
    if obj.get("model") is None:
        raise errors.missing_required_parameter("model")
    model = string_value(obj["model"], "model")
    if obj.get("input") is None:
        raise errors.missing_required_parameter("input")
    instructions = optional_string(obj, "instructions", "instructions")
    stream = obj.get("stream") is not None and bool_value(obj["stream"], "stream")
    if obj.get("stream_options") is not None:
        options = object_value(obj["stream_options"], "stream_options")
        if options.get("include_obfuscation") is not None:
            bool_value(options["include_obfuscation"], "stream_options.include_obfuscation")
    tools, tool_map, ignored, tools_echo = parse_tools(obj.get("tools"))
    choice, choice_echo = parse_tool_choice(obj.get("tool_choice"), tool_map)
    parallel = obj.get("parallel_tool_calls") is None or bool_value(obj["parallel_tool_calls"],
                                                                "parallel_tool_calls")
    output_format, text_echo = _text_config(obj.get("text"))
    effort, reasoning_echo = _reasoning(obj.get("reasoning"))
    max_output = None
    if obj.get("max_output_tokens") is not None:
        max_output = integer_value(obj["max_output_tokens"], "max_output_tokens")
        if max_output < limits.MAX_TOKENS_MIN:
            raise invalid("max_output_tokens", f"{max_output} is not ≥ {limits.MAX_TOKENS_MIN}.")
        max_output = min(max_output, limits.INT32_MAX)
    temperature = 1.0
    if obj.get("temperature") is not None:
        temperature = number_value(obj["temperature"], "temperature")
        if not limits.TEMPERATURE_MIN <= temperature <= limits.TEMPERATURE_MAX:
            raise invalid("temperature", f"{temperature:g} is not in [{limits.TEMPERATURE_MIN:g}, "
                           f"{limits.TEMPERATURE_MAX:g}].")
    top_p = 1.0
    if obj.get("top_p") is not None:
        top_p = number_value(obj["top_p"], "top_p")
        if not limits.TOP_P_MIN_EXCLUSIVE < top_p <= limits.TOP_P_MAX:
            raise invalid("top_p", f"{top_p:g} is not in (0, 1].")
    store = obj.get("store") is None or bool_value(obj["store"], "store")
    previous = optional_string(obj, "previous_response_id", "previous_response_id")
    if obj.get("include") is not None:
        include = obj["include"]
        if not isinstance(include, list):
            raise wrong_type("include", "an array of strings", include)
        for i, value in enumerate(include):
            string_value(value, f"include[{i}]")
    metadata = _metadata(obj.get("metadata"))
    if obj.get("client_metadata") is not None:
        object_value(obj["client_metadata"], "client_metadata")
    cache_key = optional_string(obj, "prompt_cache_key", "prompt_cache_key")
    retention = optional_string(obj, "prompt_cache_retention", "prompt_cache_retention")
    if retention is not None and retention not in ("in_memory", "24h"):
        raise invalid("prompt_cache_retention", f"{json.dumps(retention)}; expected in_memory or 24h.")
    for key in ("user", "safety_identifier", "service_tier"):
        optional_string(obj, key, key)
    ignored_fields = IgnoredFields()
    messages = parse_input(obj["input"], tool_map, ignored_fields)
    check_model(model, served_model, names, "responses")
    return ResponsesRequest(
        model=model, messages=messages, instructions=instructions, tools=tools, tool_map=tool_map,
        ignored_tools=ignored, tool_choice=choice, tool_choice_echo=choice_echo,
        parallel_tool_calls=parallel, output_format=output_format, text_echo=text_echo,
        reasoning_effort=effort, reasoning_echo=reasoning_echo, max_output_tokens=max_output,
        temperature=temperature, top_p=top_p, stream=stream, store=store,
        previous_response_id=previous, metadata=metadata, prompt_cache_key=cache_key,
        prompt_cache_retention=retention, user=obj.get("user"), tools_echo=tools_echo,
        input_items=input_item_list(obj["input"]) if store else [],
        ignored_fields=ignored_fields)


def _unsupported_values(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """Known parameters whose given value this server does not implement."""
    out: list[tuple[str, str]] = []
    checks: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
        ("truncation", lambda v: v not in (None, "disabled"), "only 'disabled' is supported"),
        ("top_logprobs", lambda v: v not in (None, 0), "log probabilities are not supported"),
        ("background", lambda v: v not in (None, False), "background responses are not supported"),
        ("max_tool_calls", lambda v: v is not None, "not supported by this server"),
        ("conversation", lambda v: v is not None,
         "conversations are not supported; use previous_response_id or send the whole input"),
        ("prompt", lambda v: v is not None, "prompt templates are not supported"),
    )
    for key, unsupported, reason in checks:
        if key in obj and unsupported(obj[key]):
            out.append((key, reason))
    include = obj.get("include")
    if isinstance(include, list):
        for i, value in enumerate(include):
            if isinstance(value, str) and value not in _INCLUDES_ACCEPTED:
                out.append((f"include[{i}]", f"{json.dumps(value)} is not supported"))
    text = obj.get("text")
    if isinstance(text, dict) and text.get("verbosity") not in (None, "medium"):
        out.append(("text.verbosity", "only 'medium' is supported"))
    return out


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    meta = object_value(value, "metadata")
    if len(meta) > _MAX_METADATA_PAIRS:
        raise invalid("metadata", f"at most {_MAX_METADATA_PAIRS} pairs, got {len(meta)}.")
    for key, item in meta.items():
        string_value(key, "metadata")
        if len(key) > 64:
            raise invalid("metadata", f"keys are at most 64 characters, got {len(key)}.")
        string_value(item, f"metadata.{key}")
        if len(item) > 512:
            raise invalid(f"metadata.{key}", f"values are at most 512 characters, got {len(item)}.")
    return dict(meta)


def _reasoning(value: Any) -> tuple[str | None, dict[str, Any]]:
    if value is None:
        return None, {"effort": None, "summary": None}
    config = object_value(value, "reasoning")
    effort = config.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise invalid("reasoning.effort", f"{json.dumps(effort)}; expected one of {', '.join(_EFFORTS)}.")
    summary = config.get("summary", config.get("generate_summary"))
    if summary is not None and summary not in ("auto", "concise", "detailed"):
        raise invalid("reasoning.summary", f"{json.dumps(summary)}; expected auto, concise or detailed.")
    return effort, {"effort": effort, "summary": summary}


def _text_config(value: Any) -> tuple[OutputFormat | None, dict[str, Any]]:
    if value is None:
        return None, {"format": {"type": "text"}}
    config = object_value(value, "text")
    fmt = config.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    fmt = object_value(fmt, "text.format")
    kind = fmt.get("type")
    if kind is None:
        raise errors.missing_required_parameter("text.format.type")
    if kind == "text":
        return None, {"format": {"type": "text"}}
    if kind == "json_object":
        return JsonObjectOutput(), {"format": {"type": "json_object"}}
    if kind != "json_schema":
        shown = json.dumps(kind) if isinstance(kind, str) else type_name(kind)
        raise invalid("text.format.type", f"{shown}; expected text, json_object or json_schema.")
    name = fmt.get("name")
    if name is None:
        raise errors.missing_required_parameter("text.format.name")
    if not isinstance(name, str) or not _SCHEMA_NAME_RE.match(name):
        raise invalid("text.format.name", "1-64 characters of a-z, A-Z, 0-9, '_' and '-'.")
    description = optional_string(fmt, "description", "text.format.description")
    strict = fmt.get("strict")
    if strict is not None:
        bool_value(strict, "text.format.strict")
    schema = fmt.get("schema")
    if schema is None:
        raise errors.missing_required_parameter("text.format.schema")
    if not isinstance(schema, dict):
        raise wrong_type("text.format.schema", "a JSON Schema object", schema)
    echo = {"type": "json_schema", "name": name, "schema": schema, "strict": strict,
            "description": description}
    return JsonSchemaOutput(name=name, schema=schema, description=description, strict=strict), {"format": echo}
