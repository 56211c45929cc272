"""The tools of a Responses request (spec §20.2): ``function`` tools, ``namespace`` tools
flattened as ``<namespace>__<name>``, freeform ``custom`` tools as a function taking
``{"input": string}``, hosted tools dropped and reported; ``tool_choice``; and the name map
that turns a model's call back into the client's tool. Pure."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from trioserve import errors, strict_json
from trioserve.core.request import (
    ForcedTool,
    FunctionTool,
    ToolChoice,
)
from trioserve.api.responses.values import (
    bool_value,
    invalid,
    object_value,
    optional_string,
    printable,
    string_value,
    type_name,
    unsupported,
    wrong_type,
)

__all__ = ["ToolMapping", "HOSTED_TOOL_TYPES", "CUSTOM_INPUT_KEY", "NAMESPACE_SEPARATOR",
           "parse_tools", "parse_tool_choice", "model_tool_name"]

# Tools OpenAI runs on its own servers: a local server cannot, and a 400 would lock agents
# such as Codex (which always sends web_search) out. Not offered to the model; reported.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
    "file_search", "code_interpreter", "image_generation", "mcp", "computer_use_preview",
    "computer_use", "tool_search",
})

# The one argument of a freeform custom tool offered to the model as a function.
CUSTOM_INPUT_KEY = "input"
NAMESPACE_SEPARATOR = "__"

_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolMapping:
    """How a name the model calls maps back to a Responses item: ``kind`` ``function`` or
    ``custom``; ``name`` and ``namespace`` as the client declared them."""

    kind: str
    name: str
    namespace: str | None = None


def parse_tools(value: Any) -> tuple[tuple[FunctionTool, ...], dict[str, ToolMapping], list[str], list[Any]]:
    """The tools offered to the model, the name map back, the ignored hosted tool types and
    the tools as echoed in the response."""
    if value is None:
        return (), {}, [], []
    if not isinstance(value, list):
        raise wrong_type("tools", "an array", value)
    tools: list[FunctionTool] = []
    mapping: dict[str, ToolMapping] = {}
    ignored: list[str] = []

    def add(model_name: str, tool: FunctionTool, target: ToolMapping, param: str) -> None:
        if model_name in mapping:
            raise invalid(param, f"duplicate tool name '{model_name}'.")
        if not _TOOL_NAME_RE.match(model_name):
            raise invalid(param, f"{json.dumps(model_name)}; names are 1-64 characters of a-z, "
                           "A-Z, 0-9, '_' and '-'.")
        mapping[model_name] = target
        tools.append(tool)

    for i, raw in enumerate(value):
        param = f"tools[{i}]"
        tool = object_value(raw, param)
        kind = tool.get("type")
        if kind is None:
            raise errors.missing_required_parameter(f"{param}.type")
        if kind == "function":
            fn = _function_tool(tool, param)
            add(fn.name, fn, ToolMapping("function", fn.name), f"{param}.name")
        elif kind == "namespace":
            namespace = string_value(tool.get("name"), f"{param}.name")
            nested = tool.get("tools")
            if not isinstance(nested, list):
                raise wrong_type(f"{param}.tools", "an array", nested)
            for j, inner in enumerate(nested):
                inner_param = f"{param}.tools[{j}]"
                inner_tool = object_value(inner, inner_param)
                if inner_tool.get("type") != "function":
                    raise unsupported(f"{inner_param}.type", "a namespace may hold function tools only")
                fn = _function_tool(inner_tool, inner_param)
                flat = f"{namespace}{NAMESPACE_SEPARATOR}{fn.name}"
                add(flat, FunctionTool(flat, fn.description, fn.parameters, fn.parameters_param),
                    ToolMapping("function", fn.name, namespace), f"{inner_param}.name")
        elif kind == "custom":
            name = string_value(tool.get("name"), f"{param}.name")
            description = optional_string(tool, "description", f"{param}.description")
            fmt = tool.get("format")
            if fmt is not None and object_value(fmt, f"{param}.format").get("type") not in (None, "text"):
                raise unsupported(
                    f"{param}.format",
                    f"the custom tool '{printable(name)}' declares a "
                    f"{printable(str(fmt.get('syntax') or fmt.get('type')))} grammar, which this "
                    "server cannot enforce; declare it as a function tool or without a grammar")
            parameters = {"type": "object", "properties": {CUSTOM_INPUT_KEY: {"type": "string"}},
                          "required": [CUSTOM_INPUT_KEY]}
            add(name, FunctionTool(name, description, parameters, param),
                ToolMapping("custom", name),
                f"{param}.name")
        elif isinstance(kind, str) and kind in HOSTED_TOOL_TYPES:
            ignored.append(kind)
        else:
            shown = json.dumps(kind) if isinstance(kind, str) else type_name(kind)
            raise unsupported(f"{param}.type", f"tool type {printable(shown)} is not supported; "
                               "supported: function, namespace, custom (freeform text); hosted "
                               "tools are not offered to the model")
    return tuple(tools), mapping, ignored, list(value)


def _function_tool(tool: dict[str, Any], param: str) -> FunctionTool:
    if tool.get("name") is None:
        raise errors.missing_required_parameter(f"{param}.name")
    name = string_value(tool["name"], f"{param}.name")
    description = optional_string(tool, "description", f"{param}.description")
    parameters = tool.get("parameters")
    if parameters is not None:
        parameters = object_value(parameters, f"{param}.parameters")
        if (bad := strict_json.first_lone_surrogate(parameters)) is not None:
            raise invalid(f"{param}.parameters{bad[0]}", f"contains {bad[1]}, which is not valid Unicode.")
    if tool.get("strict") is not None:
        bool_value(tool["strict"], f"{param}.strict")
    return FunctionTool(name, description, parameters, f"{param}.parameters")


def parse_tool_choice(value: Any, tool_map: dict[str, ToolMapping]) -> tuple[ToolChoice, Any]:
    if value is None:
        return "auto", "auto"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"{json.dumps(value)}; expected auto, none, required or an object.")
        return value, value  # type: ignore[return-value]
    choice = object_value(value, "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = string_value(choice.get("name"), "tool_choice.name")
        namespace = choice.get("namespace")
        for model_name, target in tool_map.items():
            if target.kind == kind and target.name == name and target.namespace == namespace:
                return ForcedTool(model_name), choice
        raise invalid("tool_choice.name", f"{json.dumps(name)} is not one of the declared {kind} tools.")
    shown = json.dumps(kind) if isinstance(kind, str) else type_name(kind)
    raise unsupported("tool_choice.type", f"{printable(shown)} is not supported; use auto, none, "
                       "required, or a function or custom tool")


def model_tool_name(tool_map: dict[str, ToolMapping], kind: str, name: str,
                    namespace: str | None) -> str:
    """The model-facing name of a call the client sent back (the flattened name of a
    namespaced function; the name itself when the tool is not declared in this request)."""
    for model_name, target in tool_map.items():
        if target.kind == kind and target.name == name and target.namespace == namespace:
            return model_name
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
