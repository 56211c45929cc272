"""Helpers for the tool_formats tests (not a test module)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from trioserve.model.tool_formats import ToolCallParser

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
    },
    "required": ["city"],
}
TOOLS: dict[str, Any] = {"get_weather": WEATHER_SCHEMA, "search": None}


def summary(calls: Iterable[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Names and decoded arguments, checking each call's OpenAI shape on the way."""
    out = []
    for call in calls:
        assert set(call) == {"id", "type", "function"} and call["type"] == "function"
        assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
        assert set(call["function"]) == {"name", "arguments"}
        arguments = json.loads(call["function"]["arguments"])
        assert isinstance(arguments, dict)
        out.append((call["function"]["name"], arguments))
    return out


def parse(cls: type[ToolCallParser], text: str, tools: Any = None) -> tuple[str, list[tuple[str, Any]]]:
    content, calls = cls(TOOLS if tools is None else tools).parse(text)
    assert len({c["id"] for c in calls}) == len(calls)
    return content, summary(calls)


def stream(
    cls: type[ToolCallParser], pieces: Sequence[str], tools: Any = None
) -> tuple[list[str], list[list[tuple[str, Any]]], str, list[tuple[str, Any]]]:
    """Feed ``pieces``; returns per-feed content, per-feed calls, finish content, finish calls."""
    parser = cls(TOOLS if tools is None else tools)
    sent, sent_calls = [], []
    for piece in pieces:
        content, calls = parser.feed(piece)
        sent.append(content)
        sent_calls.append(summary(calls))
    rest, more = parser.finish()
    return sent, sent_calls, rest, summary(more)


def streamed(cls: type[ToolCallParser], pieces: Sequence[str], tools: Any = None) -> tuple[str, list]:
    sent, sent_calls, rest, more = stream(cls, pieces, tools)
    return "".join(sent) + rest, [c for calls in sent_calls for c in calls] + more


def assert_stream_matches_parse(cls: type[ToolCallParser], text: str, tools: Any = None) -> None:
    """Split at EVERY offset into two pieces, and into 1-character pieces: the content and
    the calls always equal the non-stream parse."""
    whole = parse(cls, text, tools)
    for i in range(len(text) + 1):
        assert streamed(cls, [text[:i], text[i:]], tools) == whole, f"split at {i}"
    assert streamed(cls, list(text), tools) == whole, "1-character pieces"
