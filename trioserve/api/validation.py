"""What every API's body validation shares (spec/README.md §4 validation order, stages 1-3):
the size, the JSON object, the body model's types with pydantic's first error translated into
the contract's error, and stage 4's "set to something other than" check.

Pure: bytes in, a parsed model or an :class:`~trioserve.errors.APIError` out. Each API's own
module (``api/chat/validation.py``, ``api/messages/request.py``, ...) adds its unsupported
parameters, its model check and its normalization.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from trioserve import errors, strict_json

__all__ = ["load_json_object", "printable", "set_other_than", "translate_error", "validate_body"]

BodyT = TypeVar("BodyT", bound=BaseModel)


# --- JSON (stage 2) -------------------------------------------------------------------------


def validate_body(model: type[BodyT], body: bytes, max_body_bytes: int,
                  translate: Callable[[ErrorDetails], errors.APIError] | None = None,
                  ) -> tuple[dict[str, Any], BodyT]:
    """Stages 1-3 of the validation order (module docstring) for any API's body model: the
    size, the JSON object, then ``model``'s types with its first error translated
    (:func:`translate_error` unless the API translates its own way). Returns the decoded
    object and the parsed model; raises APIError."""
    if len(body) > max_body_bytes:
        raise errors.request_too_large(max_body_bytes)
    obj = load_json_object(body)
    try:
        parsed = model.model_validate(
            obj, context={"unicode_checks": strict_json.may_hold_lone_surrogates(body)})
    except ValidationError as exc:
        raise (translate or translate_error)(exc.errors(include_url=False)[0]) from None
    return obj, parsed


def load_json_object(body: bytes) -> dict[str, Any]:
    try:
        # Decode explicitly: json.loads(bytes) would also guess UTF-16/32, which the spec
        # (§3, "not UTF-8" is invalid_json) does not allow.
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise errors.invalid_json("the body is not valid UTF-8") from None
    if not text.strip():
        raise errors.invalid_json("the body is empty")
    try:
        obj = strict_json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise errors.invalid_json(str(exc)) from None
    if not isinstance(obj, dict):
        raise errors.invalid_json(f"the body must be a JSON object, got {_type_name(obj)}")
    return obj


# --- error translation ----------------------------------------------------------------------

# pydantic's type errors, by the JSON type that was expected.
_EXPECTED_TYPE = {
    "string_type": "a string",
    "bool_type": "a boolean",
    "int_type": "an integer",
    "float_type": "a number",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "an array",
}

_BOUNDS = {"greater_than_equal": ("ge", "≥"), "greater_than": ("gt", ">"),
           "less_than_equal": ("le", "≤"), "less_than": ("lt", "<")}


_type_name = strict_json.json_type_name


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def printable(text: str) -> str:
    """``text`` with lone surrogates written as ``\\udXXX``: error messages and params are
    encoded to UTF-8 for the response, which a lone surrogate would make fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _param(loc: tuple[int | str, ...]) -> str:
    """The client's path of an error location: union branch tags (``json:string``,
    ``role:user``: they contain a ``:``, which no field name has; api/body.py) left out."""
    path = ""
    for segment in loc:
        if isinstance(segment, int):
            path += f"[{segment}]"
        elif ":" not in segment:
            path += f".{segment}" if path else segment
    return path


def _wrong_type(param: str, expected: str, value: Any) -> errors.APIError:
    return errors.invalid_value(
        f"Invalid type for '{param}': expected {expected}, got {_type_name(value)}.", param)


def translate_error(error: ErrorDetails,
                    tag_errors: Mapping[str, tuple[str, tuple[str, ...]]] | None = None,
                    ) -> errors.APIError:
    """The APIError for one pydantic error of a body model (see ``api/body.py`` for why the
    first error, its location and a null are enough). ``tag_errors``: the error types of the
    model's ``tagged_by`` unions → (the key that picks the branch, its allowed values)."""
    tag_errors = tag_errors or {}
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    param = printable(_param(error["loc"]) + ctx.get("subpath", ""))
    kind, value = error["type"], error["input"]

    if kind in tag_errors:
        key, allowed = tag_errors[kind]
        if not isinstance(value, dict):
            return _wrong_type(param, "an object", value)
        tag_param = f"{param}.{key}"
        if value.get(key) is None:
            return errors.missing_required_parameter(tag_param)
        tag = value[key]
        shown = json.dumps(tag) if isinstance(tag, str) else _type_name(tag)
        return errors.invalid_value(
            f"Invalid value for '{tag_param}': {shown}; expected one of {', '.join(allowed)}.",
            tag_param)
    if kind == "missing" or (value is None and kind != "invalid_value"
                             and error["loc"] and isinstance(error["loc"][-1], str)):
        # A null where null is not allowed: optional fields allow it, so this field is
        # required. (A null list item, whose location ends with an index, is a wrong type.)
        return errors.missing_required_parameter(param)
    if kind in _EXPECTED_TYPE:
        return _wrong_type(param, _EXPECTED_TYPE[kind], value)
    if kind == "wrong_type":  # by_json_kind: the message is what was expected
        return _wrong_type(param, error["msg"], value)
    if kind == "literal_error":
        if not isinstance(value, str):
            return _wrong_type(param, ctx["expected"], value)
        detail = f"{json.dumps(value)}; expected {ctx['expected']}."
    elif kind == "invalid_value":
        detail = ctx["detail"]
    elif kind in _BOUNDS:
        key, symbol = _BOUNDS[kind]
        detail = f"{_number(value)} is not {symbol} {_number(ctx[key])}."
    elif kind == "too_short":
        least = ctx["min_length"]
        noun = "entry" if least == 1 else "entries"
        detail = f"expected at least {least} {noun}, got {ctx['actual_length']}."
    elif kind == "too_long":
        detail = f"at most {ctx['max_length']} entries, got {ctx['actual_length']}."
    elif kind == "finite_number":
        detail = "must be a finite number."
    else:  # a rule without its own wording: pydantic's message, which has no internals
        detail = f"{error['msg']}."
    return errors.invalid_value(f"Invalid value for '{param}': {printable(detail)}", param)


# --- stage 4 ----------------------------------------------------------------------------------


def set_other_than(name: str, *allowed: Any) -> Callable[[Any], bool]:
    """A stage-4 check: the parsed body's ``name`` is neither null nor one of ``allowed``."""
    return lambda body: getattr(body, name) not in (None, *allowed)
