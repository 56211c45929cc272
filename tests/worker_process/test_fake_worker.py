"""Process tests of trioserve-fake-worker: the shared worker loop (cpp/loop/) over the fake engine.

Covers the handshake, generation, UTF-8 integrity, stop strings, sessions, cancellation
(mid-decode, mid-prefill, latched, stale) and the liveness rules. No timed asserts: timeouts
only bound waits.
"""

from __future__ import annotations

import os
import time

import pytest

FAKE = "trioserve-fake-worker"


def test_handshake(fake):
    w = fake()
    r = w.ready
    assert r["protocol"] == 2
    assert r["engine"] == "fake"
    assert r["n_ctx"] == 4096 and r["capacity"] == 4 and r["n_vocab"] == 257
    assert r["max_line_bytes"] == 16 * 1024 * 1024 and r["max_batch_tokens"] == 512
    assert r["capabilities"] == {"supports_cancel": True, "supports_truncate": True, "multiplexed": True,
                                 "special_segments": True, "grammar": False,
                                 "eviction": True, "prefix_sharing": True, "unique_keys": True,
                                 "logit_bias": False, "progress": False}
    assert r["spill_budget_bytes"] == 1 << 30 and r["min_shared_prefix"] == 16
    assert (r["step_target_ms"], r["efficient_prefill"]) == (0, 0)  # no pacing unless asked
    assert (fake("--step-target-ms", "250").ready["step_target_ms"]) == 250
    assert r["special_tokens"]["eos_id"] == 256 and r["special_tokens"]["bos"] is None
    assert "<|im_start|>" in r["chat_template"]
    assert w.request({"op": "ping", "id": 1}) == {"type": "pong", "id": 1}


def test_handshake_without_cancel(fake):
    assert fake("--no-cancel").ready["capabilities"]["supports_cancel"] is False
    assert fake(cancel=False).ready["capabilities"]["supports_cancel"] is False


def test_bad_cancel_fd_is_not_advertised(fake):
    w = fake(cancel=False, env={"TRIOSERVE_CANCEL_FD": "1"})
    assert w.ready["capabilities"]["supports_cancel"] is False
    w2 = fake(cancel=False, env={"TRIOSERVE_CANCEL_FD": "abc"})
    assert w2.ready["capabilities"]["supports_cancel"] is False


def test_flags_ctx_capacity_template(fake, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ messages }}")
    w = fake("--ctx", "123", "--capacity", "2", "--chat-template", str(tpl))
    assert (w.ready["n_ctx"], w.ready["capacity"], w.ready["chat_template"]) == (123, 2, "{{ messages }}")


def test_stream_interval_keeps_the_records_and_refuses_a_bad_value(fake, spawn):
    # Coalesced (spec §4.1): the same token records and done record, only written together.
    assert fake().ready["stream_interval_ms"] == 0
    w = fake("--stream-interval-ms", "1000")
    assert w.ready["stream_interval_ms"] == 1000  # the ready record says what is in effect
    texts, done = w.generate(1, prompt="hello world")
    assert texts == list("hello world") and done["completion_tokens"] == 11
    for bad in ("-1", "1001", "soon"):
        v = spawn(FAKE, "--stream-interval-ms", bad, ready=False)
        assert v.read_line(10) is None  # no ready record: a usage error
        assert v.proc.wait(10) == 2
        assert "--stream-interval-ms" in v.stderr_text()


def test_echo_and_counts(fake):
    w = fake()
    texts, done = w.generate(1, prompt="hello world")
    assert "".join(texts) == "hello world"
    assert all(texts)
    assert done["type"] == "done" and done["finish_reason"] == "stop" and done["cancelled"] is False
    assert done["prompt_tokens"] == 11 and done["completion_tokens"] == 11  # EOS not counted
    assert done["reused_prompt_tokens"] + done["prefilled_prompt_tokens"] == done["prompt_tokens"]
    assert done["generated_token_ids"] == list(b"hello world")
    assert done["stop_string"] is None and "session_id" not in done
    for k in ("queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "total_ms", "prefill_tok_s", "decode_tok_s"):
        assert isinstance(done[k], (int, float)) and done[k] >= 0


def test_script_cycles(fake, script_file):
    w = fake("--script", script_file(["one", "two"]))
    outs = ["".join(w.generate(i, prompt="x")[0]) for i in (1, 2, 3)]
    assert outs == ["one", "two", "one"]


def test_max_new_tokens_length(fake, script_file):
    w = fake("--script", script_file(["abcdefgh"]))
    texts, done = w.generate(1, prompt="x", max_new_tokens=3)
    assert "".join(texts) == "abc" and done["finish_reason"] == "length"
    assert done["completion_tokens"] == 3 and done["generated_token_ids"] == list(b"abc")


def test_utf8_integrity_split_pieces(fake, script_file):
    s = "h\u00e9llo \u20ac \U0001F600 \u4f60\u597d"
    w = fake("--script", script_file([s]))
    texts, done = w.generate(1, prompt="x")
    assert "".join(texts) == s
    for t in texts:
        assert t and "\ufffd" not in t
    assert done["completion_tokens"] == len(s.encode())  # one token per byte


def test_invalid_bytes_become_replacement_char(fake):
    w = fake()
    # Echo mode echoes prompt bytes: 0xFF is never valid, 0xE2 0x82 is a truncated sequence.
    texts, done = w.generate(1, prompt_segments=[{"ids": [0x41, 0xFF, 0x42, 0xE2, 0x82]}])
    assert "".join(texts) == "A\ufffdB\ufffd"
    assert done["completion_tokens"] == 5


@pytest.mark.parametrize(
    "script,stop,expected",
    [
        ("Hello<STOP>world", ["<STOP>"], "Hello"),
        ("ab\n\ncd", ["\n\n"], "ab"),
        ("x caf\u00e9! y", ["\u00e9!"], "x caf"),
        ("<|im_end|>rest", ["<|im_end|>"], ""),
        ("no stop here", ["zzz"], "no stop here"),
        ("first B then A", ["A", "B"], "first "),
    ],
)
def test_stop_strings(fake, script_file, script, stop, expected):
    w = fake("--script", script_file([script]))
    texts, done = w.generate(1, prompt="x", stop=stop)
    assert "".join(texts) == expected
    assert all(texts)
    hit = expected != script
    assert done["finish_reason"] == "stop"
    assert (done["stop_string"] is not None) == hit
    assert ("generated_token_ids" in done) == (not hit)
    if hit:
        # Tokens whose text was cut by the stop still count.
        assert done["completion_tokens"] >= len((expected + done["stop_string"]).encode())


def test_stop_text_held_back_only_while_ambiguous(fake, script_file):
    w = fake("--script", script_file(["aXbXXc"]))
    texts, done = w.generate(1, prompt="x", stop=["XXX"])
    assert "".join(texts) == "aXbXXc" and done["stop_string"] is None


def test_context_length_exceeded(fake):
    w = fake("--ctx", "16")
    _, err = w.generate(1, prompt="x" * 16)
    assert err["type"] == "error" and err["code"] == "context_length_exceeded"
    assert err["prompt_tokens"] == 16 and err["n_ctx"] == 16
    texts, done = w.generate(2, prompt="y" * 10, max_new_tokens=100)
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 6  # clamped to the room


def test_tokenize(fake):
    w = fake()
    assert w.request({"op": "tokenize", "id": 1, "text": "h\u00e9"}) == {"type": "tokens", "id": 1, "ids": [104, 195, 169]}


def test_detokenize_joins_bytes_and_reports_pieces(fake):
    w = fake()
    assert w.request({"op": "detokenize", "id": 1, "ids": [104, 195, 169]}) == {
        "type": "text", "id": 1, "text": "h\u00e9"}
    # A lone continuation byte is invalid UTF-8 in the text; its piece keeps the raw byte.
    assert w.request({"op": "detokenize", "id": 2, "ids": [169], "pieces": True}) == {
        "type": "text", "id": 2, "text": "\ufffd", "pieces": [[169]]}
    error = w.request({"op": "detokenize", "id": 3, "ids": [257]})
    assert error["code"] == "invalid_token_id" and error["token_id"] == 257
    assert w.request({"op": "detokenize", "id": 4, "ids": "x"})["code"] == "invalid_request"


def test_fim_tokens_are_reported_and_accepted_as_ids(fake):
    assert fake().ready["special_tokens"]["fim_pre_id"] is None
    w = fake("--fim-tokens")
    special = w.ready["special_tokens"]
    assert (special["fim_pre_id"], special["fim_suf_id"], special["fim_mid_id"]) == (257, 258, 259)
    assert w.ready["n_vocab"] == 260
    assert w.request({"op": "detokenize", "id": 1, "ids": [257, 97, 259]})["text"] == \
        "<fim_prefix>a<fim_middle>"
    text, done = w.generate(2, prompt_segments=[{"ids": [257]}, {"text": "ab"}, {"ids": [258, 259]}])
    assert "".join(text) == "ab" and done["prompt_tokens"] == 5  # the echo skips the control tokens


def test_sessions_and_warm_resume(fake, script_file):
    w = fake("--script", script_file(["ok"]), "--capacity", "3")
    assert w.request({"op": "session_open", "id": 1, "session_id": "a"})["type"] == "ack"
    assert w.request({"op": "session_open", "id": 2, "session_id": "a"})["type"] == "ack"  # no-op
    _, d1 = w.generate(3, prompt="hello", session_id="a")
    assert d1["session_id"] == "a" and d1["reused_prompt_tokens"] == 0
    # The next turn extends prompt + output: only the suffix is prefilled.
    _, d2 = w.generate(4, prompt="hellook, more", session_id="a")
    assert d2["reused_prompt_tokens"] == 7 and d2["prefilled_prompt_tokens"] == 6
    # A diverging prompt trims to the common prefix.
    _, d3 = w.generate(5, prompt="help", session_id="a")
    assert d3["reused_prompt_tokens"] == 3
    # Implicit open of a second named session fills the last bindable slot (capacity - 1);
    # a third evicts the least recently used idle session (a), whose state is spilled.
    _, d4 = w.generate(6, prompt="z", session_id="b")
    assert d4["type"] == "done"
    _, d5 = w.generate(7, prompt="z", session_id="c")
    assert d5["type"] == "done" and d5["reused_prompt_tokens"] == 0
    # a comes back (evicting b): its spilled state is restored, not prefilled again.
    _, d6 = w.generate(8, prompt="helpok more", session_id="a")
    assert d6["prefill_plan"] == "restored"
    assert d6["reused_prompt_tokens"] == d6["restored_prompt_tokens"] == len("helpok")
    close = w.request({"op": "session_close", "id": 9, "session_id": "c"})
    assert close["type"] == "ack" and close["found"] is True
    assert w.request({"op": "session_close", "id": 10, "session_id": "c"})["found"] is False  # idempotent
    assert w.request({"op": "session_close", "id": 11, "session_id": "b"})["found"] is True  # spilled
    _, d7 = w.generate(12, prompt="z", session_id="b")
    assert d7["prefill_plan"] != "restored"  # closed: its spilled copy went too
    assert w.request({"op": "session_reset", "id": 13, "session_id": "a"})["op"] == "session_reset"
    _, d8 = w.generate(14, prompt="hello", session_id="a")
    assert d8["reused_prompt_tokens"] == 0


def test_evicted_session_without_spill_budget_prefills_again(fake, script_file):
    w = fake("--script", script_file(["ok"]), "--capacity", "2", "--spill-budget-bytes", "0")
    _, d1 = w.generate(1, prompt="first session", session_id="a")
    _, d2 = w.generate(2, prompt="second", session_id="b")  # evicts a: dropped, nothing spilled
    assert d2["type"] == "done"
    _, d3 = w.generate(3, prompt="first sessionok", session_id="a")
    assert d3["prefill_plan"] != "restored" and "restored_prompt_tokens" not in d3


def test_spill_budget_drops_short_retention_first(fake, script_file):
    # capacity 2 = one bindable slot: every new session evicts the previous one. Each spilled
    # state is 4 bytes per token; the budget holds two 20-token sessions, not three.
    w = fake("--script", script_file(["ok"]), "--capacity", "2", "--spill-budget-bytes", str(2 * 4 * 22))
    w.generate(1, prompt="L" * 20, session_id="long", retention="long")
    w.generate(2, prompt="S" * 20, session_id="short1")  # spills long
    w.generate(3, prompt="T" * 20, session_id="short2")  # spills short1
    w.generate(4, prompt="U" * 20, session_id="short3")  # spills short2: short1 dropped, not long
    _, dl = w.generate(5, prompt="L" * 20 + "ok!", session_id="long")
    assert dl["prefill_plan"] == "restored"
    _, d1 = w.generate(6, prompt="S" * 20 + "ok!", session_id="short1")
    assert d1["prefill_plan"] != "restored"


def test_bad_retention_is_invalid_request(fake):
    w = fake()
    _, err = w.generate(1, prompt="x", session_id="a", retention="forever")
    assert err["code"] == "invalid_request" and "retention" in err["message"]


def test_capacity_one_has_no_named_sessions(fake):
    w = fake("--capacity", "1")
    assert w.request({"op": "session_open", "id": 1, "session_id": "a"})["code"] == "unsupported_session"
    _, err = w.generate(2, prompt="x", session_id="a")
    assert err["code"] == "unsupported_session"
    _, done = w.generate(3, prompt="x")
    assert done["type"] == "done"


def test_cancel_mid_decode_then_session_is_correct(fake, script_file):
    w = fake("--script", script_file(["abcdefghijklmnopqrstuvwxyz" * 4]), "--token-delay-ms", "5")
    w.send({"op": "generate", "id": 1, "prompt": "p", "session_id": "s"})
    first = w.record()
    assert first["type"] == "token"
    w.cancel(1)
    texts, done = w.collect(1)
    assert done["type"] == "done" and done["cancelled"] is True and done["finish_reason"] == "stop"
    assert "generated_token_ids" not in done
    assert done["completion_tokens"] < 104
    # The slot stays exact (spec §7): the prompt and the tokens decoded before the cancel are
    # resident, so a next turn that sends them back prefills only what is new.
    said = "".join(texts)
    texts, done = w.generate(2, prompt="p" + said + " more", session_id="s")
    assert done["cancelled"] is False and done["prefill_plan"] != "dirty", done
    assert len(said) <= done["reused_prompt_tokens"] <= len(said) + 1, done
    assert "".join(texts) == "abcdefghijklmnopqrstuvwxyz" * 4


def test_cancel_mid_prefill(fake):
    w = fake("--prefill-ms-per-token", "2", "--prefill-chunk", "64")
    prompt = "word " * 400  # 2,000 tokens: ~4 s of prefill if not cancelled
    w.send({"op": "generate", "id": 1, "prompt": prompt, "session_id": "s"})
    time.sleep(0.1)
    w.cancel(1)
    texts, done = w.collect(1)
    assert texts == [] and done["cancelled"] is True and done["completion_tokens"] == 0
    assert done["prefill_ms"] < 3000  # cancelled inside the prefill, not after it
    # What was prefilled before the cancel stays resident (spec §7), never a dirty slot: the
    # same prompt sent again goes on from there (how far depends on when the cancel came).
    _, again = w.generate(2, prompt=prompt, session_id="s", max_new_tokens=1)
    assert again["prefill_plan"] in ("new", "exact_prefix"), again
    assert again["reused_prompt_tokens"] < len(prompt) and again["cancelled"] is False
    texts, done = w.generate(3, prompt="again", session_id="s")
    assert "".join(texts) == "again" and done["type"] == "done"


def test_latched_cancel_and_stale_cancel(fake):
    w = fake()
    w.cancel(5)  # before request 5 exists: latched
    texts, done = w.generate(5, prompt="abc")
    assert texts == [] and done["cancelled"] is True
    w.cancel(5)  # stale: 5 finished
    w.cancel(3)  # stale: older
    texts, done = w.generate(6, prompt="abc")
    assert "".join(texts) == "abc" and done["cancelled"] is False


def test_latched_cancel_for_later_id_survives_earlier_request(fake):
    w = fake()
    w.cancel(3)
    _, d1 = w.generate(2, prompt="abc")
    assert d1["cancelled"] is False
    _, d2 = w.generate(3, prompt="abc")
    assert d2["cancelled"] is True


def test_cancel_after_done_changes_nothing(fake):
    w = fake()
    texts, done = w.generate(1, prompt="abc")
    w.cancel(1)
    assert done["cancelled"] is False
    assert w.request({"op": "ping", "id": 2}) == {"type": "pong", "id": 2}


def test_stale_generate_id_rejected(fake):
    w = fake()
    w.generate(5, prompt="a")
    _, err = w.generate(5, prompt="a")
    assert err["code"] == "invalid_request" and "stale" in err["message"]
    _, err = w.generate(4, prompt="a")
    assert err["code"] == "invalid_request"
    _, done = w.generate(6, prompt="a")
    assert done["type"] == "done"


def test_stdin_eof_exits_now(fake):
    w = fake()
    assert w.close() == 0


def test_stdin_eof_mid_generation_exits(fake, script_file):
    w = fake("--script", script_file(["x" * 1000]), "--token-delay-ms", "10")
    w.send({"op": "generate", "id": 1, "prompt": "p"})
    assert w.record()["type"] == "token"
    w.proc.stdin.close()
    assert w.proc.wait(10) == 0


def test_cancel_pipe_eof_exits(fake):
    w = fake()
    os.close(w.cancel_w)
    w.cancel_w = None
    assert w.proc.wait(10) == 0


def test_shutdown(fake):
    w = fake()
    assert w.request({"op": "shutdown", "id": 1}) == {"type": "ack", "id": 1, "op": "shutdown"}
    assert w.proc.wait(10) == 0


def test_seeded_requests_accept_sampling_params(fake):
    w = fake()
    _, done = w.generate(1, prompt="ab", temperature=0.7, top_p=0.9, top_k=40, seed=1234)
    assert done["type"] == "done"
    _, done = w.generate(2, prompt="ab", seed=None)
    assert done["type"] == "done"


def test_stop_string_cut_keeps_session_warm(fake, script_file):
    w = fake("--script", script_file(["Hi!<END>secret", "next"]))
    texts, d1 = w.generate(1, prompt="Q1:", stop=["<END>"], session_id="s")
    assert "".join(texts) == "Hi!" and d1["stop_string"] == "<END>"
    # The client continues from the text it saw; resident tokens beyond it are trimmed away.
    texts, d2 = w.generate(2, prompt="Q1:Hi! Q2:", session_id="s")
    assert d2["prefill_plan"] == "trimmed" and d2["reused_prompt_tokens"] == len("Q1:Hi!")
    assert "".join(texts) == "next"


def test_equal_prompt_reuses_all_but_one(fake):
    w = fake()
    w.generate(1, prompt="abcdef", session_id="s", max_new_tokens=1)
    _, d = w.generate(2, prompt="abcdef", session_id="s", max_new_tokens=1)
    assert d["reused_prompt_tokens"] == 5 and d["prefilled_prompt_tokens"] == 1


def test_eos_first_gives_empty_ids(fake, script_file):
    w = fake("--script", script_file([""]))
    texts, done = w.generate(1, prompt="x")
    assert texts == [] and done["completion_tokens"] == 0 and done["generated_token_ids"] == []
    assert done["finish_reason"] == "stop"


def test_cancel_frames_split_across_writes(fake, script_file):
    w = fake("--script", script_file(["abcdefghij" * 20]), "--token-delay-ms", "5")
    w.send({"op": "generate", "id": 258, "prompt": "p"})
    assert w.record()["type"] == "token"
    frame = (258).to_bytes(8, "little")
    os.write(w.cancel_w, frame[:3])  # a torn frame is reassembled
    time.sleep(0.02)
    os.write(w.cancel_w, frame[3:])
    _, done = w.collect(258)
    assert done["cancelled"] is True
