"""The small value checks of the Responses request parsers: each takes a value and the
parameter path it came from and returns the value or raises the 400 naming that path
(OpenAI's error shape, spec §20). Pure."""

from __future__ import annotations

from typing import Any

from trioserve import errors, strict_json

__all__ = ["type_name", "printable", "wrong_type", "invalid", "unsupported", "string_value",
           "optional_string", "object_value", "bool_value", "number_value", "integer_value"]


def type_name(value: Any) -> str:
    return strict_json.json_type_name(value)


def printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def wrong_type(param: str, expected: str, value: Any) -> errors.APIError:
    return errors.invalid_value(
        f"Invalid type for '{param}': expected {expected}, got {type_name(value)}.", param)


def invalid(param: str, detail: str) -> errors.APIError:
    return errors.invalid_value(f"Invalid value for '{param}': {detail}", param)


def unsupported(param: str, reason: str) -> errors.APIError:
    return errors.unsupported_parameters([(param, reason)])


def string_value(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise wrong_type(param, "a string", value)
    if (where := strict_json.lone_surrogate(value)) is not None:
        raise invalid(param, f"contains a lone surrogate ({where}), which is not valid Unicode.")
    return value


def optional_string(obj: dict[str, Any], key: str, param: str) -> str | None:
    value = obj.get(key)
    return None if value is None else string_value(value, param)


def object_value(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    return value


def bool_value(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise wrong_type(param, "a boolean", value)
    return value


def number_value(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(param, "a number", value)
    return float(value)


def integer_value(value: Any, param: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(param, "an integer", value)
    return value
