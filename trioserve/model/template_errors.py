"""The errors of chat template rendering (``model.chat_template``, ``model.segments``), in a
module of their own so both can raise them. Callers map them to HTTP with
``errors.template_error`` / ``errors.control_text_error`` (spec §3)."""

from __future__ import annotations

__all__ = ["TemplateError", "TemplateLoadError", "ControlTextError"]


class TemplateError(Exception):
    """The template refused the request (``raise_exception``) or failed on it.

    The caller answers ``errors.template_error(str(exc))``: 400 ``invalid_value`` with param
    ``messages`` (spec §3), since the request's messages are what the template could not take.
    Not a subclass of ``jinja2.TemplateError``, so callers need not import jinja2.

    Attributes:
        message: the template's own message for ``raise_exception``, else a description.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TemplateLoadError(ValueError):
    """A chat template or tokenizer could not be loaded (bad syntax, missing files)."""


class ControlTextError(TemplateError):
    """Request text would reach the model as control tokens, or cannot be kept apart from
    the template's own text. The caller answers 400 ``invalid_value`` naming :attr:`param`.

    Attributes:
        param: the request field holding the offending text (``messages[2].content``,
            ``tools[0]``, ``chat_template_kwargs``), or ``"messages"`` when not located.
    """

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param
