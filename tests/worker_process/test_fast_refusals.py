"""Fast refusals (spec §4): a generate that fails a check depending on the request alone —
fields, unsupported grammar, tokenization, context overflow — is answered by the worker's input
reader thread at once, without waiting for the engine step that is running.

Ordering, not wall time: a `ping` is written BEFORE the bad request while a long prefill step
runs. The loop thread answers the ping only after the step; the refusal must come first.
"""

from __future__ import annotations

import time

LONG = "x" * 2000  # one 2,000-token prefill step of ~2 s (--prefill-ms-per-token 1)


def _refusals_overtake_the_step(w, bad: list[dict]) -> list[dict]:
    w.send({"op": "generate", "id": 1, "prompt": LONG, "max_new_tokens": 2})
    time.sleep(0.2)  # let the step start (the assertions below do not depend on this)
    w.send_many([{"op": "ping", "id": 2}] + bad)
    order, errors = [], []
    want = {1, 2} | {b["id"] for b in bad}
    while want:
        rec = w.record(timeout=60)
        if rec["type"] == "token":
            continue
        order.append(rec["id"])
        want.discard(rec["id"])
        if rec["type"] == "error":
            errors.append(rec)
    # Every refusal before the pong (answered after the running step) and before the prefill's end.
    assert set(order[:len(bad)]) == {b["id"] for b in bad}, order
    return errors


def test_refusals_do_not_wait_for_a_running_prefill(fake):
    w = fake("--ctx", "4096", "--prefill-ms-per-token", "1", "--batch-tokens", "4096", "--prefill-chunk", "4096")
    errors = _refusals_overtake_the_step(w, [
        {"op": "generate", "id": 3, "prompt": "y" * 5000},                       # context overflow
        {"op": "generate", "id": 4, "prompt": "z", "grammar": "root ::= \"a\""},  # no grammar support
        {"op": "generate", "id": 5, "prompt": "z", "temperature": -1},           # bad field
        {"op": "generate", "id": 6, "prompt": ""},                               # empty prompt
    ])
    codes = {e["id"]: e["code"] for e in errors}
    assert codes == {3: "context_length_exceeded", 4: "unsupported_grammar", 5: "invalid_request",
                     6: "empty_prompt"}
    overflow = next(e for e in errors if e["id"] == 3)
    assert overflow["prompt_tokens"] == 5000 and overflow["n_ctx"] == 4096
    # The worker serves on; ids still strictly increase over refused generates (spec §2).
    stale = w.request({"op": "generate", "id": 6, "prompt": "again"})
    assert stale["type"] == "error" and "stale" in stale["message"]
    texts, done = w.generate(7, prompt="again")
    assert done["type"] == "done" and "".join(texts) == "again"


def test_a_latched_cancel_of_a_refused_generate_is_dropped(fake):
    w = fake()
    w.cancel(2)  # latched: id 2 not read yet
    err = w.request({"op": "generate", "id": 2, "prompt": "", "max_new_tokens": 1})
    assert err["type"] == "error" and err["code"] == "empty_prompt"
    texts, done = w.generate(3, prompt="ok")
    assert done["cancelled"] is False and "".join(texts) == "ok"
