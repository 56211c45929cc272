"""Token-id replay bookkeeping (trioserve/core/replay.py) and the segment splice (the chat adapter)."""

from __future__ import annotations

from trioserve.core.replay import ReplayStore, ReplayTurn, message_signature
from trioserve.core.replay import splice_ids
from trioserve.worker.protocol import IdsSegment, TextSegment


def call(args: str, name: str = "f", cid: str = "c1") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_signature_compares_arguments_as_json_and_ignores_call_ids():
    a = message_signature("", [call('{"x": 1, "y": [2]}', cid="a")])
    b = message_signature(None, [call({"y": [2], "x": 1}, cid="b")])  # decoded form, other id
    assert a == b
    assert a != message_signature("", [call('{"x": 2, "y": [2]}')])
    assert message_signature("", [call("{not json")]) is None


def turn(content: str, ids: tuple[int, ...]) -> ReplayTurn:
    return ReplayTurn(message_signature(content, None), ids)


def history(*assistant: str) -> list[dict]:
    out = [{"role": "user", "content": "q0"}]
    for i, text in enumerate(assistant):
        out += [{"role": "assistant", "content": text}, {"role": "user", "content": f"q{i + 1}"}]
    return out


def test_turns_replay_by_position_and_an_edit_invalidates_later_ones():
    store = ReplayStore()
    store.record("s", history(), turn("A", (1,)))
    store.record("s", history("A"), turn("B", (2,)))
    store.record("s", history("A", "B"), turn("C", (3,)))
    plan = store.plan("s", history("A", "B", "C"))
    assert [(i, t.ids) for i, t in plan] == [(1, (1,)), (3, (2,)), (5, (3,))]
    # Turn B edited: A still replays; B and C are forgotten for good.
    assert [t.ids for _, t in store.plan("s", history("A", "B2", "C"))] == [(1,)]
    assert [t.ids for _, t in store.plan("s", history("A", "B", "C"))] == [(1,)]
    assert store.plan("other", history("A")) == []


def test_record_needs_every_earlier_turn_remembered():
    store = ReplayStore()
    store.record("s", history("unknown"), turn("B", (2,)))  # nothing remembered before it
    assert store.plan("s", history("unknown", "B")) == []


def test_store_is_bounded():
    store = ReplayStore(max_sessions=2)
    for key in "abc":
        store.record(key, history(), turn("A", (1,)))
    assert store.plan("a", history("A")) == []
    assert len(store.plan("c", history("A"))) == 1


def test_splice_replaces_spans_across_segments():
    segments = (("<s>head ", True), ("body text", False), (" tail<e>", True))
    # Cut "body text" plus the space of the tail segment, and "il" of "tail".
    out = splice_ids(segments, [(8, 18, (7, 8)), (20, 22, (9,))])
    assert out == (TextSegment("<s>head ", True), IdsSegment((7, 8)), TextSegment("ta", True),
                   IdsSegment((9,)), TextSegment("<e>", True))
    assert splice_ids(segments, []) == tuple(TextSegment(t, s) for t, s in segments)
