"""OpenAI's ``logit_bias`` (Chat Completions and legacy Completions; spec/README.md §5).

Two checks, at two times:

- :func:`parse_logit_bias` (the API adapters, while validating the body): the object's shape,
  as OpenAI documents it: keys are token ids written in decimal digits, values numbers in
  [-100, 100], at most :data:`MAX_ENTRIES` entries. Nothing about the model is known yet.
- :meth:`BiasSupport.check` (the serving core, when the request meets a ready worker): the
  worker's engine must apply a bias (ready record ``capabilities.logit_bias``) and every id must
  be inside its vocabulary (``n_vocab``).

Every failure is a 400 with ``param: "logit_bias"``; nothing here blocks or waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trioserve import errors
from trioserve.worker.protocol import Ready

__all__ = ["MAX_ENTRIES", "BIAS_LIMIT", "LogitBias", "parse_logit_bias", "BiasSupport"]

PARAM = "logit_bias"
MAX_ENTRIES = 300  # OpenAI's limit on the number of biased tokens
BIAS_LIMIT = 100  # biases lie in [-BIAS_LIMIT, BIAS_LIMIT]

# (token id, bias) pairs, ids distinct and ascending; () = no bias.
LogitBias = tuple[tuple[int, float], ...]


def _invalid(detail: str) -> errors.APIError:
    return errors.invalid_value(f"Invalid value for '{PARAM}': {detail}", PARAM)


def _token_id(key: Any) -> int:
    # str.isdigit() admits other scripts' digits ("٣") and superscripts; OpenAI's ids are ASCII.
    if not isinstance(key, str) or not key or not key.isascii() or not key.isdigit():
        raise _invalid(f"keys must be token ids written in decimal digits, got {key!r}.")
    return int(key)


def _bias(key: str, value: Any) -> float:
    # bool is an int subclass, but true/false is no bias.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(f"the bias of token {key} must be a number in [-{BIAS_LIMIT}, {BIAS_LIMIT}].")
    if not (math.isfinite(value) and -BIAS_LIMIT <= value <= BIAS_LIMIT):
        raise _invalid(f"the bias of token {key} must be in [-{BIAS_LIMIT}, {BIAS_LIMIT}], got {value}.")
    return float(value)


def parse_logit_bias(value: Any) -> LogitBias:
    """The body's ``logit_bias`` (None or a JSON object) as sorted (id, bias) pairs.

    Raises APIError 400 ``invalid_value`` (param ``logit_bias``) for anything else: not an
    object, a key that is not decimal digits (a lone surrogate, a sign, a space), a value that
    is not a number (a string, an object, a boolean) or lies outside [-100, 100], more than
    :data:`MAX_ENTRIES` entries. Leading zeros name the same id as without them; two keys
    naming one id are refused (their biases would otherwise be summed or one dropped)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _invalid("it must be an object mapping token ids to biases.")
    if len(value) > MAX_ENTRIES:
        raise _invalid(f"at most {MAX_ENTRIES} tokens may be biased, got {len(value)}.")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token in pairs:
            raise _invalid(f"token {token} appears more than once.")
        pairs[token] = _bias(key, bias)
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True, slots=True)
class BiasSupport:
    """What a ready worker allows of a bias: its engine's name, whether the engine applies a
    bias, its vocabulary size. The default (no worker ready yet) refuses nothing here: requests
    then fail on the worker being unavailable."""

    engine: str = ""
    supported: bool = True
    n_vocab: int = 0

    @classmethod
    def from_ready(cls, ready: Ready) -> BiasSupport:
        return cls(engine=ready.engine, supported=ready.capabilities.get("logit_bias") is True,
                   n_vocab=ready.n_vocab)

    def check(self, bias: LogitBias) -> None:
        """Raise the 400 for a non-empty ``bias`` this worker cannot take: ``unsupported_parameter``
        naming the engine, or ``invalid_value`` for an id at or past ``n_vocab``."""
        if not bias:
            return
        if not self.supported:
            raise errors.APIError(
                400, errors.INVALID_REQUEST,
                f"Unsupported parameter: '{PARAM}' cannot be applied by this model's engine "
                f"({self.engine or 'unknown'}); the llama and ExecuTorch engines apply it.",
                code="unsupported_parameter", param=PARAM)
        if self.n_vocab > 0 and (outside := [t for t, _ in bias if t >= self.n_vocab]):
            raise _invalid(f"token id {outside[0]} is outside the model's vocabulary "
                           f"[0, {self.n_vocab}).")
