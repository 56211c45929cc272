"""Validation of ``POST /v1/chat/completions`` bodies into a normalized :class:`ChatRequest`.

Owns the request half of the HTTP contract (spec/README.md §4 validation order, §5 request
parameters). Pure: bytes in, a frozen :class:`ChatRequest` or an :class:`APIError` out.
It does not render templates, count tokens or check the context (later stages; see
``chat_template.py`` and the serving layer).

Validation order, each stage finishing before the next starts:

1. body size (413 ``request_too_large``);
2. JSON: UTF-8, and the body must be an object (400 ``invalid_json``);
3. types and values of every known parameter, in :data:`_FIELD_ORDER` (spec §5.4's order,
   then the accepted-and-ignored parameters); the **first** problem is reported (400
   ``invalid_value``, or ``missing_required_parameter`` when absent or null);
4. unsupported parameters and values, **all** reported in one 400 ``unsupported_parameter``
   whose ``param`` is the first offender in body order;
5. ``model`` (404 ``model_not_found``).

Why hand-written checks rather than pydantic models: the contract needs the first error in a
fixed order, ``missing`` told apart from ``wrong``, role-dependent message rules and exact
``param`` paths (``messages[1].content[0].text``). Pydantic's union and discriminator errors
report every branch with tag segments in the location, which we would have to undo; a few
small typed helpers state the rules more directly.

Conventions: an explicit JSON ``null`` for an optional parameter means "not given" (OpenAI's
schema marks them nullable). ``bool`` is never accepted as a number. Integer parameters accept
integral floats (``100.0``) because some JSON encoders emit them; ``100.5`` is rejected.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import errors
from .chat_template import RESERVED_TEMPLATE_VARIABLES

__all__ = ["ChatRequest", "parse_chat_request", "SUPPORTED_PARAMETERS", "MAX_STOP_STRINGS"]

MAX_STOP_STRINGS = 16
_INT32_MAX = 2**31 - 1
# spec §5.1: any int64 or uint64 seed; the worker takes [0, 2^32) (spec/worker-protocol.md §4).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_SEED_MODULUS = 2**32

# OpenAI's rule for function names; also keeps names safe inside templates and tool-call tags.
_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_ROLES = ("system", "developer", "user", "assistant", "tool")

# Named in the unsupported_parameter message so the client learns what it may send instead.
SUPPORTED_PARAMETERS: tuple[str, ...] = (
    "model",
    "messages",
    "stream",
    "stream_options.include_usage",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "tools",
    # [structured outputs] was "tool_choice ('auto' or 'none')"; response_format and
    # parallel_tool_calls added (issue 13).
    "tool_choice",
    "parallel_tool_calls",
    "response_format (text, json_object, json_schema)",
    "chat_template_kwargs",
)

_MISSING: Any = object()  # "absent" differs from an explicit null only for required fields


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated, normalized chat completion request.

    Attributes:
        model: the requested model id (equal to the served id).
        messages: template-ready dicts with ``role`` (``developer`` is normalized to
            ``system``: few chat templates know it, and OpenAI defines it as the new name for
            system instructions), ``content`` (always a str: text parts joined with ``"\\n"``;
            ``""`` for an assistant turn that only carries tool calls) and, where given,
            ``name``, ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
            "arguments"}}]`` with ``arguments`` JSON-decoded into an object when it is a valid
            JSON object, because HF templates iterate or ``tojson`` it), ``tool_call_id``,
            ``reasoning_content``. Treat as read-only.
        stream: whether to answer with server-sent events.
        include_usage: ``stream_options.include_usage``; always False when not streaming
            (spec §5.1: stream_options is ignored then).
        temperature: in [0, 2]; default 1.0. 0 means greedy.
        top_p: in (0, 1]; default 1.0.
        top_k: ≥ 0; default 0 (off).
        seed: None for a random seed, else a value in [0, 2^32) for the worker. The request
            may send any integer in [-2^63, 2^64 - 1] (spec §5.1); it is reduced modulo 2^32
            (Python's ``%``, so ``-1`` becomes ``2^32 - 1``). Note ``-1`` is therefore a fixed
            seed, not llama.cpp's "random": absent or null is the only way to ask for random.
        max_tokens: completion budget, or None for "until the context is full". The smaller
            of ``max_tokens`` and ``max_completion_tokens`` when both are given.
        stop: distinct, non-empty stop strings in request order (empty strings in the
            request are ignored, spec §5.1; at most 16 entries are accepted).
        tools: the declared function tools, normalized to ``{"type": "function",
            "function": {"name", "description"?, "parameters"?}}``, or None.
        tool_choice: ``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function",
            "function": {"name": str}}`` (the last two force a call; ``structured`` turns them
            into a grammar and checks the name).
        chat_template_kwargs: extra template variables (for example ``enable_thinking``).
        response_format: the ``response_format`` object as sent (``type`` is json_object or
            json_schema; ``structured`` validates the rest), or None (absent or text).
        parallel_tool_calls: False limits a forced tool choice to one call.
    """

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    include_usage: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # [structured outputs] issue 13: carried for structured.constraint_for.
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @property
    def tools_enabled(self) -> bool:
        """True when tools are declared and ``tool_choice`` is not ``none``: only then are
        tools passed to the template and tool calls parsed out of the output."""
        return bool(self.tools) and self.tool_choice != "none"  # [structured outputs]

    @property
    def tool_names(self) -> frozenset[str]:
        """Names of the declared tools (empty without tools)."""
        return frozenset(t["function"]["name"] for t in self.tools or ())


def parse_chat_request(body: bytes, *, served_model: str, max_body_bytes: int) -> ChatRequest:
    """Validate a chat completion request body.

    Args:
        body: the raw request body.
        served_model: the only model id this server answers to.
        max_body_bytes: the body size limit (``TRIOSERVE_MAX_BODY_BYTES``).

    Returns:
        The normalized request.

    Raises:
        APIError: the first failing stage of the validation order (module docstring).
    """
    if len(body) > max_body_bytes:
        raise errors.request_too_large(max_body_bytes)
    obj = _load_json_object(body)
    validator = _Validator(obj)
    request = validator.validate()
    unsupported = validator.unsupported_in_body_order()
    if unsupported:
        raise errors.unsupported_parameters(unsupported, SUPPORTED_PARAMETERS)
    if request.model != served_model:
        raise errors.model_not_found(request.model, served_model)
    return request


# --- JSON -------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity, which are not JSON (RFC 8259) and no client should send.
    raise ValueError(f"{name} is not valid JSON")


def _load_json_object(body: bytes) -> dict[str, Any]:
    try:
        # Decode explicitly: json.loads(bytes) would also guess UTF-16/32, which the spec
        # (§3, "not UTF-8" is invalid_json) does not allow.
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.invalid_json("the body is not valid UTF-8") from None
    if not text.strip():
        raise errors.invalid_json("the body is empty")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise errors.invalid_json("nested too deeply") from None
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise errors.invalid_json(str(exc)) from None
    if not isinstance(obj, dict):
        raise errors.invalid_json(f"the body must be a JSON object, got {_type_name(obj)}")
    return obj


# --- typed helpers ----------------------------------------------------------------------


def _type_name(value: Any) -> str:
    """JSON type name of a decoded value, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _wrong_type(param: str, expected: str, value: Any) -> errors.APIError:
    return errors.invalid_value(
        f"Invalid type for '{param}': expected {expected}, got {_type_name(value)}.", param
    )


def _as_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(param, "a boolean", value)
    return value


def _as_str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _wrong_type(param, "a string", value)
    return value


def _as_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _wrong_type(param, "an object", value)
    return value


def _as_list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise _wrong_type(param, "an array", value)
    return value


def _as_number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(param, "a number", value)
    return float(value)


def _as_int(value: Any, param: str) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(param, "an integer", value)
    return value


def _in_range(value: float, param: str, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise errors.invalid_value(
            f"Invalid value for '{param}': {value:g} is not in {interval}.", param
        )


def _required(obj: dict[str, Any], key: str, path: str, convert: Any) -> Any:
    """``obj[key]`` converted by ``convert``; absent or null is ``missing_required_parameter``."""
    value = obj.get(key)
    if value is None:
        raise errors.missing_required_parameter(f"{path}.{key}")
    return convert(value, f"{path}.{key}")


def _decode_arguments(arguments: str) -> Any:
    """Tool-call arguments for templates: a dict when ``arguments`` is a JSON object, else the
    string unchanged (HF templates either iterate the object or print the string)."""
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return arguments
    return decoded if isinstance(decoded, dict) else arguments


# --- the validator ----------------------------------------------------------------------

# Stage 3 checks known parameters in this order, so "the first problem" does not depend on
# the order of keys in the client's body.
_FIELD_ORDER = (
    "model",
    "messages",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
    # accepted, and ignored or rejected in stage 4 depending on the value
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "response_format",
    "reasoning_effort",
    "user",
    "store",
    "metadata",
    "service_tier",
    "prediction",
    "modalities",
    "prompt_cache_key",
    "safety_identifier",
)
# OpenAI parameters trioserve does not implement: accepted when null, unsupported otherwise
# (spec §5.3). Any key in neither list is unsupported even when null.
_OPENAI_UNIMPLEMENTED = ("audio", "functions", "function_call", "web_search_options", "verbosity")
_KNOWN = frozenset(_FIELD_ORDER) | frozenset(_OPENAI_UNIMPLEMENTED)


class _Validator:
    """Stage 3 (types and values, raising on the first problem), then stage 4 (unsupported
    values, all collected and reported together)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def _get(self, key: str) -> Any:
        """The value of an optional parameter; absent and null both give None."""
        return self.body.get(key)

    # stage 3 ---------------------------------------------------------------------------

    def validate(self) -> ChatRequest:
        body = self.body
        model = body.get("model", _MISSING)
        if model is _MISSING or model is None:
            raise errors.missing_required_parameter("model")
        model = _as_str(model, "model")
        messages = self._messages()

        stream = self._opt_bool("stream") or False
        include_usage = False
        if (opts := self._get("stream_options")) is not None:
            opts = _as_object(opts, "stream_options")
            # Other stream_options keys are accepted and ignored (spec §5.2).
            if opts.get("include_usage") is not None:
                include_usage = _as_bool(opts["include_usage"], "stream_options.include_usage")

        temperature = self._opt_number("temperature", 0.0, 2.0)
        top_p = self._opt_number("top_p", 0.0, 1.0, lo_open=True)
        top_k = self._opt_int("top_k", 0, math.inf)
        seed = self._opt_int("seed", _SEED_MIN, _SEED_MAX)
        max_tokens = self._opt_int("max_tokens", 1, math.inf)
        max_completion = self._opt_int("max_completion_tokens", 1, math.inf)
        # Huge values are clamped, not rejected (spec §9.1 clamps max_tokens to the room left
        # anyway): beyond int32 they mean "no limit" (max_tokens) or "off" (top_k, as any
        # value ≥ the vocabulary size), and the worker's fields are 32-bit.
        limits = [min(v, _INT32_MAX) for v in (max_tokens, max_completion) if v is not None]
        if top_k is not None:
            top_k = min(top_k, _INT32_MAX)
        stop = self._stop()
        self._opt_int("n", 1, math.inf)
        tools = self._tools()
        tool_choice = self._tool_choice()
        template_kwargs = self._template_kwargs()
        self._check_ignored_fields()

        return ChatRequest(
            model=model,
            messages=messages,
            stream=stream,
            include_usage=stream and include_usage,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            seed=None if seed is None else seed % _SEED_MODULUS,
            max_tokens=min(limits) if limits else None,
            stop=stop,
            tools=tools,
            tool_choice=tool_choice,
            chat_template_kwargs=template_kwargs,
            # [structured outputs] issue 13
            response_format=None if (self._get("response_format") or {}).get("type") == "text"
            else self._get("response_format"),
            parallel_tool_calls=self._get("parallel_tool_calls") is not False,
        )

    def _opt_bool(self, key: str) -> bool | None:
        value = self._get(key)
        return None if value is None else _as_bool(value, key)

    def _opt_number(
        self, key: str, lo: float, hi: float, *, lo_open: bool = False
    ) -> float | None:
        value = self._get(key)
        if value is None:
            return None
        number = _as_number(value, key)
        if not math.isfinite(number):  # cannot come from JSON, but cheap to state
            raise errors.invalid_value(f"Invalid value for '{key}': must be finite.", key)
        _in_range(number, key, lo, hi, lo_open=lo_open)
        return number

    def _opt_int(self, key: str, lo: float, hi: float) -> int | None:
        value = self._get(key)
        if value is None:
            return None
        number = _as_int(value, key)
        if not lo <= number <= hi:
            bound = f"≥ {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
            raise errors.invalid_value(f"Invalid value for '{key}': {number} is not {bound}.", key)
        return number

    def _messages(self) -> list[dict[str, Any]]:
        raw = self.body.get("messages", _MISSING)
        if raw is _MISSING or raw is None:
            raise errors.missing_required_parameter("messages")
        raw = _as_list(raw, "messages")
        if not raw:
            raise errors.invalid_value(
                "Invalid value for 'messages': at least one message is required.", "messages"
            )
        return [self._message(m, f"messages[{i}]") for i, m in enumerate(raw)]

    def _message(self, raw: Any, path: str) -> dict[str, Any]:
        msg = _as_object(raw, path)
        role = msg.get("role")
        if role is None:
            raise errors.missing_required_parameter(f"{path}.role")
        if not isinstance(role, str) or role not in _ROLES:
            shown = json.dumps(role) if isinstance(role, str) else _type_name(role)
            raise errors.invalid_value(
                f"Invalid value for '{path}.role': {shown}; expected one of {', '.join(_ROLES)}.",
                f"{path}.role",
            )
        out: dict[str, Any] = {"role": "system" if role == "developer" else role}

        # Unknown message keys (refusal, annotations, audio, function_call: null, ...) are
        # ignored: clients echo back whole response messages, and rejecting them would break
        # every multi-turn conversation. Top-level parameters, by contrast, are never ignored.
        tool_calls = None
        if role == "assistant" and msg.get("tool_calls") is not None:
            tool_calls = self._message_tool_calls(msg["tool_calls"], f"{path}.tool_calls")

        content = msg.get("content")
        if content is None:
            if not tool_calls:
                raise errors.missing_required_parameter(f"{path}.content")
            out["content"] = ""  # templates concatenate content; None would break them
        else:
            out["content"] = self._content(content, f"{path}.content")

        if msg.get("name") is not None:
            out["name"] = _as_str(msg["name"], f"{path}.name")
        if tool_calls:
            out["tool_calls"] = tool_calls
        if role == "tool":
            tool_call_id = msg.get("tool_call_id")
            if tool_call_id is None:
                raise errors.missing_required_parameter(f"{path}.tool_call_id")
            out["tool_call_id"] = _as_str(tool_call_id, f"{path}.tool_call_id")
        if role == "assistant" and msg.get("reasoning_content") is not None:
            # Passed through for templates that replay reasoning (Qwen3 does, after the
            # last user turn); a non-string is a client bug worth reporting.
            out["reasoning_content"] = _as_str(
                msg["reasoning_content"], f"{path}.reasoning_content"
            )
        return out

    def _content(self, content: Any, path: str) -> str:
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise _wrong_type(path, "a string or an array of content parts", content)
        texts: list[str] = []
        for j, part in enumerate(content):
            ppath = f"{path}[{j}]"
            part = _as_object(part, ppath)
            ptype = _required(part, "type", ppath, _as_str)
            if ptype != "text":
                # spec §5.5: invalid_value, not unsupported_parameter (it is a value of
                # messages, not a parameter).
                raise errors.invalid_value(
                    f"Invalid value for '{ppath}': only text content parts "
                    f"({{\"type\": \"text\", \"text\": ...}}) are supported, got '{ptype}'.",
                    ppath,
                )
            text = part.get("text")
            if text is None:
                raise errors.missing_required_parameter(f"{ppath}.text")
            texts.append(_as_str(text, f"{ppath}.text"))
        # "\n" as separator: parts are usually separate passages (instructions, a document,
        # a question); gluing them with "" would merge the last word of one into the next.
        return "\n".join(texts)

    def _message_tool_calls(self, raw: Any, path: str) -> list[dict[str, Any]]:
        calls = []
        for k, call in enumerate(_as_list(raw, path)):
            cpath = f"{path}[{k}]"
            call = _as_object(call, cpath)
            call_id = _required(call, "id", cpath, _as_str)
            ctype = call.get("type")
            if ctype is not None and ctype != "function":
                raise errors.invalid_value(
                    f"Invalid value for '{cpath}.type': only 'function' tool calls exist.",
                    f"{cpath}.type",
                )
            function = _required(call, "function", cpath, _as_object)
            name = function.get("name")
            if name is None:
                raise errors.missing_required_parameter(f"{cpath}.function.name")
            name = _as_str(name, f"{cpath}.function.name")
            arguments = function.get("arguments")
            if arguments is None:
                raise errors.missing_required_parameter(f"{cpath}.function.arguments")
            arguments = _as_str(arguments, f"{cpath}.function.arguments")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": _decode_arguments(arguments)},
                }
            )
        return calls

    def _stop(self) -> tuple[str, ...]:
        value = self._get("stop")
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
            single = True
        elif isinstance(value, list):
            single = False
        else:
            raise _wrong_type("stop", "a string or an array of strings", value)
        if len(value) > MAX_STOP_STRINGS:
            raise errors.invalid_value(
                f"Invalid value for 'stop': at most {MAX_STOP_STRINGS} stop strings, "
                f"got {len(value)}.",
                "stop",
            )
        out: list[str] = []
        for i, s in enumerate(value):
            s = _as_str(s, "stop" if single else f"stop[{i}]")
            # spec §5.1: empty strings are ignored (they would match everywhere).
            if s and s not in out:
                out.append(s)
        return tuple(out)

    def _tools(self) -> list[dict[str, Any]] | None:
        value = self._get("tools")
        if value is None:
            return None
        tools: list[dict[str, Any]] = []
        seen: set[str] = set()
        for i, tool in enumerate(_as_list(value, "tools")):
            tpath = f"tools[{i}]"
            tool = _as_object(tool, tpath)
            ttype = _required(tool, "type", tpath, _as_str)
            if ttype != "function":
                raise errors.invalid_value(
                    f"Invalid value for '{tpath}.type': only 'function' tools are supported, "
                    f"got {json.dumps(ttype)}.",
                    f"{tpath}.type",
                )
            function = _required(tool, "function", tpath, _as_object)
            name = function.get("name")
            if name is None:
                raise errors.missing_required_parameter(f"{tpath}.function.name")
            name = _as_str(name, f"{tpath}.function.name")
            if not _TOOL_NAME_RE.match(name):
                raise errors.invalid_value(
                    f"Invalid value for '{tpath}.function.name': {json.dumps(name)}; names are "
                    "1-64 characters of a-z, A-Z, 0-9, '_' and '-'.",
                    f"{tpath}.function.name",
                )
            if name in seen:
                raise errors.invalid_value(
                    f"Invalid value for '{tpath}.function.name': duplicate tool name '{name}'.",
                    f"{tpath}.function.name",
                )
            seen.add(name)
            normalized: dict[str, Any] = {"name": name}
            if function.get("description") is not None:
                normalized["description"] = _as_str(
                    function["description"], f"{tpath}.function.description"
                )
            if function.get("parameters") is not None:
                normalized["parameters"] = _as_object(
                    function["parameters"], f"{tpath}.function.parameters"
                )
            if function.get("strict") is not None:
                # Accepted; we do not constrain decoding, so it changes nothing.
                _as_bool(function["strict"], f"{tpath}.function.strict")
            tools.append({"type": "function", "function": normalized})
        # An empty array declares no tools; same as omitting it.
        return tools or None

    def _tool_choice(self) -> str | dict[str, Any]:
        """``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function":
        {"name": str}}`` (normalized to exactly those keys)."""
        value = self._get("tool_choice")
        if value is None:
            return "auto"
        if isinstance(value, dict):
            if value.get("type") != "function":
                raise errors.invalid_value(
                    "Invalid value for 'tool_choice.type': expected 'function'.", "tool_choice.type"
                )
            function = value.get("function")
            if function is None:
                raise errors.missing_required_parameter("tool_choice.function")
            function = _as_object(function, "tool_choice.function")
            if function.get("name") is None:
                raise errors.missing_required_parameter("tool_choice.function.name")
            name = _as_str(function["name"], "tool_choice.function.name")
            return {"type": "function", "function": {"name": name}}  # [structured outputs]
        value = _as_str(value, "tool_choice")
        if value == "required":
            return "required"  # [structured outputs]
        if value not in ("auto", "none"):
            raise errors.invalid_value(
                f"Invalid value for 'tool_choice': {json.dumps(value)}; expected 'auto', "
                "'none', 'required' or an object.",
                "tool_choice",
            )
        return value

    def _template_kwargs(self) -> dict[str, Any]:
        value = self._get("chat_template_kwargs")
        if value is None:
            return {}
        value = _as_object(value, "chat_template_kwargs")
        for key in value:
            if key in RESERVED_TEMPLATE_VARIABLES:
                raise errors.invalid_value(
                    f"Invalid value for 'chat_template_kwargs.{key}': this template variable "
                    "is set by the server and cannot be overridden.",
                    f"chat_template_kwargs.{key}",
                )
        return dict(value)

    def _check_ignored_fields(self) -> None:
        """Types of the parameters that are accepted-and-ignored at their neutral value and
        unsupported otherwise (stage 4 decides which). Only types: any well-typed
        non-neutral value is unsupported, whatever its range (spec §5.3)."""
        self._opt_bool("parallel_tool_calls")
        self._opt_bool("logprobs")
        self._opt_int("top_logprobs", -math.inf, math.inf)  # type check only
        self._opt_number("frequency_penalty", -math.inf, math.inf)
        self._opt_number("presence_penalty", -math.inf, math.inf)
        if (bias := self._get("logit_bias")) is not None:
            _as_object(bias, "logit_bias")
        if (fmt := self._get("response_format")) is not None:
            fmt = _as_object(fmt, "response_format")
            if fmt.get("type") is None:
                raise errors.missing_required_parameter("response_format.type")
            _as_str(fmt["type"], "response_format.type")
        if (effort := self._get("reasoning_effort")) is not None:
            _as_str(effort, "reasoning_effort")
        if (user := self._get("user")) is not None:
            _as_str(user, "user")
        self._opt_bool("store")
        if (metadata := self._get("metadata")) is not None:
            _as_object(metadata, "metadata")
        if (tier := self._get("service_tier")) is not None:
            _as_str(tier, "service_tier")
        if (prediction := self._get("prediction")) is not None:
            _as_object(prediction, "prediction")
        if (modalities := self._get("modalities")) is not None:
            for i, m in enumerate(_as_list(modalities, "modalities")):
                _as_str(m, f"modalities[{i}]")
        for key in ("prompt_cache_key", "safety_identifier"):
            if (value := self._get(key)) is not None:
                _as_str(value, key)

    # stage 4 ---------------------------------------------------------------------------

    def unsupported_in_body_order(self) -> list[tuple[str, str]]:
        """Every unsupported parameter, ordered as the client's body orders its keys."""
        get = self._get
        rules: Mapping[str, tuple[bool, str]] = {
            "n": (get("n") not in (None, 1), "only n=1 is supported"),
            "logprobs": (get("logprobs") is True, "log probabilities are not supported"),
            "top_logprobs": (get("top_logprobs") is not None, "log probabilities are not supported"),
            "frequency_penalty": (get("frequency_penalty") not in (None, 0), "only 0 is supported"),
            "presence_penalty": (get("presence_penalty") not in (None, 0), "only 0 is supported"),
            "logit_bias": (bool(get("logit_bias")), "only an empty object is supported"),
            # [structured outputs] issue 13: json_object and json_schema are supported.
            "response_format": (
                get("response_format") is not None
                and get("response_format")["type"] not in ("text", "json_object", "json_schema"),
                "only 'text', 'json_object' and 'json_schema' are supported",
            ),
            "reasoning_effort": (
                get("reasoning_effort") is not None,
                "not supported; use chat_template_kwargs (e.g. enable_thinking)",
            ),
            # [structured outputs] issue 13: false is enforced only where a grammar constrains
            # the calls (forced tool_choice, or a JSON response_format); "required"/named
            # tool_choice are supported.
            "parallel_tool_calls": (
                get("parallel_tool_calls") is False and bool(get("tools"))
                and get("tool_choice") in (None, "auto")
                and (get("response_format") or {}).get("type") in (None, "text"),
                "false is supported only with tool_choice 'required', a named function, or a "
                "JSON response_format",
            ),
            "prediction": (get("prediction") is not None, "predicted outputs are not supported"),
            "modalities": (
                get("modalities") not in (None, ["text"]),
                "only [\"text\"] is supported",
            ),
        }
        out: list[tuple[str, str]] = []
        for key in self.body:
            if key not in _KNOWN:
                out.append((key, "unknown parameter"))
            elif key in _OPENAI_UNIMPLEMENTED:
                if get(key) is not None:
                    out.append((key, "not supported by this server"))
            elif key in rules and rules[key][0]:
                out.append((key, rules[key][1]))
        return out
