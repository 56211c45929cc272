"""Progress records over the real fake-worker process (spec/worker-protocol.md §4.4).

``--heartbeat-ms`` asks for them; a slow step (``--prefill-ms-per-token``) reports a moving
work counter and its batch before its tokens, a stuck one (``--stuck-token``) a counter that
stands still while the records keep coming; a worker not asked writes none.
"""

from __future__ import annotations

from typing import Any


def records_until_done(w: Any, request_id: int) -> list[dict[str, Any]]:
    out = []
    while True:
        rec = w.record(timeout=60)
        out.append(rec)
        if rec["type"] in ("done", "error") and rec.get("id") == request_id:
            return out


def test_a_slow_step_reports_moving_progress_before_its_tokens(fake):
    w = fake("--heartbeat-ms", "50", "--prefill-ms-per-token", "2")
    assert w.ready["heartbeat_ms"] == 50 and w.ready["capabilities"]["progress"] is True
    w.send({"op": "generate", "id": 1, "prompt": "a" * 150, "max_new_tokens": 2})
    recs = records_until_done(w, 1)
    progress = [r for r in recs if r["type"] == "progress"]
    assert progress, recs  # a 300 ms step, heartbeats every 50 ms
    first_token = next(i for i, r in enumerate(recs) if r["type"] == "token")
    assert all(recs.index(p) < first_token for p in progress)
    works = [p["work"] for p in progress]
    assert works == sorted(works) and works[-1] > 0  # ~1 ms compute slices, never decreasing
    for p in progress:
        assert set(p) == {"type", "step", "work", "elapsed_ms", "stalled_ms", "batch"}
        assert p["batch"] == [{"id": 1, "kind": "prefill", "tokens": 150}]
        assert "id" not in p
    # Short steps (the decodes) write none; the worker still answers between steps.
    assert w.request({"op": "ping", "id": 2}) == {"type": "pong", "id": 2}


def test_a_stuck_step_reports_a_counter_that_stands_still(fake):
    w = fake("--heartbeat-ms", "50", "--stuck-token", "90")
    w.send({"op": "generate", "id": 1, "prompt": "abcZ", "max_new_tokens": 2})
    progress = [w.record(timeout=30) for _ in range(6)]
    assert {p["type"] for p in progress} == {"progress"}
    assert len({p["work"] for p in progress}) == 1 and len({p["step"] for p in progress}) == 1
    stalled = [p["stalled_ms"] for p in progress]
    assert stalled[0] == 0 and stalled == sorted(stalled) and stalled[-1] >= 200
    w.kill()


def test_no_progress_records_unless_asked(fake):
    w = fake("--prefill-ms-per-token", "2")
    assert w.ready["heartbeat_ms"] == 0 and w.ready["capabilities"]["progress"] is False
    w.send({"op": "generate", "id": 1, "prompt": "a" * 150, "max_new_tokens": 2})
    assert not [r for r in records_until_done(w, 1) if r["type"] == "progress"]
