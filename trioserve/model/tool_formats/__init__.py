"""Tool-call formats: one parser class per model family's output syntax, one interface.

Every parser is a :class:`ToolCallParser`: constructed with the request's declared tools
(name -> parameters JSON schema, see :func:`tool_schemas`), fed text deltas with
``feed(text) -> (content, completed_calls)``, ended with ``finish() -> (content, calls)``, or
used once with ``parse(text) -> (content, calls)``; ``feed_events`` / ``finish_events`` give the
same in output order (content strings and calls interleaved) for streams. :data:`PARSERS` maps each registry name to
its class; :func:`parser_class` looks one up. The modules' docstrings give each exact grammar.
"""

from __future__ import annotations

from collections.abc import Mapping

from trioserve.model.tool_formats.base import (
    ParseEvent,
    ToolCall,
    ToolCallFunction,
    ToolCallParser,
    ToolSchemas,
    make_tool_call,
    tool_schemas,
)
from trioserve.model.tool_formats.gemma4 import Gemma4Parser
from trioserve.model.tool_formats.hermes import HermesParser
from trioserve.model.tool_formats.llama3_json import Llama3JsonParser
from trioserve.model.tool_formats.mistral import MistralParser
from trioserve.model.tool_formats.qwen_xml import QwenXmlParser

__all__ = [
    "PARSERS",
    "Gemma4Parser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParseEvent",
    "QwenXmlParser",
    "ToolCall",
    "ToolCallFunction",
    "ToolCallParser",
    "ToolSchemas",
    "make_tool_call",
    "parser_class",
    "tool_schemas",
]

PARSERS: Mapping[str, type[ToolCallParser]] = {
    cls.format_name: cls
    for cls in (HermesParser, QwenXmlParser, Gemma4Parser, Llama3JsonParser, MistralParser)
}
"""Registry name -> parser class (``hermes``, ``qwen_xml``, ``gemma4``, ``llama3_json``,
``mistral``)."""


def parser_class(name: str) -> type[ToolCallParser]:
    """The parser class registered as ``name``; ``ValueError`` naming the known formats
    otherwise (for settings validation)."""
    try:
        return PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool-call format {name!r}; known: {known}") from None
