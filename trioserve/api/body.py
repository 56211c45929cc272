"""The building blocks of the APIs' request body models (spec/README.md §4, §5): the types,
discriminators and base model that the chat, Messages and completions models share, so that no
API package borrows them from another (tests/unit/test_layers.py).

What keeps the translation of pydantic's first error into the contract's error exact
(``api.validation.translate_error``):

- fields are declared in the order the spec reports problems in, so pydantic's first error
  is the contract's first error;
- a null for a field that does not allow null marks a required field (optional ones are all
  nullable), so the translator can call it missing;
- every union is discriminated by a function that picks one branch from the value
  (:func:`by_json_kind`: its JSON type; :func:`tagged_by`: a key such as a message's ``role``),
  so errors come from one branch only; the branch tag pydantic adds to the error location
  contains a ``:`` (``json:string``, ``role:user``), which no field name has, and the
  translator drops it;
- problems inside free-form objects carry the rest of their path in the error context
  (``subpath``), and :func:`invalid` errors carry their wording in ``detail``.

Every string is :data:`Text`: valid Unicode, checked unless the validation context says
``{"unicode_checks": False}`` (the body has no surrogate escape; ``strict_json``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from trioserve import limits, strict_json

__all__ = ["INTEGRAL", "Integer", "JsonObject", "NOT_UNICODE", "NullOnly", "ROUTER_WRITTEN_DEFAULTS",
           "Stop", "StreamOptions", "StrictModel", "Text", "by_json_kind", "invalid", "tagged_by",
           "unicode_checks"]


def invalid(detail: str, subpath: str = "") -> PydanticCustomError:
    """An ``invalid_value`` error for the translator; ``subpath`` extends the field's path
    (for problems inside free-form objects). ``detail`` is a context value, not the
    template, so braces in it are not format fields."""
    return PydanticCustomError("invalid_value", "{detail}", {"detail": detail, "subpath": subpath})


# The end of every "not valid Unicode" message.
NOT_UNICODE = "which is not valid Unicode"


def unicode_checks(info: ValidationInfo) -> bool:
    """Whether this validation must look for lone surrogates (always, unless the caller knows
    the body has no surrogate escape)."""
    return info.context is None or info.context.get("unicode_checks", True)


def _valid_unicode(text: str, info: ValidationInfo) -> str:
    if unicode_checks(info) and (where := strict_json.lone_surrogate(text)) is not None:
        raise invalid(f"contains a lone surrogate ({where}), {NOT_UNICODE}.")
    return text


# Every string of the request: valid Unicode (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]


def _valid_unicode_json(value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
    if unicode_checks(info) and (bad := strict_json.first_lone_surrogate(value)) is not None:
        subpath, problem = bad
        raise invalid(f"contains {problem}, {NOT_UNICODE}.", subpath)
    return value


# A free-form JSON object (tool parameters, chat_template_kwargs, metadata, ...).
JsonObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode_json)]


def _integral_float(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integer parameters accept integral floats (100.0), not booleans. Declared as
# ``Annotated[int, Field(ge=..., le=...), INTEGRAL]``: the bounds come before the float
# conversion so that the JSON Schema states them as minimum/maximum.
INTEGRAL = BeforeValidator(_integral_float)

Integer = Annotated[int, INTEGRAL]

# OpenAI parameters trioserve does not implement: accepted when null, unsupported otherwise
# (stage 4), whatever the type.
NullOnly = Annotated[Any, WithJsonSchema({"type": "null"})]

_JSON_KINDS: dict[type, str] = {str: "string", list: "array", dict: "object"}


def by_json_kind(expected: str, *kinds: str) -> Discriminator:
    """The discriminator of a union whose branches are tagged ``json:<kind>`` (``string``,
    ``array``, ``object``; ``kinds`` lists the union's): it picks the branch by the value's
    JSON type; any other type is ``Invalid type for ...: expected <expected>``. Declared as
    ``Annotated[Annotated[A, Tag("json:string")] | ..., by_json_kind(...)]``."""

    def kind(value: Any) -> str | None:
        name = _JSON_KINDS.get(type(value))
        return f"json:{name}" if name in kinds else None

    return Discriminator(kind, custom_error_type="wrong_type", custom_error_message=expected)


def tagged_by(key: str, allowed: tuple[str, ...], error_type: str) -> Discriminator:
    """The discriminator of a union whose branches are tagged ``<key>:<value>`` for each
    allowed string in the object's ``key`` (``role``, ``type``). ``error_type`` names the
    failure for :data:`TAG_ERRORS` (not an object, tag missing, tag not allowed)."""

    def tag(value: Any) -> str | None:
        if isinstance(value, dict) and isinstance(value.get(key), str) and value[key] in allowed:
            return f"{key}:{value[key]}"
        return None

    return Discriminator(tag, custom_error_type=error_type, custom_error_message=f"invalid '{key}'")


class StrictModel(BaseModel):
    # strict: no "1" → 1, no true → 1.0; extra keys ignored (unknown keys inside a message or
    # stream_options are accepted, spec §5.2, those inside messages reported, §4.1; top-level
    # ones are stage 4's).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# ``stop`` (chat, completions): a string or up to ``MAX_STOP_STRINGS`` strings.
Stop = Annotated[
    Annotated[Text, Tag("json:string")]
    | Annotated[list[Text], Field(max_length=limits.MAX_STOP_STRINGS), Tag("json:array")],
    by_json_kind("a string or an array of strings", "string", "array")]


# ``stream_options`` (chat, completions). No docstring: it would enter the committed request
# schema (spec/request.schema.json) as a description.
class StreamOptions(StrictModel):
    include_usage: bool | None = None


# SGLang's request extensions. The routers of SGLang's lineage (vllm-router, the SGLang Model
# Gateway) parse every chat and completions body and write it out again with these fields at
# their defaults, so a replica behind them sees them on every request. Each is accepted at the
# value that describes what this server does anyway, and unsupported at the other
# (docs/deployment.md, spec §5.2).
ROUTER_WRITTEN_DEFAULTS: dict[str, bool] = {
    "no_stop_trim": False,  # a matched stop string is cut from the output
    "ignore_eos": False,  # the model's end of turn ends the generation
    "continue_final_message": False,  # the prompt opens a new assistant turn
    "skip_special_tokens": True,  # control tokens never reach the text
    "separate_reasoning": True,  # reasoning goes to reasoning_content, apart from content
    "stream_reasoning": True,  # ... and streams as it is generated
    "include_reasoning": True,  # ... and is returned
    "return_hidden_states": False,  # only text is returned
}
