"""Which requested ``model`` names a model's routes answer (spec/README.md §2.1).

The rule itself is the model registry's (``trioserve.registry``: exact ids, then alias
patterns, then, for a lone model, the names agent clients send by default); a
:class:`ModelNames` carries it to one model's adapters, so that each API's validation checks
``model`` at its usual place in its error order, and an unknown name's 404 lists every id the
server serves. The response's ``model`` is always the serving model's id, so the client can
see what answered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trioserve import errors

__all__ = ["CLIENT_NAME_PREFIXES", "ModelNames", "check_model"]

# Route -> name prefixes its clients send by default, served by a lone model (the same table
# as the registry's, for a core built without one).
CLIENT_NAME_PREFIXES: dict[str, tuple[str, ...]] = {"messages": ("claude-",)}


@dataclass(frozen=True)
class ModelNames:
    """The names one model answers. ``resolve(requested, route)`` is the id of the model the
    server gives ``requested`` to on ``route`` (``chat``, ``responses``, ``messages``,
    ``completions``), or None; ``served`` every id the server serves."""

    model_id: str
    resolve: Callable[[object, str], str | None]
    served: tuple[str, ...]

    @classmethod
    def single(cls, model_id: str, *, client_names: bool) -> ModelNames:
        """A lone model without aliases: its id, and with ``client_names`` the route's client
        name prefixes (``claude-*`` on Messages)."""
        def resolve(requested: object, route: str) -> str | None:
            if requested == model_id:
                return model_id
            if (client_names and isinstance(requested, str)
                    and requested.startswith(CLIENT_NAME_PREFIXES.get(route, ()))):
                return model_id
            return None
        return cls(model_id, resolve, (model_id,))

    def serves(self, requested: object, route: str) -> bool:
        return self.resolve(requested, route) == self.model_id

    def check(self, requested: object, route: str) -> None:
        """Raises: APIError 404 ``model_not_found`` listing the served ids, when this model
        does not answer ``requested`` on ``route``."""
        if not self.serves(requested, route):
            raise errors.model_not_found(str(requested), self.served)


def check_model(requested: object, served_model: str, names: ModelNames | None, route: str) -> None:
    """A parser's ``model`` check: by ``names`` when given, else ``served_model`` alone.

    Raises: APIError 404 ``model_not_found``."""
    if names is not None:
        names.check(requested, route)
    elif requested != served_model:
        raise errors.model_not_found(str(requested), served_model)
