"""Protocol 2 on the fake worker: several generations in flight (continuous batching).

Every stream of a multiplexed run must equal its solo output (the fake engine guarantees it:
script entries are assigned in arrival order, echo mode echoes the slot's own prompt). Cancel,
latch, stale frames, capacity, session_busy, ping while generating and faults are checked
with other streams in flight. No timed asserts: delays only make overlap likely, timeouts only
bound waits.
"""

from __future__ import annotations

import json

SCRIPT = ["alpha beta gamma", "caf\u00e9 \U0001F600 ok", "x", "a much longer scripted answer, with commas"]


def _gen(rid: int, **fields):
    return {"op": "generate", "id": rid, **fields}


def test_concurrent_streams_interleave_and_equal_solo(fake, script_file):
    script = script_file(SCRIPT)
    solo = fake("--script", script)
    alone = {rid: "".join(solo.generate(rid, prompt="p")[0]) for rid in (1, 2, 3, 4)}
    assert list(alone.values()) == SCRIPT

    w = fake("--script", script, "--token-delay-ms", "2")
    order: list[int] = []
    w.send_many([_gen(rid, prompt="p") for rid in (1, 2, 3, 4)])
    res = w.collect_many([1, 2, 3, 4], order=order)
    for rid in (1, 2, 3, 4):
        texts, done = res[rid]
        assert "".join(texts) == alone[rid] and all(texts)
        assert done["type"] == "done" and done["cancelled"] is False
        assert done["generated_token_ids"] == list(alone[rid].encode())
        assert done["queue_ms"] >= 0 and done["ttft_ms"] >= done["queue_ms"]
    # All four were admitted before the first step: their first records come one per stream.
    assert sorted(order[:4]) == [1, 2, 3, 4]


def test_concurrent_echo_streams_keep_their_own_state(fake):
    w = fake("--token-delay-ms", "1")
    prompts = {1: "first prompt", 2: "second, longer prompt \u00e9", 3: "3", 4: "fourth " * 20}
    w.send_many([_gen(rid, prompt=p) for rid, p in prompts.items()])
    res = w.collect_many(list(prompts))
    for rid, p in prompts.items():
        expected = p.encode()[-64:].decode(errors="replace")
        assert "".join(res[rid][0]) == expected


def test_cancel_one_mid_decode_others_finish_as_solo(fake, script_file):
    long = ["abcdefghijklmnopqrstuvwxyz" * 3, "0123456789" * 6, "ZYXWVUTSRQPONMLKJIHGFEDCBA" * 2]
    w = fake("--script", script_file(long), "--token-delay-ms", "5")
    w.send_many([_gen(rid, prompt="p") for rid in (1, 2, 3)])
    texts = {1: [], 2: [], 3: []}
    while len(texts[2]) < 3:  # stream 2 is decoding
        rec = w.record()
        assert rec["type"] == "token", rec
        texts[rec["id"]].append(rec["text"])
    w.cancel(2)
    res = w.collect_many([1, 2, 3])
    for rid in (1, 3):
        assert "".join(texts[rid] + res[rid][0]) == long[rid - 1]
        assert res[rid][1]["cancelled"] is False
    so_far = "".join(texts[2] + res[2][0])
    done2 = res[2][1]
    assert done2["type"] == "done" and done2["cancelled"] is True and done2["finish_reason"] == "stop"
    assert long[1].startswith(so_far) and len(so_far) < len(long[1])
    assert "generated_token_ids" not in done2


def test_cancel_one_mid_prefill_others_finish_as_solo(fake, script_file):
    script = ["short one " * 3, "short two " * 3, "short three " * 3, "never"]
    w = fake("--script", script_file(script), "--prefill-ms-per-token", "1", "--batch-tokens", "64")
    long_prompt = "word " * 400  # 2,000 tokens at ~61 per step: ~2 s of prefill if not cancelled
    w.send_many([_gen(1, prompt="a"), _gen(2, prompt="b"), _gen(3, prompt="c"), _gen(4, prompt=long_prompt)])
    first = w.record()
    assert first["type"] == "token" and first["id"] in (1, 2, 3)
    w.cancel(4)
    res = w.collect_many([1, 2, 3, 4])
    res[first["id"]][0].insert(0, first["text"])
    for rid in (1, 2, 3):
        assert "".join(res[rid][0]) == script[rid - 1] and res[rid][1]["cancelled"] is False
    texts, done = res[4]
    assert texts == [] and done["cancelled"] is True and done["completion_tokens"] == 0
    assert done["reused_prompt_tokens"] + done["prefilled_prompt_tokens"] == done["prompt_tokens"] == 2000
    # Cancelled inside its prefill: fewer prompt tokens went in than the prompt has.
    actually_prefilled = done["prefill_tok_s"] * done["prefill_ms"] / 1000.0
    assert actually_prefilled < 2000
    # The worker serves on; the script cycles on from entry 4 % 4 = 0 (the cancelled
    # generation took entry 3 when it was admitted).
    texts, done = w.generate(5, prompt="again")
    assert "".join(texts) == script[0] and done["cancelled"] is False


def test_latched_cancel_with_others_in_flight(fake, script_file):
    w = fake("--script", script_file(["one two three four five", "B", "C"]), "--token-delay-ms", "5")
    w.send(_gen(1, prompt="p"))
    assert w.record()["id"] == 1
    w.cancel(3)  # not read yet: latched
    w.send_many([_gen(2, prompt="p"), _gen(3, prompt="p")])
    res = w.collect_many([1, 2, 3])
    assert res[3][0] == [] and res[3][1]["cancelled"] is True and res[3][1]["completion_tokens"] == 0
    assert "".join(res[2][0]) == "B" and res[2][1]["cancelled"] is False
    assert res[1][1]["cancelled"] is False


def test_several_latched_cancels(fake):
    w = fake()
    w.cancel(3)
    w.cancel(5)
    w.send_many([_gen(2, prompt="a"), _gen(3, prompt="b"), _gen(4, prompt="c"), _gen(5, prompt="d")])
    res = w.collect_many([2, 3, 4, 5])
    assert [res[i][1]["cancelled"] for i in (2, 3, 4, 5)] == [False, True, False, True]
    assert "".join(res[4][0]) == "c"


def test_stale_cancel_ignored_while_others_run(fake, script_file):
    w = fake("--script", script_file(["done soon", "the long running one"]), "--token-delay-ms", "3")
    texts, done = w.generate(1, prompt="p")
    assert done["cancelled"] is False
    w.send(_gen(2, prompt="p"))
    assert w.record()["id"] == 2
    w.cancel(1)  # finished: ignored
    w.cancel(0)  # never an id: ignored
    texts, done = w.collect(2)
    assert done["cancelled"] is False and "".join(texts) == "he long running one"


def test_capacity_exhausted_beyond_capacity(fake, script_file):
    w = fake("--capacity", "2", "--script", script_file(["first", "second", "third"]), "--token-delay-ms", "2")
    w.send_many([_gen(1, prompt="p"), _gen(2, prompt="p"), _gen(3, prompt="p")])
    res = w.collect_many([1, 2, 3])
    err = res[3][1]
    assert err["type"] == "error" and err["code"] == "capacity_exhausted" and err["capacity"] == 2
    assert res[3][0] == []
    assert "".join(res[1][0]) == "first" and "".join(res[2][0]) == "second"
    texts, done = w.generate(4, prompt="p")  # slots are free again; 3 took no script entry
    assert "".join(texts) == "third"


def test_ping_answered_while_generating(fake, script_file):
    w = fake("--script", script_file(["y" * 60]), "--token-delay-ms", "20")
    w.send(_gen(1, prompt="p"))
    assert w.record()["type"] == "token"
    w.send({"op": "ping", "id": 2})
    after_pong = None
    while True:
        rec = w.record()
        if rec["type"] == "pong":
            assert rec["id"] == 2
            after_pong = 0
        elif rec["type"] == "token":
            if after_pong is not None:
                after_pong += 1
        else:
            assert rec["type"] == "done" and rec["id"] == 1
            break
    assert after_pong is not None and after_pong > 0  # the pong came while 1 was generating


def test_other_ops_between_steps(fake, script_file):
    w = fake("--script", script_file(["z" * 40]), "--token-delay-ms", "10")
    w.send(_gen(1, prompt="p"))
    assert w.record()["type"] == "token"
    w.send_many([{"op": "tokenize", "id": 2, "text": "ab"},
                 {"op": "session_open", "id": 3, "session_id": "s"},
                 {"op": "generate", "id": 4, "prompt": "p", "session_id": "s", "max_new_tokens": 2},
                 {"op": "generate", "id": 5, "prompt": "p", "session_id": "s"},
                 {"op": "session_close", "id": 6, "session_id": "s"}])
    seen: dict[int, dict] = {}
    while 1 not in seen or 4 not in seen:
        rec = w.record()
        if rec["type"] != "token":
            seen[rec["id"]] = rec
    assert seen[2] == {"type": "tokens", "id": 2, "ids": [97, 98]}
    assert seen[3]["type"] == "ack"
    assert seen[5]["code"] == "session_busy" and seen[5]["session_id"] == "s"
    assert seen[6]["code"] == "session_busy"
    assert seen[4]["type"] == "done" and seen[4]["completion_tokens"] == 2
    assert w.request({"op": "session_close", "id": 7, "session_id": "s"})["type"] == "ack"


def test_tokenize_prompt_segments_and_special_flag(fake):
    w = fake()
    rec = w.request({"op": "tokenize", "id": 1, "prompt_segments": [
        {"text": "<|im_start|>", "special": True}, {"text": "hi", "special": False}, {"ids": [5]}]})
    assert rec["ids"] == list(b"<|im_start|>") + list(b"hi") + [5]
    assert w.request({"op": "tokenize", "id": 2, "prompt_segments": [{"ids": [300]}]})["code"] == "invalid_token_id"
    assert w.request({"op": "tokenize", "id": 3})["code"] == "invalid_request"
    texts, done = w.generate(4, prompt_segments=[{"text": "a", "special": False}, {"text": "b", "special": None}])
    assert "".join(texts) == "ab"


def test_fake_rejects_grammar(fake):
    w = fake()
    assert w.ready["capabilities"]["grammar"] is False
    _, err = w.generate(1, prompt="x", grammar='root ::= "yes" | "no"')
    assert err["type"] == "error" and err["code"] == "unsupported_grammar"
    texts, done = w.generate(2, prompt="ok", grammar=None)
    assert "".join(texts) == "ok"


def test_stdin_eof_with_several_in_flight_exits(fake, script_file):
    w = fake("--script", script_file(["x" * 500]), "--token-delay-ms", "10")
    w.send_many([_gen(1, prompt="p"), _gen(2, prompt="p")])
    assert w.record()["type"] == "token"
    w.proc.stdin.close()
    assert w.proc.wait(10) == 0


def test_exit_after_tokens_counts_tokens_of_all_streams(fake, script_file):
    w = fake("--script", script_file(["abc", "xyz"]), "--exit-after-tokens", "4")
    w.send_many([_gen(1, prompt="p"), _gen(2, prompt="p")])
    got: dict[int, str] = {1: "", 2: ""}
    while (line := w.read_line(10)) is not None:
        rec = json.loads(line)
        assert rec["type"] == "token", rec
        got[rec["id"]] += rec["text"]
    assert got == {1: "ab", 2: "xy"}  # 4 tokens in all, two per stream (one step each)
    assert w.proc.wait(10) == 77
