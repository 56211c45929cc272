"""The ``input`` of a Responses request (spec §20.2): its items mapped to conversation
messages (consecutive reasoning, assistant message and call items become one assistant turn;
call outputs become tool results), and the input-item listing a stored response returns.
Keys an item or content part does not have in OpenAI's item objects are harness metadata:
accepted, not used, collected for the response header (spec §4.1, ``api.ignored_fields``).
Pure."""

from __future__ import annotations

import json
import secrets
from typing import Any

from trioserve import errors, strict_json
from trioserve.api.ignored_fields import IgnoredFields
from trioserve.core.request import (
    Arguments,
    Message,
    ToolCallPart,
)
from trioserve.api.responses.tools import CUSTOM_INPUT_KEY, ToolMapping, model_tool_name
from trioserve.api.responses.values import (
    invalid,
    object_value,
    optional_string,
    printable,
    string_value,
    type_name,
    unsupported,
    wrong_type,
)

__all__ = ["parse_input", "input_item_list"]


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                     "reasoning": "rs", "custom_tool_call": "ctc",
                     "custom_tool_call_output": "ctco"}


def input_item_list(value: Any) -> list[dict[str, Any]]:
    """The (validated) input as OpenAI's input-item list: a string is one user message; a
    message's string content becomes one ``input_text`` part (``output_text`` for the
    assistant); an item without an ``id`` gets one; ``status`` is ``completed``; the keys
    :func:`parse_input` ignored are left out."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items: list[dict[str, Any]] = []
    for raw in value:
        item = _known_only(raw)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not item.get("id"):
            item["id"] = f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{secrets.token_hex(16)}"
        item.setdefault("status", "completed")
        items.append(item)
    return items


def _known_only(item: dict[str, Any]) -> dict[str, Any]:
    """A validated item without the keys :func:`parse_input` ignored (they were not used, so
    they are not kept: spec §4.1), in its content parts too."""
    kept = {key: value for key, value in item.items()
            if key in _ITEM_KEYS[item.get("type", "message")]}
    for field in ("content", "output"):
        if isinstance(kept.get(field), list):
            kept[field] = [_known_part(part) for part in kept[field]]
    return kept


def _known_part(part: dict[str, Any]) -> dict[str, Any]:
    known = _PART_KEYS.get(part.get("type", ""))
    return part if known is None else {key: value for key, value in part.items() if key in known}


def parse_input(value: Any, tool_map: dict[str, ToolMapping],
                ignored: IgnoredFields | None = None) -> list[Message]:
    """The conversation ``value`` (the ``input``) holds. Keys an item or part does not know
    are noted in ``ignored`` (spec §4.1). Raises APIError naming the first problem's path."""
    ignored = IgnoredFields() if ignored is None else ignored
    if isinstance(value, str):
        return [Message("user", string_value(value, "input"))]
    if not isinstance(value, list):
        raise wrong_type("input", "a string or an array of input items", value)
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
        item = object_value(raw, param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            raise errors.missing_required_parameter(f"{param}.type")
        if isinstance(kind, str) and kind in _ITEM_KEYS:
            ignored.note(item, _ITEM_KEYS[kind], param)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                shown = json.dumps(role) if isinstance(role, str) else type_name(role)
                raise invalid(f"{param}.role", f"{printable(shown)}; expected user, system, "
                               "developer or assistant.")
            text = _content(item.get("content"), f"{param}.content", ignored)
            if role == "assistant":
                open_turn()["text"].append(text)
                continue
            close_turn()
            messages.append(Message("user" if role == "user" else "system", text))
        elif kind == "reasoning":
            parts = [string_value(_part(c, f"{param}.content[{j}]", ignored).get("text"),
                                  f"{param}.content[{j}].text")
                     for j, c in enumerate(item.get("content") or [])]
            if parts:
                open_turn()["reasoning"].append("".join(parts))
            else:
                open_turn()
        elif kind in ("function_call", "custom_tool_call"):
            call_id = string_value(item.get("call_id"), f"{param}.call_id")
            name = string_value(item.get("name"), f"{param}.name")
            namespace = optional_string(item, "namespace", f"{param}.namespace")
            if kind == "function_call":
                arguments = _arguments(item.get("arguments"), f"{param}.arguments")
            else:
                arguments = {CUSTOM_INPUT_KEY: string_value(item.get("input"), f"{param}.input")}
            model_name = model_tool_name(tool_map, "function" if kind == "function_call" else "custom",
                                         name, namespace)
            open_turn()["calls"].append(ToolCallPart(call_id, model_name, arguments))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            close_turn()
            call_id = string_value(item.get("call_id"), f"{param}.call_id")
            messages.append(Message("tool", _content(item.get("output"), f"{param}.output", ignored),
                                    tool_call_id=call_id, tool_call_id_param=f"{param}.call_id"))
        else:
            shown = json.dumps(kind) if isinstance(kind, str) else type_name(kind)
            raise unsupported(f"{param}.type", f"input item type {printable(shown)} is not "
                               "supported; supported: message, function_call, "
                               "function_call_output, custom_tool_call, custom_tool_call_output, "
                               "reasoning")
    close_turn()
    if not messages:
        raise invalid("input", "expected at least 1 item.")
    return messages


_TEXT_PARTS = ("input_text", "output_text", "text")

# Every key each input item type and content part type knows (OpenAI's item objects, as
# clients echo them back). Used: what the mapping above reads (role, content, text, refusal,
# call ids, names, namespaces, arguments, input, output, a reasoning item's content). Known and
# not used, because they never change what the model sees: ids, statuses, a message's
# ``phase``, a reasoning item's ``summary`` and ``encrypted_content`` (always null from this
# server), an output_text part's annotations and logprobs. Any other key is harness metadata:
# ignored and reported (spec §4.1, §20.6).
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


def _part(raw: Any, param: str, ignored: IgnoredFields) -> dict[str, Any]:
    part = object_value(raw, param)
    kind = part.get("type")
    if isinstance(kind, str) and kind in _PART_KEYS:  # an unknown type is refused by its reader
        ignored.note(part, _PART_KEYS[kind], param)
    return part


def _arguments(value: Any, param: str) -> Arguments:
    """A ``function_call``'s arguments, decoded once (:data:`Arguments`): a string; when it is
    JSON the decoded value must be as sane as a body (bounded nesting, valid Unicode), as for
    Chat Completions' ``tool_calls[].function.arguments`` (spec §5.5)."""
    arguments = string_value(value, param)
    try:
        decoded = strict_json.loads(arguments)
    except strict_json.TooDeep as exc:
        raise invalid(param, f"the JSON in it is {exc}.") from None
    except ValueError:
        return arguments  # not JSON: passed to the template as the string it is
    if "\\u" in arguments and (bad := strict_json.first_lone_surrogate(decoded)) is not None:
        subpath, problem = bad
        where = f" in {subpath}" if subpath else ""
        raise invalid(param, f"the JSON in it has {problem}{where}, which is not valid Unicode.")
    return decoded if isinstance(decoded, dict) else arguments


def _content(value: Any, param: str, ignored: IgnoredFields) -> str:
    """A message's (or tool output's) text: a string, or text parts joined with newlines."""
    if isinstance(value, str):
        return string_value(value, param)
    if not isinstance(value, list):
        raise wrong_type(param, "a string or an array of content parts", value)
    texts: list[str] = []
    for j, raw in enumerate(value):
        part = _part(raw, f"{param}[{j}]", ignored)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            texts.append(string_value(part.get("text"), f"{param}[{j}].text"))
        elif kind == "refusal":
            texts.append(string_value(part.get("refusal"), f"{param}[{j}].refusal"))
        else:
            shown = json.dumps(kind) if isinstance(kind, str) else type_name(kind)
            raise unsupported(f"{param}[{j}].type", f"content part type {printable(shown)} is "
                               "not supported; only text parts (input_text, output_text)")
    return "\n".join(texts)
