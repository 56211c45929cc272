"""Session keys: which worker session a chat request runs in (spec §12).

A request names its session with, in this order of precedence, the body parameter
``prompt_cache_key``, the header ``x-session-affinity``, the body parameter ``session_id``,
the header ``x-session-id`` or the header ``x-smg-routing-key`` (the SGLang Model Gateway's
routing key); the first one present wins and the others are not looked
at. None of them: the request is anonymous (the worker still reuses the longest common
prompt prefix of an idle slot). A key that is present but invalid — empty, longer than
``MAX_SESSION_KEY_CHARS`` characters, or holding a control character — is a 400
``invalid_value`` naming the parameter or header, even when a later source holds a valid
key (a client must learn that its key was not used).

An agent harness that runs sub-agents under one session key may also name the agent
(``x-claude-code-agent-id``, sent by newer Claude Code releases): the key's branch is then
named after it (``core/branches.py``). Validated like a key, with the header as ``param``.

``prompt_cache_retention`` maps to the worker's spill priority: ``"24h"`` → ``"long"``
(an evicted session's saved state is dropped only after every ``"in_memory"`` one),
``"in_memory"`` or absent → ``"short"``.

Pure functions: no I/O, no OpenAI response knowledge.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Mapping

from trioserve import errors

__all__ = ["AGENT_HEADER", "MAX_SESSION_KEY_CHARS", "ROUTER_KEY_HEADER", "SessionKey",
           "resolve_session_key", "router_session_key", "validate_session_key", "with_agent",
           "worker_retention"]

MAX_SESSION_KEY_CHARS = 256

# (where, name): the sources of a session key, highest precedence first.
_SOURCES: tuple[tuple[str, str], ...] = (
    ("body", "prompt_cache_key"),
    ("header", "x-session-affinity"),
    ("body", "session_id"),
    ("header", "x-session-id"),
)

# The SGLang Model Gateway's consistent-hash header: a router already keys the request's
# replica on it, so the replica keys the worker session on it too. The weakest source: any
# key the client gave trioserve itself (an API's own session header included) wins.
ROUTER_KEY_HEADER = "x-smg-routing-key"

# The agent (main conversation or sub-agent) a keyed request comes from, where the harness
# says so: it names the session's branch instead of a guess from the prompt (spec §12).
AGENT_HEADER = "x-claude-code-agent-id"


@dataclass(frozen=True, slots=True)
class SessionKey:
    """A validated session key and where it came from (``param`` names the body parameter
    or header, for logs and errors); ``agent``: the agent id the harness sent with it (names
    the key's branch), or None."""

    key: str
    param: str
    agent: str | None = None


def validate_session_key(key: str, param: str) -> str:
    """Return ``key`` or raise APIError 400 ``invalid_value`` naming ``param``."""
    if not key:
        raise errors.invalid_value(f"'{param}' must not be empty.", param)
    if len(key) > MAX_SESSION_KEY_CHARS:
        raise errors.invalid_value(f"'{param}' is longer than {MAX_SESSION_KEY_CHARS} "
                                   f"characters ({len(key)}).", param)
    if any(unicodedata.category(ch) == "Cc" for ch in key):
        raise errors.invalid_value(f"'{param}' must not contain control characters.", param)
    return key


def resolve_session_key(body_values: Mapping[str, str | None],
                        headers: Mapping[str, str] | None, *,
                        router_key: bool = True) -> SessionKey | None:
    """The request's session key by precedence (module docstring), or None (anonymous).

    ``body_values`` maps ``prompt_cache_key`` and ``session_id`` to the parsed body's
    values (None when absent or null); ``headers`` is case-insensitive (Werkzeug/Quart
    headers) or lower-cased. ``router_key`` False leaves out the router's header, for an
    API that has a session header of its own to try first (then :func:`router_session_key`).
    Raises APIError 400 for an invalid key of the winning source.
    """
    for where, name in _SOURCES:
        if where == "body":
            value = body_values.get(name)
        else:
            value = headers.get(name) if headers is not None else None
        if value is not None:
            return with_agent(SessionKey(validate_session_key(value, name), name), headers)
    return router_session_key(headers) if router_key else None


def router_session_key(headers: Mapping[str, str] | None) -> SessionKey | None:
    """The session key a router's header gives (``x-smg-routing-key``), or None."""
    value = headers.get(ROUTER_KEY_HEADER) if headers is not None else None
    if value is None:
        return None
    return with_agent(SessionKey(validate_session_key(value, ROUTER_KEY_HEADER),
                                 ROUTER_KEY_HEADER), headers)


def with_agent(key: SessionKey, headers: Mapping[str, str] | None) -> SessionKey:
    """``key`` with the agent id of :data:`AGENT_HEADER` when the request sent one (an
    anonymous request's agent id names nothing: callers pass only keys). Raises APIError 400
    ``invalid_value`` naming the header for an invalid id (the rules of a key)."""
    value = headers.get(AGENT_HEADER) if headers is not None else None
    if value is None:
        return key
    return SessionKey(key.key, key.param, validate_session_key(value, AGENT_HEADER))


def worker_retention(prompt_cache_retention: str | None) -> str:
    """The worker's ``retention`` for an OpenAI ``prompt_cache_retention`` value."""
    return "long" if prompt_cache_retention == "24h" else "short"
