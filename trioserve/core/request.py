"""The API-neutral request: what every HTTP API (Chat Completions, Responses, Messages) maps
its body to before anything is rendered or generated.

Each API adapter validates its own wire format and builds one :class:`CoreRequest`; from then
on the serving core (``core.serving``) renders, constrains and generates without knowing which
API asked. Pure data: frozen dataclasses, no I/O, no validation beyond what the types say
(adapters validate; the core trusts what it is given), except the one rule that spans the
whole conversation, however the API spells it: :func:`unmatched_tool_result`. Errors the core
raises name the API's own parameter paths (:class:`ParamPaths`).

The template view (:meth:`CoreRequest.template_messages`, :meth:`CoreRequest.template_tools`)
is the one place that turns typed messages into the dicts Hugging Face chat templates read, so
every API renders a conversation the same way (and the session replay, which compares those
dicts, matches turns across APIs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from trioserve import errors, strict_json
from trioserve.core.sessions import SessionKey

__all__ = [
    "Role",
    "Arguments",
    "ToolCallPart",
    "decode_arguments",
    "Message",
    "FunctionTool",
    "ForcedTool",
    "ToolChoice",
    "JsonObjectOutput",
    "JsonSchemaOutput",
    "OutputFormat",
    "Sampling",
    "ParamPaths",
    "CoreRequest",
    "unmatched_tool_result",
]

Role = Literal["system", "user", "assistant", "tool"]


Arguments = dict[str, Any] | str
"""A tool call's arguments as templates read them: the decoded object when the client sent a
JSON object (templates iterate it or ``tojson`` it), else the client's text unchanged (a
template prints it)."""


@dataclass(frozen=True, slots=True)
class ToolCallPart:
    """A tool call the assistant made earlier in the conversation. ``arguments`` is already
    decoded (:data:`Arguments`): adapters decode the wire text once, with
    :func:`decode_arguments` or as part of their own validation."""

    id: str
    name: str
    arguments: Arguments

    @classmethod
    def from_text(cls, id: str, name: str, text: str) -> ToolCallPart:
        """A call whose arguments arrive as serialized JSON (decoded here, once)."""
        return cls(id, name, decode_arguments(text))


@dataclass(frozen=True, slots=True)
class Message:
    """One conversation turn.

    ``role``: ``system`` (system and developer instructions), ``user``, ``assistant`` or
    ``tool`` (a tool result: ``tool_call_id`` names the call, ``text`` is the result).
    ``text``: the turn's text ("" for an assistant turn that only calls tools).
    ``reasoning``: an assistant turn's reasoning text, passed to templates that replay it.
    ``tool_calls``: an assistant turn's calls, in order. ``name``: the optional author name.
    ``tool_call_id_param``: where a tool result's call id sits in the request, for errors
    about it, when the message's position does not say (None:
    ``{messages}[i].tool_call_id``, Chat Completions' place).
    """

    role: Role
    text: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCallPart, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    tool_call_id_param: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A tool the model may call: a name (unique in the request), an optional description and
    the JSON Schema of its arguments object (None: any object). ``parameters_param``: where
    that schema sits in the request, for errors about it, when its position in ``tools`` does
    not say (Responses drops hosted tools and flattens namespaces); None: the API's
    :attr:`ParamPaths.tool_parameters` at the tool's position."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parameters_param: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class ForcedTool:
    """``tool_choice`` naming one tool: the model must call exactly it (grammar-enforced)."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | ForcedTool


@dataclass(frozen=True, slots=True)
class JsonObjectOutput:
    """The answer must be one JSON object (grammar-enforced)."""


@dataclass(frozen=True, slots=True)
class JsonSchemaOutput:
    """The answer must be JSON matching ``schema`` (grammar-enforced; a schema feature that
    cannot be enforced is a 400). Adapters checked the name (OpenAI's rule) and that the
    schema is an object or a boolean."""

    name: str
    schema: dict[str, Any] | bool
    description: str | None = None
    strict: bool | None = None


OutputFormat = JsonObjectOutput | JsonSchemaOutput


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings, already within the worker's ranges (adapters clamp): ``temperature``
    0 = greedy; ``top_k`` 0 = off; ``seed`` None = random, else in [0, 2^32 - 1);
    ``logit_bias``: (token id, bias) pairs from core/logit_bias.py's parse (() = none)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ParamPaths:
    """Where an API keeps the request fields the core reports errors on, so that every error
    the core raises carries the client's own parameter path from the start. The defaults are
    Chat Completions' names; each other adapter declares its own (``{index}`` in
    :attr:`tool_parameters` is a tool's position in ``tools``)."""

    messages: str = "messages"
    tools: str = "tools"
    tool_parameters: str = "tools[{index}].function.parameters"
    tool_choice: str = "tool_choice"
    forced_tool: str = "tool_choice.function.name"
    output_format: str = "response_format"
    output_schema: str = "response_format.json_schema.schema"
    reasoning_effort: str = "reasoning_effort"
    template_kwargs: str = "chat_template_kwargs"
    stop: str = "stop"

    def tool_parameters_of(self, tool: FunctionTool, index: int) -> str:
        """The path of ``tool``'s parameters schema (it sits at ``index`` in ``tools``)."""
        if tool.parameters_param is not None:
            return tool.parameters_param
        return self.tool_parameters.format(index=index)

    def template_field(self, path: str) -> str:
        """A request field as the chat template layer names it (``messages[2].content``,
        ``tools[0]``, ``chat_template_kwargs.x``, ``reasoning_effort``) in this API's names."""
        for core, mine in (("messages", self.messages), ("tools", self.tools),
                           ("chat_template_kwargs", self.template_kwargs),
                           ("reasoning_effort", self.reasoning_effort)):
            if path == core or path.startswith((core + ".", core + "[")):
                return mine + path[len(core):]
        return path


@dataclass(frozen=True, slots=True)
class CoreRequest:
    """One generation request, whatever API it came from.

    ``max_tokens``: the completion budget (None: until the context is full).
    ``stops``: distinct non-empty stop strings (the profile adds its own at render time).
    ``session``: the worker session the request runs in (spec §12) or None (anonymous);
    ``retention``: the worker's spill priority for it (``"short"``/``"long"``).
    ``reasoning_effort``: mapped onto the template's thinking switch, or a 400 where it has none.
    ``template_kwargs``: extra template variables (Chat Completions' ``chat_template_kwargs``).
    ``parallel_tool_calls``: False allows at most one call: a grammar holds constrained calls
    to one, and under ``auto`` the first complete call ends the generation (spec §10).
    ``answer_prefix``: text the answer continues from, rendered right after the generation
    prompt as model output (the Messages adapter's reasoning budget closes an over-long
    reasoning block this way); "" for none.
    ``params``: where this API keeps the fields the core reports errors on; the core's errors
    carry the API's own parameter paths.
    """

    messages: tuple[Message, ...]
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    output_format: OutputFormat | None = None
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None
    stops: tuple[str, ...] = ()
    session: SessionKey | None = field(default=None, compare=False)
    retention: str = field(default="short", compare=False)
    reasoning_effort: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    answer_prefix: str = ""
    params: ParamPaths = field(default_factory=ParamPaths, compare=False)

    @property
    def tools_enabled(self) -> bool:
        """True when tools are declared and ``tool_choice`` is not ``none``: only then are
        tools shown to the template and calls parsed out of the output."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: ``role``, ``content`` (always a str),
        and where present ``name``, ``tool_calls`` (``arguments`` decoded into an object when
        it is a JSON object, as :class:`ToolCallPart` holds it), ``tool_call_id``,
        ``reasoning_content``. A fresh list of fresh dicts on every call."""
        return [_template_message(m) for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools in OpenAI's function-tool shape for templates, or None when tools are not
        enabled (none declared, or ``tool_choice: "none"``)."""
        if not self.tools_enabled:
            return None
        return self.tool_dicts()

    def tool_dicts(self) -> list[dict[str, Any]]:
        """Every declared tool as ``{"type": "function", "function": {...}}``."""
        out: list[dict[str, Any]] = []
        for tool in self.tools:
            function: dict[str, Any] = {"name": tool.name}
            if tool.description is not None:
                function["description"] = tool.description
            if tool.parameters is not None:
                function["parameters"] = tool.parameters
            out.append({"type": "function", "function": function})
        return out


def unmatched_tool_result(req: CoreRequest) -> errors.APIError | None:
    """The 400 for the first tool result whose call id names no tool call made earlier in
    the conversation, or None. OpenAI and Anthropic refuse such a result (a result for a call
    the model never made would be rendered as if it had); every API refuses it the same way,
    naming the client's own field."""
    calls: set[str] = set()
    for i, message in enumerate(req.messages):
        calls.update(call.id for call in message.tool_calls)
        if message.role != "tool" or message.tool_call_id is None:
            continue
        if message.tool_call_id not in calls:
            param = message.tool_call_id_param or f"{req.params.messages}[{i}].tool_call_id"
            return errors.invalid_value(
                f"Invalid value for '{param}': {json.dumps(message.tool_call_id)} matches no "
                "tool call earlier in the conversation; a tool result must answer a call an "
                "assistant turn before it made.", param)
    return None


def decode_arguments(text: str) -> Arguments:
    """The one decoding of tool-call arguments text: a dict when ``text`` is a JSON object,
    else ``text`` unchanged (:data:`Arguments`). Adapters validated nesting depth and Unicode
    where the text came from a client; a value too deep to decode stays text."""
    try:
        decoded = strict_json.loads(text)
    except (ValueError, RecursionError):
        return text
    return decoded if isinstance(decoded, dict) else text


def _template_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls]
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
