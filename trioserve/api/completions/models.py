"""Request bodies of the legacy and helper endpoints as pydantic models (spec/README.md §15).

``POST /v1/completions`` (OpenAI's legacy text completions), ``POST /tokenize`` and
``POST /detokenize`` (llama-server's shapes). Strict like the chat models: no string→number
coercion, booleans are not numbers, every string valid Unicode; unknown top-level keys are
reported by the parser, not ignored.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, Tag

from trioserve import limits
from trioserve.api.body import INTEGRAL, JsonObject, Stop, StreamOptions, StrictModel, Text, by_json_kind

__all__ = ["CompletionBody", "TokenizeBody", "DetokenizeBody", "TokenIds"]

# Token ids as the worker takes them (checked against the vocabulary there).
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=limits.INT32_MAX), INTEGRAL]], Field(min_length=1)]

# A prompt: a string, token ids, or a batch of one of either (a batch of more is refused by
# the parser: one completion per request).
Prompt = Annotated[
    Annotated[Text, Tag("json:string")] | Annotated[list[Any], Tag("json:array")],
    by_json_kind("a string, an array of token ids, or an array holding one of either",
                 "string", "array")]


class CompletionBody(StrictModel):
    """``POST /v1/completions``; fields in the order problems are reported."""

    model: Text
    prompt: Prompt
    suffix: Text | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=limits.MAX_TOKENS_MIN), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=limits.TEMPERATURE_MIN,
                                         le=limits.TEMPERATURE_MAX)] | None = None
    top_p: Annotated[float, Field(gt=limits.TOP_P_MIN_EXCLUSIVE, le=limits.TOP_P_MAX)] | None = None
    top_k: Annotated[int, Field(ge=limits.TOP_K_MIN), INTEGRAL] | None = None
    seed: Annotated[int, Field(ge=limits.SEED_MIN, le=limits.SEED_MAX), INTEGRAL] | None = None
    stop: Stop | None = None
    # Accepted at their neutral value, unsupported otherwise (the parser's table).
    n: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    best_of: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: JsonObject | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = None
    session_id: Text | None = None
    # The completions share of request_models.ROUTER_WRITTEN_DEFAULTS (that value only).
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None


class TokenizeBody(StrictModel):
    """``POST /tokenize`` (llama-server): ``content`` and its flags; ``model`` optional
    (which served model's tokenizer; the default model's without it)."""

    content: Text
    model: Text | None = None
    add_special: bool | None = None
    parse_special: bool | None = None
    with_pieces: bool | None = None


class DetokenizeBody(StrictModel):
    """``POST /detokenize`` (llama-server); ``model`` as for ``/tokenize``."""

    tokens: Annotated[list[Annotated[int, Field(ge=0, le=limits.INT32_MAX), INTEGRAL]], Field(max_length=1 << 20)]
    model: Text | None = None

