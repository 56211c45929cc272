"""The stored-response bounds count every character a client sent, decoded arguments too."""

from __future__ import annotations

from trioserve.api.responses.store import ResponseStore, stored_chars
from trioserve.core.request import Message, ToolCallPart


def test_decoded_tool_arguments_weigh_as_their_json_text():
    big = {"path": "x" * 10_000}
    call = ToolCallPart("call_1", "read", big)
    as_text = ToolCallPart("call_1", "read", '{"path": "' + "x" * 10_000 + '"}')
    message = Message(role="assistant", tool_calls=(call,))
    assert stored_chars(message) >= 10_000
    assert stored_chars(message) == stored_chars(Message(role="assistant", tool_calls=(as_text,)))


def test_a_response_over_the_character_bound_is_not_kept():
    store = ResponseStore(max_chars=5_000)
    call = ToolCallPart("call_1", "read", {"path": "x" * 10_000})
    store.put("resp_1", (Message(role="assistant", tool_calls=(call,)),))
    assert store.get("resp_1") is None and store.chars == 0
