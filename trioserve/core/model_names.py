"""Which requested ``model`` names a route serves with the loaded model (spec §16.1).

Agent clients arrive with their vendor's default model name: Claude Code sends ``claude-…``
names (its main model and its small/fast model) on ``/v1/messages`` unless the user set
``ANTHROPIC_MODEL`` and the small-model variable. A server that serves one model answers those
names with it, so the documented two-variable setup (``ANTHROPIC_BASE_URL`` and a token)
works; the response's ``model`` is always the served model's id, so the client can see what
answered. The operator turns this off with the ``client_model_names`` setting; then only the
served id is accepted (404 ``model_not_found`` otherwise).

The rules live here, in one table, so that a later model registry (several models, aliases)
replaces :func:`serves` and nothing else.
"""

from __future__ import annotations

__all__ = ["CLIENT_NAME_PREFIXES", "serves"]

# Route -> name prefixes its clients send by default, served by the loaded model.
CLIENT_NAME_PREFIXES: dict[str, tuple[str, ...]] = {
    "messages": ("claude-",),
}


def serves(requested: object, served_model: str, *, route: str, client_names: bool) -> bool:
    """True when ``requested`` (the body's ``model``) is answered by the loaded model on
    ``route`` (``chat``, ``responses``, ``messages``, ``completions``): the served id itself,
    or, with ``client_names``, a name matching the route's client prefixes."""
    if requested == served_model:
        return True
    if not client_names or not isinstance(requested, str):
        return False
    return requested.startswith(CLIENT_NAME_PREFIXES.get(route, ()))
