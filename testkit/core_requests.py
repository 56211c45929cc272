"""Core requests built from Chat Completions' shapes, for tests and benches of the API-neutral
core (constraints, serving) that write their tools and output formats the way most clients do.

No validation happens here: these build what the Chat adapter builds from a body it accepted
(``trioserve.api.chat.adapter.core_request``), so the core sees exactly its usual input.
"""

from __future__ import annotations

from typing import Any

from trioserve.core.request import (
    CoreRequest,
    ForcedTool,
    FunctionTool,
    JsonObjectOutput,
    JsonSchemaOutput,
    OutputFormat,
    ToolChoice,
)

__all__ = ["constrained_request", "function_tool", "output_format"]


def function_tool(tool: dict[str, Any]) -> FunctionTool:
    """``{"type": "function", "function": {"name", "description"?, "parameters"?}}`` as a
    core tool."""
    function = tool["function"]
    return FunctionTool(function["name"], function.get("description"), function.get("parameters"))


def output_format(response_format: dict[str, Any] | None) -> OutputFormat | None:
    """A Chat ``response_format`` (``text``, ``json_object`` or ``json_schema``) as the core's
    output format."""
    if response_format is None or response_format["type"] == "text":
        return None
    if response_format["type"] == "json_object":
        return JsonObjectOutput()
    spec = response_format["json_schema"]
    return JsonSchemaOutput(name=spec["name"], schema=spec["schema"],
                            description=spec.get("description"), strict=spec.get("strict"))


def constrained_request(response_format: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None, tool_choice: Any = "auto",
                        parallel_tool_calls: bool = True) -> CoreRequest:
    """A request with no messages and the given Chat-shaped output constraints; a
    ``tool_choice`` object (``{"type": "function", "function": {"name"}}``) forces that tool."""
    choice: ToolChoice = (ForcedTool(tool_choice["function"]["name"])
                          if isinstance(tool_choice, dict) else tool_choice)
    return CoreRequest(messages=(), tools=tuple(function_tool(t) for t in tools or ()),
                       tool_choice=choice, parallel_tool_calls=parallel_tool_calls,
                       output_format=output_format(response_format))
