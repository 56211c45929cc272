"""A Messages request (spec/README.md §16): the body validated against ``api.messages.models``
and mapped to the API-neutral ``CoreRequest``. Pure: no I/O, no runtime.

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
- Unknown keys inside a message, a content block (a tool result's text blocks included) or a
  ``system`` block: accepted, not used, collected in ``ignored_fields`` for the
  ``x-trioserve-ignored-fields`` header (spec §4.1, ``api.ignored_fields``). Unknown top-level
  parameters stay 400s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic_core import ErrorDetails

from trioserve import errors, limits
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
    ParamPaths,
)
from trioserve.api.validation import translate_error, validate_body
from trioserve.api.ignored_fields import IgnoredFields
from trioserve.core.model_names import ModelNames
from trioserve.core.sessions import (SessionKey, resolve_session_key, router_session_key,
                                     validate_session_key, with_agent)
from trioserve.api.messages.models import (
    BLOCK_TYPES,
    MIN_THINKING_BUDGET,
    CountTokensBody,
    InputMessage,
    MessagesBody,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    SharedFields,
    UnsupportedBlock,
    UNSUPPORTED_TOP_LEVEL,
)

__all__ = ["MessagesRequest", "parse_messages_request", "ignored_in_conversation",
           "BILLING_HEADER_PREFIX", "SESSION_HEADER", "PARAM_PATHS"]

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
SESSION_HEADER = "x-claude-code-session-id"


# --- normalization ------------------------------------------------------------------------------


class MessagesRequest:
    """A validated Messages request: the core request, and what the wire layer needs back."""

    def __init__(self, core: CoreRequest, *, stream: bool, thinking: str | None,
                 dropped_billing_line: bool, thinking_budget: int | None = None,
                 ignored_fields: IgnoredFields | None = None) -> None:
        self.core = core
        self.stream = stream
        self.thinking = thinking  # "enabled" | "disabled" | "adaptive" | None
        self.thinking_budget = thinking_budget  # thinking.budget_tokens when enabled
        self.dropped_billing_line = dropped_billing_line
        # Unknown keys inside messages, blocks and system blocks (spec §4.1).
        self.ignored_fields = IgnoredFields() if ignored_fields is None else ignored_fields


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


def _messages(body: SharedFields) -> list[Message]:
    out: list[Message] = []
    last = len(body.messages) - 1
    for i, msg in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(msg.content, str):
            blocks: list[Any] = [TextBlock(type="text", text=msg.content)]
        else:
            blocks = list(msg.content)
        for j, block in enumerate(blocks):
            if isinstance(block, UnsupportedBlock):
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
                                              arguments=dict(block.input)))
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
                out.append(Message(role="tool", text=result, tool_call_id=block.tool_use_id,
                                   tool_call_id_param=f"{where}.content[{j}].tool_use_id"))
            elif isinstance(block, TextBlock):
                texts.append(block.text)
            else:
                raise errors.invalid_value(
                    f"'{where}.content[{j}]': a '{block.type}' block belongs in an assistant "
                    "message.", f"{where}.content[{j}].type")
        if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append(Message(role=msg.role, text="\n".join(texts)))
    return out


# The keys each message and block type knows: the models' fields (a block's cache_control
# and a thinking block's signature are known and have no effect, spec §18.1). Any other key is
# ignored and reported (spec §4.1).
_MESSAGE_KEYS = frozenset(InputMessage.model_fields)
_BLOCK_KEYS: dict[str, frozenset[str]] = {
    kind: frozenset(model.model_fields)
    for kind, model in (("text", TextBlock), ("thinking", ThinkingBlock),
                        ("tool_use", ToolUseBlock), ("tool_result", ToolResultBlock))}


def ignored_in_conversation(obj: dict[str, Any]) -> IgnoredFields:
    """The unknown keys of a (validated) body's ``system`` blocks, messages, their content
    blocks and the text blocks of their tool results."""
    ignored = IgnoredFields()

    def text_blocks(blocks: Any, where: str) -> None:
        for j, block in enumerate(blocks if isinstance(blocks, list) else ()):
            ignored.note(block, _BLOCK_KEYS["text"], f"{where}[{j}]")

    text_blocks(obj.get("system"), "system")
    for i, message in enumerate(obj["messages"]):
        where = f"messages[{i}]"
        ignored.note(message, _MESSAGE_KEYS, where)
        content = message["content"]
        for j, block in enumerate(content if isinstance(content, list) else ()):
            known = _BLOCK_KEYS.get(block["type"])
            if known is None:
                continue  # an unsupported block: refused before this runs
            ignored.note(block, known, f"{where}.content[{j}]")
            if block["type"] == "tool_result":
                text_blocks(block.get("content"), f"{where}.content[{j}].content")
    return ignored


def _tools(body: SharedFields) -> tuple[FunctionTool, ...]:
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


def _tool_choice(body: SharedFields, tools: tuple[FunctionTool, ...]) -> tuple[ToolChoice, bool]:
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
    return with_agent(SessionKey(validate_session_key(value, SESSION_HEADER), SESSION_HEADER),
                      headers)


def _translate_error(error: ErrorDetails) -> errors.APIError:
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


# Where a Messages body keeps the fields the core's errors name (spec/README.md §5 names).
PARAM_PATHS = ParamPaths(tool_parameters="tools[{index}].input_schema",
                         forced_tool="tool_choice.name", output_format="output_config.format",
                         output_schema="output_config.format.schema", reasoning_effort="thinking",
                         stop="stop_sequences")


def _thinking(parsed: MessagesBody | CountTokensBody, reasoning_effort_supported: bool,
              can_reason: bool) -> tuple[str | None, str | None, int | None]:
    """``thinking.type``, the reasoning effort it and ``output_config.effort`` map to (None:
    the template's default), and ``thinking.budget_tokens`` when thinking is enabled."""
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
        if isinstance(parsed, MessagesBody) and budget >= parsed.max_tokens:
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
    return thinking, effort, budget


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
    model: type[MessagesBody | CountTokensBody] = CountTokensBody if count_only else MessagesBody
    obj, parsed = validate_body(model, body, max_body_bytes, _translate_error)
    offenders = [(key, UNSUPPORTED_TOP_LEVEL.get(key, "unknown parameter")) for key in obj
                 if key not in model.model_fields and not (key in UNSUPPORTED_TOP_LEVEL
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

    thinking, effort, budget = _thinking(parsed, reasoning_effort_supported, can_reason)

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
        reasoning_effort=effort, params=PARAM_PATHS)
    return MessagesRequest(core, stream=stream, thinking=thinking, dropped_billing_line=dropped,
                           thinking_budget=budget, ignored_fields=ignored_in_conversation(obj))
