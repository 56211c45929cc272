"""The chat templates trioserve ships for the model families its profiles know
(model/profiles.py), selectable by name (``--chat-template gemma3``) for a model file that
carries none (e.g. a base model: docs/models.md "Shipped chat templates").

Each is a text-only template written for trioserve (trioserve/model/templates/NAME.jinja):
tools are shown by the profile's tool injection, as for any template that does not render
them. ``chatml`` is :data:`~trioserve.model.chat_template.CHATML_TEMPLATE`, the template
``--chatml-fallback`` uses.

Pure lookups: reading a shipped file is the only I/O.
"""

from __future__ import annotations

from pathlib import Path

from trioserve.model.chat_template import CHATML_TEMPLATE

__all__ = ["FAMILY_TEMPLATES", "family_template", "suggested_template"]

_DIR = Path(__file__).with_name("templates")

# Shipped name → the profile it is written for (the profile auto-detection then picks, from
# the template's markers).
FAMILY_TEMPLATES: dict[str, str] = {"gemma3": "gemma3", "llama3": "llama3",
                                    "mistral": "mistral", "chatml": "chatml"}

# A profile whose own template is not shipped, and the shipped one that speaks its format.
_SAME_FORMAT = {"qwen3": "chatml", "qwen3_xml": "chatml"}


def family_template(name: str) -> str | None:
    """The source of the shipped template called ``name``; None when no template has that name.

    Raises:
        OSError: the package's template file cannot be read (a broken installation).
    """
    if name not in FAMILY_TEMPLATES:
        return None
    if name == "chatml":
        return CHATML_TEMPLATE
    return (_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def suggested_template(profile_name: str) -> str | None:
    """The shipped template for a model the profile ``profile_name`` was picked for (by its
    architecture), or None when trioserve ships none for that family."""
    if profile_name in FAMILY_TEMPLATES:
        return profile_name
    return _SAME_FORMAT.get(profile_name)
