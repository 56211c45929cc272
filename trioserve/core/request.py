"""The API-neutral request: what every HTTP API (Chat Completions, Responses, Messages) maps
its body to before anything is rendered or generated.

Each API adapter validates its own wire format and builds one :class:`CoreRequest`; from then
on the serving core (``core.serving``) renders, constrains and generates without knowing which
API asked. Pure data: frozen dataclasses, no I/O, no validation beyond what the types say
(adapters validate; the core trusts what it is given).

The template view (:meth:`CoreRequest.template_messages`, :meth:`CoreRequest.template_tools`)
is the one place that turns typed messages into the dicts Hugging Face chat templates read, so
every API renders a conversation the same way (and the session replay, which compares those
dicts, matches turns across APIs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from trioserve import strict_json
from trioserve.core.sessions import SessionKey

__all__ = [
    "Role",
    "ToolCallPart",
    "Message",
    "FunctionTool",
    "ForcedTool",
    "ToolChoice",
    "JsonObjectOutput",
    "JsonSchemaOutput",
    "OutputFormat",
    "Sampling",
    "CoreRequest",
]

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolCallPart:
    """A tool call the assistant made earlier in the conversation. ``arguments`` is the
    serialized JSON the client sent back (usually an object; kept as a string so a client's
    non-JSON arguments still render as the text they are)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Message:
    """One conversation turn.

    ``role``: ``system`` (system and developer instructions), ``user``, ``assistant`` or
    ``tool`` (a tool result: ``tool_call_id`` names the call, ``text`` is the result).
    ``text``: the turn's text ("" for an assistant turn that only calls tools).
    ``reasoning``: an assistant turn's reasoning text, passed to templates that replay it.
    ``tool_calls``: an assistant turn's calls, in order. ``name``: the optional author name.
    """

    role: Role
    text: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCallPart, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A tool the model may call: a name (unique in the request), an optional description and
    the JSON Schema of its arguments object (None: any object)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


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
    cannot be enforced is a 400)."""

    name: str | None  # None: the core answers 400 (a schema needs a name, as OpenAI's does)
    schema: Any  # a JSON Schema object (None: 400)
    description: str | None = None
    strict: bool | None = None


OutputFormat = JsonObjectOutput | JsonSchemaOutput


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings, already within the worker's ranges (adapters clamp): ``temperature``
    0 = greedy; ``top_k`` 0 = off; ``seed`` None = random, else in [0, 2^32 - 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


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
    ``param_names``: how this API names the request fields the core reports errors on
    (``tools``, ``tool_choice``, ``response_format``, ``reasoning_effort``, ``messages``,
    ``stop``); the core's errors carry the API's own parameter paths.
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
    param_names: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def tools_enabled(self) -> bool:
        """True when tools are declared and ``tool_choice`` is not ``none``: only then are
        tools shown to the template and calls parsed out of the output."""
        return bool(self.tools) and self.tool_choice != "none"

    def param(self, name: str) -> str:
        """This API's name for the core field ``name`` (itself when the API did not say)."""
        return self.param_names.get(name, name)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: ``role``, ``content`` (always a str),
        and where present ``name``, ``tool_calls`` (``arguments`` decoded into an object when
        it is a JSON object: templates iterate or ``tojson`` it), ``tool_call_id``,
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


def _decode_arguments(arguments: str) -> Any:
    """A dict when ``arguments`` is a JSON object, else the string unchanged (HF templates
    either iterate the object or print the string). Adapters validated nesting depth."""
    try:
        decoded = strict_json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return decoded if isinstance(decoded, dict) else arguments


def _template_message(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _decode_arguments(call.arguments)}}
            for call in message.tool_calls]
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def arguments_text(arguments: Any) -> str:
    """Serialized arguments for a :class:`ToolCallPart` from a decoded value (a string is
    kept as it is)."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)
