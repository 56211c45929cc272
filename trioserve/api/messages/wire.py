"""Anthropic Messages API wire format (spec/README.md §16): request models, the mapping to the
API-neutral ``CoreRequest``, response objects, the SSE event encoder and the error envelope.

Pure: no I/O, no runtime. ``api.messages`` puts it on the serving core.

Request mapping (what each field becomes):

- ``system`` (a string or text blocks) → one system message (blocks joined with "\\n"). A
  text block starting with ``x-anthropic-billing-header:`` (Claude Code's per-version billing
  line) is **dropped**: it is metadata for Anthropic's billing, not instructions, and as the
  first system text it would change the first prompt tokens whenever it changes, so no
  session could reuse its prefix. Everything after it is kept verbatim.
- ``messages``: ``user``/``assistant`` turns and Claude Code's ``role: "system"`` messages
  (a system message at that place). ``text`` blocks join with "\\n"; an assistant's
  ``thinking`` blocks become its reasoning, ``tool_use`` blocks its tool calls; a user's
  ``tool_result`` blocks become tool messages (in block order, before the user's own text);
  ``is_error`` prefixes the result with ``Error: ``. Images, documents, server-tool blocks,
  ``redacted_thinking`` and a final assistant message (prefill) are 400s naming the block.
- ``tools`` (``name``, ``description``, ``input_schema``) → function tools; server tools
  (any other ``type``) are 400s naming the tool.
- ``tool_choice``: ``auto`` / ``any`` (→ required) / ``tool`` (→ forced, grammar-enforced) /
  ``none``; ``disable_parallel_tool_use`` → at most one call (``parallel_tool_calls: false``:
  a grammar holds forced calls to one, under ``auto`` the first complete call ends the answer).
- ``max_tokens`` (required), ``stop_sequences``, ``temperature`` (0–1), ``top_p``, ``top_k``.
- ``thinking``: ``enabled`` → reasoning on (a 400 when the model cannot think);
  ``disabled`` → reasoning off where the template has a switch; ``adaptive`` → the model's
  default. ``budget_tokens`` (≥ 1024, < ``max_tokens``) caps the reasoning (``api.messages``
  closes a reasoning block that reaches it and has the model answer).
- ``output_config.format`` (``json_schema``) → structured output; ``output_config.effort`` →
  reasoning effort where the template reads one, else nothing.
- ``metadata``, ``context_management``, ``service_tier``, ``cache_control`` (top level and on
  blocks: prefix reuse is automatic), ``inference_geo``, ``speed``, ``user_profile_id``,
  ``workspace_id``, a tool's ``defer_loading``: accepted, no effect on a local model (listed in
  the spec). ``mcp_servers``, ``container`` and ``diagnostics`` are 400s.

Usage: ``input_tokens`` are the prompt tokens the worker computed, ``cache_read_input_tokens``
the ones it reused (so their sum is the prompt), ``cache_creation_input_tokens`` is 0.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from trioserve import errors, limits, strict_json
from trioserve.core.events import (
    Event,
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallStarted,
    TurnResult,
    Usage,
)
from trioserve.core.request import (
    CoreRequest,
    ForcedTool,
    FunctionTool,
    JsonSchemaOutput,
    Message,
    OutputFormat,
    Sampling,
    ToolCallPart,
    ToolChoice,
    arguments_text,
)
from trioserve.api.chat.validation import load_json_object, translate_error
from trioserve.api.chat.models import JsonObject, Text, by_json_kind, bounded_integer, StrictModel, _tagged_by
from trioserve.core.model_names import ModelNames
from trioserve.core.sessions import SessionKey, resolve_session_key, router_session_key, validate_session_key

__all__ = [
    "MessagesBody", "CountTokensBody", "MessagesRequest", "parse_messages_request",
    "BILLING_HEADER_PREFIX", "SESSION_HEADER", "message_object", "StreamEncoder",
    "error_envelope", "error_type", "stop_reason", "usage_object", "new_message_id",
]

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
SESSION_HEADER = "x-claude-code-session-id"

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


TextContent = by_json_kind("a string or an array of text blocks", string=Text,
                            array=list[TextBlock])


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


class _Unsupported(StrictModel):
    type: Text


Block = _tagged_by("type", BLOCK_TYPES, "bad_block_type", {
    "text": TextBlock, "thinking": ThinkingBlock, "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock, **{name: _Unsupported for name in UNSUPPORTED_BLOCKS}})


class InputMessage(StrictModel):
    role: Literal["user", "assistant", "system"]
    content: by_json_kind("a string or an array of content blocks", string=Text,
                           array=list[Block])  # type: ignore[valid-type]


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
    budget_tokens: bounded_integer(ge=1) | None = None
    display: Text | None = None


class OutputFormatModel(StrictModel):
    type: Literal["json_schema"]
    schema_: JsonObject = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormatModel | None = None


class Metadata(StrictModel):
    user_id: Text | None = None


class _Common(StrictModel):
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


class MessagesBody(_Common):
    """``POST /v1/messages``."""

    max_tokens: bounded_integer(ge=1)
    stream: bool | None = None
    stop_sequences: Annotated[list[Text], Field(max_length=limits.MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=TEMPERATURE_MAX)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: bounded_integer(ge=0) | None = None


class CountTokensBody(_Common):
    """``POST /v1/messages/count_tokens``: the same conversation, no generation settings."""


# Anthropic's top-level parameters that a local server cannot honour: any non-null value is a
# 400 naming the parameter (never silently dropped).
_UNSUPPORTED_TOP_LEVEL = {
    "mcp_servers": "remote MCP servers are not supported",
    "container": "code-execution containers are not supported",
    "diagnostics": "prompt-cache diagnostics are not reported",
}


# --- normalization ------------------------------------------------------------------------------


class MessagesRequest:
    """A validated Messages request: the core request, and what the wire layer needs back."""

    def __init__(self, core: CoreRequest, *, stream: bool, thinking: str | None,
                 dropped_billing_line: bool, thinking_budget: int | None = None) -> None:
        self.core = core
        self.stream = stream
        self.thinking = thinking  # "enabled" | "disabled" | "adaptive" | None
        self.thinking_budget = thinking_budget  # thinking.budget_tokens when enabled
        self.dropped_billing_line = dropped_billing_line


def _text_of(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    return "\n".join(b.text for b in blocks)


def _system_text(system: str | list[TextBlock] | None) -> tuple[str, bool]:
    """The system prompt without Claude Code's billing line (module docstring); and whether
    one was dropped."""
    if system is None:
        return "", False
    if isinstance(system, str):
        lines = system.split("\n")
        if lines and lines[0].startswith(BILLING_HEADER_PREFIX):
            return "\n".join(lines[1:]).lstrip("\n"), True
        return system, False
    kept = [b for b in system if not b.text.startswith(BILLING_HEADER_PREFIX)]
    return "\n".join(b.text for b in kept), len(kept) != len(system)


def _unsupported_block(block: Any, where: str) -> errors.APIError:
    return errors.unsupported_parameters(
        [(where, f"'{block.type}' content blocks are not supported by this server")])


def _messages(body: _Common) -> list[Message]:
    out: list[Message] = []
    last = len(body.messages) - 1
    for i, msg in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(msg.content, str):
            blocks: list[Any] = [TextBlock(type="text", text=msg.content)]
        else:
            blocks = list(msg.content)
        for j, block in enumerate(blocks):
            if isinstance(block, _Unsupported):
                raise _unsupported_block(block, f"{where}.content[{j}]")
        if msg.role == "assistant":
            if i == last:
                raise errors.unsupported_parameters(
                    [(where, "a final assistant message (prefill) is not supported; end the "
                      "conversation with a user message")])
            texts, reasoning, calls = [], [], []
            for j, block in enumerate(blocks):
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ThinkingBlock):
                    reasoning.append(block.thinking)
                elif isinstance(block, ToolUseBlock):
                    calls.append(ToolCallPart(id=block.id, name=block.name,
                                              arguments=arguments_text(block.input)))
                else:
                    raise errors.invalid_value(
                        f"'{where}.content[{j}]': a '{block.type}' block belongs in a user "
                        "message.", f"{where}.content[{j}].type")
            out.append(Message(role="assistant", text="\n".join(texts),
                               reasoning="\n".join(reasoning) if reasoning else None,
                               tool_calls=tuple(calls)))
            continue
        texts = []
        for j, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                if msg.role != "user":
                    raise errors.invalid_value(
                        f"'{where}.content[{j}]': tool results belong in a user message.",
                        f"{where}.content[{j}].type")
                result = _text_of(block.content)
                if block.is_error:
                    result = "Error: " + result
                out.append(Message(role="tool", text=result, tool_call_id=block.tool_use_id))
            elif isinstance(block, TextBlock):
                texts.append(block.text)
            else:
                raise errors.invalid_value(
                    f"'{where}.content[{j}]': a '{block.type}' block belongs in an assistant "
                    "message.", f"{where}.content[{j}].type")
        if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append(Message(role=msg.role, text="\n".join(texts)))
    return out


def _tools(body: _Common) -> tuple[FunctionTool, ...]:
    tools: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(body.tools or ()):
        if tool.type not in (None, "custom"):
            raise errors.unsupported_parameters(
                [(f"tools[{i}].type", f"server tool '{tool.type}' ({tool.name}) is not supported; "
                  "declare client tools with 'input_schema'")])
        if tool.name in seen:
            raise errors.invalid_value(f"Invalid value for 'tools[{i}].name': tool names must be "
                                       f"unique; {tool.name!r} is declared twice.",
                                       f"tools[{i}].name")
        seen.add(tool.name)
        tools.append(FunctionTool(name=tool.name, description=tool.description,
                                  parameters=dict(tool.input_schema)))
    return tuple(tools)


def _tool_choice(body: _Common, tools: tuple[FunctionTool, ...]) -> tuple[ToolChoice, bool]:
    choice = body.tool_choice
    if choice is None:
        return "auto", True
    parallel = choice.disable_parallel_tool_use is not True
    if choice.type == "tool":
        if choice.name is None:
            raise errors.missing_required_parameter("tool_choice.name")
        if choice.name not in {t.name for t in tools}:
            raise errors.invalid_value(f"Invalid value for 'tool_choice.name': no tool named "
                                       f"{choice.name!r} is declared in 'tools'.", "tool_choice.name")
        return ForcedTool(choice.name), parallel
    if choice.type == "any":
        if not tools:
            raise errors.invalid_value("'tool_choice' 'any' needs at least one tool in 'tools'.",
                                       "tool_choice")
        return "required", parallel
    return choice.type, parallel


def _session(headers: Mapping[str, str] | None) -> SessionKey | None:
    """The generic session sources (spec §12), then Claude Code's session header, then the
    router's (``x-smg-routing-key``)."""
    key = resolve_session_key({}, headers, router_key=False)
    if key is not None or headers is None:
        return key
    value = headers.get(SESSION_HEADER)
    if value is None:
        return router_session_key(headers)
    return SessionKey(validate_session_key(value, SESSION_HEADER), SESSION_HEADER)


def _translate_error(error: Any) -> errors.APIError:
    """The APIError for pydantic's first error, with this module's union tags (``type:…``)
    dropped from the path and an unknown content block ``type`` named."""
    loc = tuple(s for s in error["loc"] if not (isinstance(s, str) and ":" in s))
    if error["type"] == "bad_block_type":
        param = ".".join(str(s) if isinstance(s, str) else f"[{s}]" for s in loc).replace(".[", "[")
        value = error["input"]
        if not isinstance(value, dict):
            return errors.invalid_value(f"Invalid type for '{param}': expected an object.", param)
        if value.get("type") is None:
            return errors.missing_required_parameter(f"{param}.type")
        return errors.invalid_value(f"Invalid value for '{param}.type': {json.dumps(value['type'])}; "
                                    f"expected one of {', '.join(BLOCK_TYPES)}.", f"{param}.type")
    return translate_error({**error, "loc": loc})


PARAM_NAMES = {"messages": "messages", "tools": "tools", "tool_choice": "tool_choice",
               "response_format": "output_config.format", "reasoning_effort": "thinking",
               "stop": "stop_sequences"}


def parse_messages_request(body: bytes, *, served_model: str, max_body_bytes: int,
                           headers: Mapping[str, str] | None = None, count_only: bool = False,
                           reasoning_effort_supported: bool = False,
                           can_reason: bool = False, client_names: bool = False,
                           names: ModelNames | None = None) -> MessagesRequest:
    """Validate a Messages (or count_tokens) body and map it to a core request.

    ``names``: the names the model answers (aliases; spec §2.1). Without it,
    ``served_model`` and, with ``client_names``, the names Claude Code sends by default
    (``trioserve.core.model_names``; the ``client_model_names`` setting).

    ``reasoning_effort_supported``: the template has a thinking switch or reads an effort;
    ``can_reason``: the model produces reasoning at all (a switch or reasoning markers).
    Raises APIError (OpenAI-style internally; the HTTP layer writes Anthropic's envelope).
    """
    if len(body) > max_body_bytes:
        raise errors.request_too_large(max_body_bytes)
    obj = load_json_object(body)
    model = CountTokensBody if count_only else MessagesBody
    try:
        parsed = model.model_validate(
            obj, context={"unicode_checks": strict_json.may_hold_lone_surrogates(body)})
    except ValidationError as exc:
        raise _translate_error(exc.errors(include_url=False)[0]) from None
    offenders = [(key, _UNSUPPORTED_TOP_LEVEL.get(key, "unknown parameter")) for key in obj
                 if key not in model.model_fields and not (key in _UNSUPPORTED_TOP_LEVEL
                                                           and obj[key] is None)]
    if offenders:
        raise errors.unsupported_parameters(offenders, tuple(
            name for name in model.model_fields))
    (names or ModelNames.single(served_model, client_names=client_names)).check(
        parsed.model, "messages")
    system, dropped = _system_text(parsed.system)
    messages = _messages(parsed)
    if system:
        messages.insert(0, Message(role="system", text=system))
    tools = _tools(parsed)
    tool_choice, parallel = _tool_choice(parsed, tools)

    thinking = parsed.thinking.type if parsed.thinking else None
    effort: str | None = None
    budget: int | None = None
    if thinking == "enabled":
        budget = parsed.thinking.budget_tokens if parsed.thinking else None
        if budget is None:
            raise errors.missing_required_parameter("thinking.budget_tokens")
        if budget < MIN_THINKING_BUDGET:
            raise errors.invalid_value(f"Invalid value for 'thinking.budget_tokens': {budget} is "
                                       f"not ≥ {MIN_THINKING_BUDGET}.", "thinking.budget_tokens")
        if not count_only and budget >= parsed.max_tokens:  # type: ignore[attr-defined]
            raise errors.invalid_value("Invalid value for 'thinking.budget_tokens': it must be "
                                       "less than 'max_tokens'.", "thinking.budget_tokens")
        if not can_reason:
            raise errors.unsupported_parameters(
                [("thinking", "this model does not produce reasoning; send "
                  "{\"type\": \"disabled\"} or leave 'thinking' out")])
        effort = "high" if reasoning_effort_supported else None
    elif thinking == "disabled":
        effort = "none" if reasoning_effort_supported else None
    if (thinking != "disabled" and parsed.output_config is not None
            and parsed.output_config.effort is not None and reasoning_effort_supported):
        effort = "high" if parsed.output_config.effort == "max" else parsed.output_config.effort

    output: OutputFormat | None = None
    if parsed.output_config is not None and parsed.output_config.format is not None:
        output = JsonSchemaOutput(name="output", schema=parsed.output_config.format.schema_)

    stream = False
    sampling = Sampling()
    max_tokens: int | None = None
    stops: tuple[str, ...] = ()
    if isinstance(parsed, MessagesBody):
        stream = bool(parsed.stream)
        sampling = Sampling(temperature=1.0 if parsed.temperature is None else float(parsed.temperature),
                            top_p=1.0 if parsed.top_p is None else float(parsed.top_p),
                            top_k=0 if parsed.top_k is None else min(parsed.top_k, limits.INT32_MAX))
        max_tokens = min(parsed.max_tokens, limits.INT32_MAX)
        stops = tuple(dict.fromkeys(s for s in parsed.stop_sequences or () if s))
    core = CoreRequest(
        messages=tuple(messages), tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=parallel, output_format=output, sampling=sampling,
        max_tokens=max_tokens, stops=stops, session=_session(headers),
        reasoning_effort=effort, param_names=PARAM_NAMES)
    return MessagesRequest(core, stream=stream, thinking=thinking, dropped_billing_line=dropped,
                           thinking_budget=budget)


# --- responses ----------------------------------------------------------------------------------


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason(finished: Finished | None) -> str:
    """Anthropic's ``stop_reason`` for the core's ending."""
    if finished is None:
        return "end_turn"
    if finished.reason == "length":
        return "max_tokens"
    if finished.reason == "tool_calls":
        return "tool_use"
    if finished.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage_object(usage: Usage) -> dict[str, Any]:
    """Anthropic usage: ``input_tokens`` computed + ``cache_read_input_tokens`` reused = the
    prompt (module docstring)."""
    cached = max(0, min(usage.cached_tokens, usage.prompt_tokens))
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_object(message_id: str, model: str, result: TurnResult) -> dict[str, Any]:
    """The non-streaming response: thinking, then text, then tool_use blocks."""
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text:
        content.append({"type": "text", "text": result.text})
    for call in result.tool_calls:
        content.append({"type": "tool_use", "id": call.call_id, "name": call.name,
                        "input": _tool_input(call.arguments)})
    finished = result.finished
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(finished),
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": usage_object(finished.usage if finished else Usage())}


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {payload}\n\n".encode("utf-8", "replace")


class StreamEncoder:
    """Turns core events into Anthropic's SSE events, in its order:
    ``message_start``, ``ping``, per block ``content_block_start`` → deltas →
    ``content_block_stop`` (``index`` counting blocks from 0), ``message_delta`` (stop_reason,
    stop_sequence, usage), ``message_stop``. A block closes when output of another kind
    begins; a tool call is one ``tool_use`` block whose arguments arrive as
    ``input_json_delta``."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._index = -1
        self._tool_sent: dict[int, bool] = {}  # call index → any argument delta sent

    def start(self) -> bytes:
        message = {"id": self.message_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": usage_object(Usage())}
        return (_event("message_start", {"type": "message_start", "message": message})
                + _event("ping", {"type": "ping"}))

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = kind
        return out + _event("content_block_start", {"type": "content_block_start",
                                                    "index": self._index, "content_block": block})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta",
                                              "index": self._index, "delta": delta})

    def encode(self, events: list[Event]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, TextDelta):
                if self._open != "text":
                    out += self._begin("text", {"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, ReasoningDelta):
                if self._open != "thinking":
                    out += self._begin("thinking", {"type": "thinking", "thinking": "",
                                                    "signature": ""})
                out += self._delta({"type": "thinking_delta", "thinking": event.text})
            elif isinstance(event, ToolCallStarted):
                out += self._begin("tool_use", {"type": "tool_use", "id": event.call_id,
                                                "name": event.name, "input": {}})
                self._tool_sent[event.index] = False
            elif isinstance(event, ToolCallArgumentsDelta):
                if event.delta:
                    self._tool_sent[event.index] = True
                    out += self._delta({"type": "input_json_delta", "partial_json": event.delta})
            elif isinstance(event, ToolCallDone):
                if not self._tool_sent.get(event.index):
                    out += self._delta({"type": "input_json_delta",
                                        "partial_json": event.arguments})
                out += self._close()
            elif isinstance(event, Finished):
                out += self._close()
                out += _event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason(event),
                              "stop_sequence": event.stop_sequence},
                    "usage": usage_object(event.usage)})
                out += _event("message_stop", {"type": "message_stop"})
        return out

    def error(self, exc: errors.APIError) -> bytes:
        """A failure after the stream started: Anthropic's ``error`` event."""
        return _event("error", error_envelope(exc))


# --- errors -----------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_envelope(exc: errors.APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; the message names the parameter
    (Anthropic's envelope has no ``param`` field)."""
    message = exc.message
    if exc.param and f"'{exc.param}'" not in message:
        message = f"{message} (parameter '{exc.param}')"
    return {"type": "error", "error": {"type": error_type(exc.status), "message": message}}

