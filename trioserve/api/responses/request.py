"""Validation of ``POST /v1/responses`` bodies into the API-neutral ``CoreRequest`` (spec §20).

Pure: a parsed JSON object in, a :class:`ResponsesRequest` or an ``APIError`` out. Every problem
is a 400 in OpenAI's error shape naming the exact path (``input[2].content[0].type``,
``tools[3]``); a field or item type this server does not implement is ``unsupported_parameter``
naming it, never silently dropped — except hosted tools (``web_search`` …), which the server
cannot run: they are not offered to the model and are listed in ``ignored_tools`` for the
response header (the one documented exception, spec §20.4).

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
import secrets
from dataclasses import dataclass, field
from typing import Any

from trioserve.core.model_names import ModelNames, check_model
from trioserve import errors, limits, strict_json
from trioserve.core.request import (
    CoreRequest,
    ForcedTool,
    FunctionTool,
    JsonObjectOutput,
    JsonSchemaOutput,
    Message,
    OutputFormat,
    Sampling,
    ToolCallPart,
    ToolChoice,
)
from trioserve.core.sessions import SessionKey, worker_retention

__all__ = ["ResponsesRequest", "ToolMapping", "parse_responses_body", "HOSTED_TOOL_TYPES",
           "PARAM_NAMES", "CUSTOM_INPUT_KEY"]

log = logging.getLogger("trioserve.responses")

# Tools OpenAI runs on its own servers: a local server cannot, and a 400 would lock agents
# such as Codex (which always sends web_search) out. Not offered to the model; reported.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "code_interpreter", "image_generation", "mcp", "computer_use_preview",
    "computer_use", "tool_search",
})

# How the core's parameter names read in this API (errors name the client's own fields).
PARAM_NAMES = {
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "messages": "input",
    "tools": "tools",
    "tool_choice": "tool_choice",
}

# The one argument of a freeform custom tool offered to the model as a function.
CUSTOM_INPUT_KEY = "input"
NAMESPACE_SEPARATOR = "__"

_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
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


@dataclass(frozen=True)
class ToolMapping:
    """How a name the model calls maps back to a Responses item: ``kind`` ``function`` or
    ``custom``; ``name`` and ``namespace`` as the client declared them."""

    kind: str
    name: str
    namespace: str | None = None


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
            reasoning_effort=self.reasoning_effort, param_names=dict(PARAM_NAMES))


def _join_leading_system(messages: list[Message]) -> list[Message]:
    head: list[str] = []
    while len(head) < len(messages) and messages[len(head)].role == "system":
        head.append(messages[len(head)].text)
    if len(head) < 2:
        return messages
    return [Message("system", "\n\n".join(head))] + messages[len(head):]


# --- small validators -------------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return strict_json.json_type_name(value)


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _wrong_type(param: str, expected: str, value: Any) -> errors.APIError:
    return errors.invalid_value(
        f"Invalid type for '{param}': expected {expected}, got {_type_name(value)}.", param)


def _invalid(param: str, detail: str) -> errors.APIError:
    return errors.invalid_value(f"Invalid value for '{param}': {detail}", param)


def _unsupported(param: str, reason: str) -> errors.APIError:
    return errors.unsupported_parameters([(param, reason)])


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _wrong_type(param, "a string", value)
    if (where := strict_json.lone_surrogate(value)) is not None:
        raise _invalid(param, f"contains a lone surrogate ({where}), which is not valid Unicode.")
    return value


def _opt_text(obj: dict[str, Any], key: str, param: str) -> str | None:
    value = obj.get(key)
    return None if value is None else _text(value, param)


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _wrong_type(param, "an object", value)
    return value


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(param, "a boolean", value)
    return value


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(param, "a number", value)
    return float(value)


def bounded_integer(value: Any, param: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(param, "an integer", value)
    return value


# --- the body ---------------------------------------------------------------------------------


def parse_responses_body(obj: dict[str, Any], *, served_model: str,
                         names: ModelNames | None = None) -> ResponsesRequest:
    """Validate a decoded body (a JSON object). Raises APIError: unsupported parameters first
    (all of them in one 400), then the first invalid value, then an unknown model (404)."""
    unknown = [(_printable(k), "unknown parameter") for k in obj if k not in _KNOWN]
    unknown += _unsupported_values(obj)
    if unknown:
        raise errors.unsupported_parameters(unknown)
    if obj.get("model") is None:
        raise errors.missing_required_parameter("model")
    model = _text(obj["model"], "model")
    if obj.get("input") is None:
        raise errors.missing_required_parameter("input")
    instructions = _opt_text(obj, "instructions", "instructions")
    stream = obj.get("stream") is not None and _bool(obj["stream"], "stream")
    if obj.get("stream_options") is not None:
        options = _object(obj["stream_options"], "stream_options")
        if options.get("include_obfuscation") is not None:
            _bool(options["include_obfuscation"], "stream_options.include_obfuscation")
    tools, tool_map, ignored, tools_echo = _tools(obj.get("tools"))
    choice, choice_echo = _tool_choice(obj.get("tool_choice"), tool_map)
    parallel = obj.get("parallel_tool_calls") is None or _bool(obj["parallel_tool_calls"],
                                                                "parallel_tool_calls")
    output_format, text_echo = _text_config(obj.get("text"))
    effort, reasoning_echo = _reasoning(obj.get("reasoning"))
    max_output = None
    if obj.get("max_output_tokens") is not None:
        max_output = bounded_integer(obj["max_output_tokens"], "max_output_tokens")
        if max_output < limits.MAX_TOKENS_MIN:
            raise _invalid("max_output_tokens", f"{max_output} is not ≥ {limits.MAX_TOKENS_MIN}.")
        max_output = min(max_output, limits.INT32_MAX)
    temperature = 1.0
    if obj.get("temperature") is not None:
        temperature = _number(obj["temperature"], "temperature")
        if not limits.TEMPERATURE_MIN <= temperature <= limits.TEMPERATURE_MAX:
            raise _invalid("temperature", f"{temperature:g} is not in [{limits.TEMPERATURE_MIN:g}, "
                           f"{limits.TEMPERATURE_MAX:g}].")
    top_p = 1.0
    if obj.get("top_p") is not None:
        top_p = _number(obj["top_p"], "top_p")
        if not limits.TOP_P_MIN_EXCLUSIVE < top_p <= limits.TOP_P_MAX:
            raise _invalid("top_p", f"{top_p:g} is not in (0, 1].")
    store = obj.get("store") is None or _bool(obj["store"], "store")
    previous = _opt_text(obj, "previous_response_id", "previous_response_id")
    if obj.get("include") is not None:
        include = obj["include"]
        if not isinstance(include, list):
            raise _wrong_type("include", "an array of strings", include)
        for i, value in enumerate(include):
            _text(value, f"include[{i}]")
    metadata = _metadata(obj.get("metadata"))
    if obj.get("client_metadata") is not None:
        _object(obj["client_metadata"], "client_metadata")
    cache_key = _opt_text(obj, "prompt_cache_key", "prompt_cache_key")
    retention = _opt_text(obj, "prompt_cache_retention", "prompt_cache_retention")
    if retention is not None and retention not in ("in_memory", "24h"):
        raise _invalid("prompt_cache_retention", f"{json.dumps(retention)}; expected in_memory or 24h.")
    for key in ("user", "safety_identifier", "service_tier"):
        _opt_text(obj, key, key)
    messages = _input(obj["input"], tool_map)
    check_model(model, served_model, names, "responses")
    return ResponsesRequest(
        model=model, messages=messages, instructions=instructions, tools=tools, tool_map=tool_map,
        ignored_tools=ignored, tool_choice=choice, tool_choice_echo=choice_echo,
        parallel_tool_calls=parallel, output_format=output_format, text_echo=text_echo,
        reasoning_effort=effort, reasoning_echo=reasoning_echo, max_output_tokens=max_output,
        temperature=temperature, top_p=top_p, stream=stream, store=store,
        previous_response_id=previous, metadata=metadata, prompt_cache_key=cache_key,
        prompt_cache_retention=retention, user=obj.get("user"), tools_echo=tools_echo,
        input_items=_input_items(obj["input"]) if store else [])


def _unsupported_values(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """Known parameters whose given value this server does not implement."""
    out: list[tuple[str, str]] = []
    checks = (
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
    meta = _object(value, "metadata")
    if len(meta) > _MAX_METADATA_PAIRS:
        raise _invalid("metadata", f"at most {_MAX_METADATA_PAIRS} pairs, got {len(meta)}.")
    for key, item in meta.items():
        _text(key, "metadata")
        if len(key) > 64:
            raise _invalid("metadata", f"keys are at most 64 characters, got {len(key)}.")
        _text(item, f"metadata.{key}")
        if len(item) > 512:
            raise _invalid(f"metadata.{key}", f"values are at most 512 characters, got {len(item)}.")
    return dict(meta)


def _reasoning(value: Any) -> tuple[str | None, dict[str, Any]]:
    if value is None:
        return None, {"effort": None, "summary": None}
    config = _object(value, "reasoning")
    effort = config.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise _invalid("reasoning.effort", f"{json.dumps(effort)}; expected one of {', '.join(_EFFORTS)}.")
    summary = config.get("summary", config.get("generate_summary"))
    if summary is not None and summary not in ("auto", "concise", "detailed"):
        raise _invalid("reasoning.summary", f"{json.dumps(summary)}; expected auto, concise or detailed.")
    return effort, {"effort": effort, "summary": summary}


def _text_config(value: Any) -> tuple[OutputFormat | None, dict[str, Any]]:
    if value is None:
        return None, {"format": {"type": "text"}}
    config = _object(value, "text")
    fmt = config.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    fmt = _object(fmt, "text.format")
    kind = fmt.get("type")
    if kind is None:
        raise errors.missing_required_parameter("text.format.type")
    if kind == "text":
        return None, {"format": {"type": "text"}}
    if kind == "json_object":
        return JsonObjectOutput(), {"format": {"type": "json_object"}}
    if kind != "json_schema":
        shown = json.dumps(kind) if isinstance(kind, str) else _type_name(kind)
        raise _invalid("text.format.type", f"{shown}; expected text, json_object or json_schema.")
    name = fmt.get("name")
    if name is None:
        raise errors.missing_required_parameter("text.format.name")
    if not isinstance(name, str) or not _SCHEMA_NAME_RE.match(name):
        raise _invalid("text.format.name", "1-64 characters of a-z, A-Z, 0-9, '_' and '-'.")
    description = _opt_text(fmt, "description", "text.format.description")
    strict = fmt.get("strict")
    if strict is not None:
        _bool(strict, "text.format.strict")
    schema = fmt.get("schema")
    if schema is None:
        raise errors.missing_required_parameter("text.format.schema")
    if not isinstance(schema, dict):
        raise _wrong_type("text.format.schema", "a JSON Schema object", schema)
    echo = {"type": "json_schema", "name": name, "schema": schema, "strict": strict,
            "description": description}
    return JsonSchemaOutput(name=name, schema=schema, description=description, strict=strict), {"format": echo}


# --- tools ------------------------------------------------------------------------------------


def _tools(value: Any) -> tuple[tuple[FunctionTool, ...], dict[str, ToolMapping], list[str], list[Any]]:
    """The tools offered to the model, the name map back, the ignored hosted tool types and
    the tools as echoed in the response."""
    if value is None:
        return (), {}, [], []
    if not isinstance(value, list):
        raise _wrong_type("tools", "an array", value)
    tools: list[FunctionTool] = []
    mapping: dict[str, ToolMapping] = {}
    ignored: list[str] = []

    def add(model_name: str, tool: FunctionTool, target: ToolMapping, param: str) -> None:
        if model_name in mapping:
            raise _invalid(param, f"duplicate tool name '{model_name}'.")
        if not _TOOL_NAME_RE.match(model_name):
            raise _invalid(param, f"{json.dumps(model_name)}; names are 1-64 characters of a-z, "
                           "A-Z, 0-9, '_' and '-'.")
        mapping[model_name] = target
        tools.append(tool)

    for i, raw in enumerate(value):
        param = f"tools[{i}]"
        tool = _object(raw, param)
        kind = tool.get("type")
        if kind is None:
            raise errors.missing_required_parameter(f"{param}.type")
        if kind == "function":
            fn = _function_tool(tool, param)
            add(fn.name, fn, ToolMapping("function", fn.name), f"{param}.name")
        elif kind == "namespace":
            namespace = _text(tool.get("name"), f"{param}.name")
            nested = tool.get("tools")
            if not isinstance(nested, list):
                raise _wrong_type(f"{param}.tools", "an array", nested)
            for j, inner in enumerate(nested):
                inner_param = f"{param}.tools[{j}]"
                inner_tool = _object(inner, inner_param)
                if inner_tool.get("type") != "function":
                    raise _unsupported(f"{inner_param}.type", "a namespace may hold function tools only")
                fn = _function_tool(inner_tool, inner_param)
                flat = f"{namespace}{NAMESPACE_SEPARATOR}{fn.name}"
                add(flat, FunctionTool(flat, fn.description, fn.parameters),
                    ToolMapping("function", fn.name, namespace), f"{inner_param}.name")
        elif kind == "custom":
            name = _text(tool.get("name"), f"{param}.name")
            description = _opt_text(tool, "description", f"{param}.description")
            fmt = tool.get("format")
            if fmt is not None and _object(fmt, f"{param}.format").get("type") not in (None, "text"):
                raise _unsupported(
                    f"{param}.format",
                    f"the custom tool '{_printable(name)}' declares a "
                    f"{_printable(str(fmt.get('syntax') or fmt.get('type')))} grammar, which this "
                    "server cannot enforce; declare it as a function tool or without a grammar")
            parameters = {"type": "object", "properties": {CUSTOM_INPUT_KEY: {"type": "string"}},
                          "required": [CUSTOM_INPUT_KEY]}
            add(name, FunctionTool(name, description, parameters), ToolMapping("custom", name),
                f"{param}.name")
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            ignored.append(kind)
        else:
            shown = json.dumps(kind) if isinstance(kind, str) else _type_name(kind)
            raise _unsupported(f"{param}.type", f"tool type {_printable(shown)} is not supported; "
                               "supported: function, namespace, custom (freeform text); hosted "
                               "tools are not offered to the model")
    return tuple(tools), mapping, ignored, list(value)


def _function_tool(tool: dict[str, Any], param: str) -> FunctionTool:
    if tool.get("name") is None:
        raise errors.missing_required_parameter(f"{param}.name")
    name = _text(tool["name"], f"{param}.name")
    description = _opt_text(tool, "description", f"{param}.description")
    parameters = tool.get("parameters")
    if parameters is not None:
        parameters = _object(parameters, f"{param}.parameters")
        if (bad := strict_json.first_lone_surrogate(parameters)) is not None:
            raise _invalid(f"{param}.parameters{bad[0]}", f"contains {bad[1]}, which is not valid Unicode.")
    if tool.get("strict") is not None:
        _bool(tool["strict"], f"{param}.strict")
    return FunctionTool(name, description, parameters)


def _tool_choice(value: Any, tool_map: dict[str, ToolMapping]) -> tuple[ToolChoice, Any]:
    if value is None:
        return "auto", "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise _invalid("tool_choice", f"{json.dumps(value)}; expected auto, none, required or an object.")
        return value, value  # type: ignore[return-value]
    choice = _object(value, "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = _text(choice.get("name"), "tool_choice.name")
        namespace = choice.get("namespace")
        for model_name, target in tool_map.items():
            if target.kind == kind and target.name == name and target.namespace == namespace:
                return ForcedTool(model_name), choice
        raise _invalid("tool_choice.name", f"{json.dumps(name)} is not one of the declared {kind} tools.")
    shown = json.dumps(kind) if isinstance(kind, str) else _type_name(kind)
    raise _unsupported("tool_choice.type", f"{_printable(shown)} is not supported; use auto, none, "
                       "required, or a function or custom tool")


# --- input ------------------------------------------------------------------------------------


def model_tool_name(tool_map: dict[str, ToolMapping], kind: str, name: str,
                    namespace: str | None) -> str:
    """The model-facing name of a call the client sent back (the flattened name of a
    namespaced function; the name itself when the tool is not declared in this request)."""
    for model_name, target in tool_map.items():
        if target.kind == kind and target.name == name and target.namespace == namespace:
            return model_name
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs", "custom_tool_call": "ctc",
                     "custom_tool_call_output": "ctco"}


def _input_items(value: Any) -> list[dict[str, Any]]:
    """The (validated) input as OpenAI's input-item list: a string is one user message; a
    message's string content becomes one ``input_text`` part (``output_text`` for the
    assistant); an item without an ``id`` gets one; ``status`` is ``completed``."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items: list[dict[str, Any]] = []
    for raw in value:
        item = dict(raw)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not item.get("id"):
            item["id"] = f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{secrets.token_hex(16)}"
        item.setdefault("status", "completed")
        items.append(item)
    return items


def _input(value: Any, tool_map: dict[str, ToolMapping]) -> list[Message]:
    if isinstance(value, str):
        return [Message("user", _text(value, "input"))]
    if not isinstance(value, list):
        raise _wrong_type("input", "a string or an array of input items", value)
    messages: list[Message] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def close_turn() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(Message("assistant", "\n".join(turn["text"]),
                                    reasoning="\n".join(turn["reasoning"]) or None,
                                    tool_calls=tuple(turn["calls"])))
            turn = None

    def open_turn() -> dict[str, Any]:
        nonlocal turn
        if turn is None:
            turn = {"text": [], "reasoning": [], "calls": []}
        return turn

    for i, raw in enumerate(value):
        param = f"input[{i}]"
        item = _object(raw, param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            raise errors.missing_required_parameter(f"{param}.type")
        if isinstance(kind, str):
            _known_keys(item, _ITEM_KEYS.get(kind), param)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                shown = json.dumps(role) if isinstance(role, str) else _type_name(role)
                raise _invalid(f"{param}.role", f"{_printable(shown)}; expected user, system, "
                               "developer or assistant.")
            text = _content(item.get("content"), f"{param}.content")
            if role == "assistant":
                open_turn()["text"].append(text)
                continue
            close_turn()
            messages.append(Message("user" if role == "user" else "system", text))
        elif kind == "reasoning":
            parts = [_text(_part(c, f"{param}.content[{j}]").get("text"), f"{param}.content[{j}].text")
                     for j, c in enumerate(item.get("content") or [])]
            if parts:
                open_turn()["reasoning"].append("".join(parts))
            else:
                open_turn()
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _text(item.get("call_id"), f"{param}.call_id")
            name = _text(item.get("name"), f"{param}.name")
            namespace = _opt_text(item, "namespace", f"{param}.namespace")
            if kind == "function_call":
                arguments = _arguments(item.get("arguments"), f"{param}.arguments")
            else:
                arguments = json.dumps({CUSTOM_INPUT_KEY: _text(item.get("input"), f"{param}.input")},
                                       ensure_ascii=False)
            model_name = model_tool_name(tool_map, "function" if kind == "function_call" else "custom",
                                         name, namespace)
            open_turn()["calls"].append(ToolCallPart(call_id, model_name, arguments))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            close_turn()
            call_id = _text(item.get("call_id"), f"{param}.call_id")
            messages.append(Message("tool", _content(item.get("output"), f"{param}.output"),
                                    tool_call_id=call_id))
        else:
            shown = json.dumps(kind) if isinstance(kind, str) else _type_name(kind)
            raise _unsupported(f"{param}.type", f"input item type {_printable(shown)} is not "
                               "supported; supported: message, function_call, "
                               "function_call_output, custom_tool_call, custom_tool_call_output, "
                               "reasoning")
    close_turn()
    if not messages:
        raise _invalid("input", "expected at least 1 item.")
    return messages


_TEXT_PARTS = ("input_text", "output_text", "text")

# Every key each input item type and content part type may carry (OpenAI's item objects, as
# clients echo them back: ids, statuses and annotations are accepted and not used). Any other
# key is unsupported_parameter naming it, as for top-level parameters (spec §20.6).
_ITEM_KEYS: dict[str, frozenset[str]] = {
    "message": frozenset({"type", "role", "content", "id", "status", "phase"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
    "function_call": frozenset({"type", "id", "call_id", "name", "namespace", "arguments", "status"}),
    "custom_tool_call": frozenset({"type", "id", "call_id", "name", "namespace", "input", "status"}),
    "function_call_output": frozenset({"type", "id", "call_id", "output", "status"}),
    "custom_tool_call_output": frozenset({"type", "id", "call_id", "output", "status"}),
}
_PART_KEYS: dict[str, frozenset[str]] = {
    "input_text": frozenset({"type", "text"}),
    "output_text": frozenset({"type", "text", "annotations", "logprobs"}),
    "text": frozenset({"type", "text"}),
    "reasoning_text": frozenset({"type", "text"}),
    "refusal": frozenset({"type", "refusal"}),
}


def _known_keys(obj: dict[str, Any], known: frozenset[str] | None, param: str) -> None:
    """400 unsupported_parameter naming every key of ``obj`` not in ``known`` (None: the type
    itself is unknown, which its own check reports)."""
    if known is None:
        return
    unknown = [(f"{param}.{_printable(key)}", "unknown parameter") for key in obj if key not in known]
    if unknown:
        raise errors.unsupported_parameters(unknown)


def _part(raw: Any, param: str) -> dict[str, Any]:
    part = _object(raw, param)
    kind = part.get("type")
    if isinstance(kind, str):
        _known_keys(part, _PART_KEYS.get(kind), param)
    return part


def _arguments(value: Any, param: str) -> str:
    """A ``function_call``'s arguments: a string; when it is JSON (templates render it decoded)
    the decoded value must be as sane as a body (bounded nesting, valid Unicode), as for Chat
    Completions' ``tool_calls[].function.arguments`` (spec §5.5)."""
    arguments = _text(value, param)
    try:
        decoded = strict_json.loads(arguments)
    except strict_json.TooDeep as exc:
        raise _invalid(param, f"the JSON in it is {exc}.") from None
    except ValueError:
        return arguments  # not JSON: passed to the template as the string it is
    if "\\u" in arguments and (bad := strict_json.first_lone_surrogate(decoded)) is not None:
        subpath, problem = bad
        where = f" in {subpath}" if subpath else ""
        raise _invalid(param, f"the JSON in it has {problem}{where}, which is not valid Unicode.")
    return arguments


def _content(value: Any, param: str) -> str:
    """A message's (or tool output's) text: a string, or text parts joined with newlines."""
    if isinstance(value, str):
        return _text(value, param)
    if not isinstance(value, list):
        raise _wrong_type(param, "a string or an array of content parts", value)
    texts: list[str] = []
    for j, raw in enumerate(value):
        part = _part(raw, f"{param}[{j}]")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            texts.append(_text(part.get("text"), f"{param}[{j}].text"))
        elif kind == "refusal":
            texts.append(_text(part.get("refusal"), f"{param}[{j}].refusal"))
        else:
            shown = json.dumps(kind) if isinstance(kind, str) else _type_name(kind)
            raise _unsupported(f"{param}[{j}].type", f"content part type {_printable(shown)} is "
                               "not supported; only text parts (input_text, output_text)")
    return "\n".join(texts)
