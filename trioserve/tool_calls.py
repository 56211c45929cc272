"""Compatibility layer: the Hermes-only API that predates :mod:`trioserve.tool_formats`.

``parse_tool_calls(text, tool_names)`` and ``ToolCallStreamParser(tool_names)`` are
:class:`~trioserve.tool_formats.HermesParser` with the old shapes: names only (no schemas),
and a stream parser whose ``feed`` returns only content while ``finish`` returns every call
(the old stream shape: calls after all content). Serving uses the profile's parser from
:mod:`trioserve.tool_formats` directly, which reports each call as soon as it is complete
(spec/README.md §10). Grammar and degradation rules: :mod:`trioserve.tool_formats.hermes`.
"""

from __future__ import annotations

from collections.abc import Collection

from .tool_formats import HermesParser
from .tool_formats.base import ToolCall, ToolCallFunction, make_tool_call
from .tool_formats.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = [
    "ToolCall",
    "ToolCallFunction",
    "ToolCallStreamParser",
    "parse_tool_calls",
    "make_tool_call",
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
]


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """Split complete model output into ``(content, calls)`` (Hermes format).

    Args:
        text: the whole generated text (stop strings already removed).
        tool_names: names of the request's declared tools; calls to other names stay text.

    Returns:
        the text with recognized call blocks (and the whitespace that only separated them
        from the content) removed, and the calls in output order. ``content`` equals
        ``text`` when there are no calls.
    """
    return HermesParser(dict.fromkeys(tool_names)).parse(text)


class ToolCallStreamParser:
    """Incremental Hermes parser with the old contract: :meth:`feed` returns the content to
    send now; :meth:`finish` returns the remaining content and *all* recognized calls."""

    def __init__(self, tool_names: Collection[str]) -> None:
        self._parser = HermesParser(dict.fromkeys(tool_names))
        self._calls: list[ToolCall] = []

    def feed(self, text: str) -> str:
        """Consume a delta; return the content that can be sent now (may be empty). Raises
        ``RuntimeError`` after :meth:`finish`."""
        content, calls = self._parser.feed(text)
        self._calls.extend(calls)
        return content

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: the remaining content and every recognized call. Raises
        ``RuntimeError`` if called twice."""
        content, calls = self._parser.finish()
        self._calls.extend(calls)
        return content, self._calls
