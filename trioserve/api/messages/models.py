"""The Anthropic Messages request body (spec/README.md §16) as pydantic models: what
``/v1/messages`` and ``/v1/messages/count_tokens`` accept, with the field types, ranges and
block unions that ``api.messages.request`` validates a body against. Pure: no I/O."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Tag

from trioserve import limits
from trioserve.api.body import INTEGRAL, JsonObject, StrictModel, Text, by_json_kind, tagged_by

__all__ = ["MessagesBody", "CountTokensBody", "BLOCK_TYPES", "MIN_THINKING_BUDGET"]

# Anthropic's temperature range.
TEMPERATURE_MAX = 1.0
# Anthropic's smallest thinking budget.
MIN_THINKING_BUDGET = 1024


# --- request models ---------------------------------------------------------------------------


class CacheControl(StrictModel):
    type: Text


class TextBlock(StrictModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JsonObject
    cache_control: CacheControl | None = None


TextContent = Annotated[
    Annotated[Text, Tag("json:string")] | Annotated[list[TextBlock], Tag("json:array")],
    by_json_kind("a string or an array of text blocks", "string", "array")]


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: TextContent | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


# Block types Anthropic defines that a local text model cannot take (a 400 naming them).
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "redacted_thinking",
                      "server_tool_use", "web_search_tool_result", "container_upload",
                      "mcp_tool_use", "mcp_tool_result")
BLOCK_TYPES = ("text", "thinking", "tool_use", "tool_result") + UNSUPPORTED_BLOCKS


class UnsupportedBlock(StrictModel):
    type: Text


# Each unsupported type is a branch of its own: its tag is where an error's location says
# which block type it was.
Block = Annotated[
    Annotated[TextBlock, Tag("type:text")] | Annotated[ThinkingBlock, Tag("type:thinking")]
    | Annotated[ToolUseBlock, Tag("type:tool_use")]
    | Annotated[ToolResultBlock, Tag("type:tool_result")]
    | Annotated[UnsupportedBlock, Tag("type:image")] | Annotated[UnsupportedBlock, Tag("type:document")]
    | Annotated[UnsupportedBlock, Tag("type:search_result")]
    | Annotated[UnsupportedBlock, Tag("type:redacted_thinking")]
    | Annotated[UnsupportedBlock, Tag("type:server_tool_use")]
    | Annotated[UnsupportedBlock, Tag("type:web_search_tool_result")]
    | Annotated[UnsupportedBlock, Tag("type:container_upload")]
    | Annotated[UnsupportedBlock, Tag("type:mcp_tool_use")]
    | Annotated[UnsupportedBlock, Tag("type:mcp_tool_result")],
    tagged_by("type", BLOCK_TYPES, "bad_block_type")]


class InputMessage(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: Annotated[
        Annotated[Text, Tag("json:string")] | Annotated[list[Block], Tag("json:array")],
        by_json_kind("a string or an array of content blocks", "string", "array")]


class Tool(StrictModel):
    name: Annotated[Text, Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
    description: Text | None = None
    input_schema: JsonObject
    type: Text | None = None
    cache_control: CacheControl | None = None


class ToolChoiceModel(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    display: Text | None = None


class OutputFormatModel(StrictModel):
    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormatModel | None = None


class Metadata(StrictModel):
    user_id: Text | None = None


class SharedFields(StrictModel):
    """Fields shared by ``/v1/messages`` and ``/v1/messages/count_tokens``."""

    model: Text
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: TextContent | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceModel | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted with no effect on a local model (spec §16).
    context_management: JsonObject | None = None
    metadata: Metadata | None = None
    service_tier: Text | None = None
    cache_control: CacheControl | None = None
    inference_geo: Text | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: Text | None = None
    workspace_id: Text | None = None


class MessagesBody(SharedFields):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Field(ge=1), INTEGRAL]
    stream: bool | None = None
    stop_sequences: Annotated[list[Text], Field(max_length=limits.MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=TEMPERATURE_MAX)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0), INTEGRAL] | None = None


class CountTokensBody(SharedFields):
    """``POST /v1/messages/count_tokens``: the same conversation, no generation settings."""


# Anthropic's top-level parameters that a local server cannot honour: any non-null value is a
# 400 naming the parameter (never silently dropped).
UNSUPPORTED_TOP_LEVEL = {
    "mcp_servers": "remote MCP servers are not supported",
    "container": "code-execution containers are not supported",
    "diagnostics": "prompt-cache diagnostics are not reported",
}
