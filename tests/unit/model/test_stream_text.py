"""model/stream_text.py: how much of a piece's end is held back for a marker that may follow."""

from __future__ import annotations

from trioserve.model.stream_text import partial_marker_len


def test_the_longest_proper_prefix_of_any_marker_is_held_back():
    assert partial_marker_len("answer </th", ("</think>",)) == 4
    assert partial_marker_len("x <tool", ("<tool_call>", "<|python_tag|>")) == 5
    assert partial_marker_len("x <|py", ("<tool_call>", "<|python_tag|>")) == 4
    assert partial_marker_len("a <", ("<tool_call>",)) == 1


def test_a_whole_marker_or_no_prefix_holds_nothing_back():
    assert partial_marker_len("done</think>", ("</think>",)) == 0  # complete: the caller's
    assert partial_marker_len("plain text", ("</think>",)) == 0
    assert partial_marker_len("", ("</think>",)) == 0
    assert partial_marker_len("text", ()) == 0
