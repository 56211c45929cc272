"""Shared prefixes across slots and the spill store, on the fake worker (spec §6.2).

A generate whose own slot holds less of its prompt than another slot or a spilled session
starts from a copy of that state, trimmed to the shared prefix. The fake engine models the
copy exactly (its state is the token ids) and, with ``--echo-digest``, echoes a digest of the
slot's WHOLE state: an output equal to a cold worker's proves the slot held exactly the prompt
(nothing of the source past the divergence, nothing missing).
"""

from __future__ import annotations

SYS = "You are a careful assistant. Answer briefly and cite the files you read. " * 4
OTHER = "Unrelated instructions for a different agent entirely, nothing in common. " * 3


def _gen(rid: int, prompt: str, **fields):
    return {"op": "generate", "id": rid, "prompt": prompt, **fields}


def _cold(fake, prompt: str, *flags: str) -> str:
    """The echo of `prompt` on a fresh worker (nothing to share)."""
    w = fake("--echo-digest", *flags)
    texts, done = w.generate(1, prompt=prompt)
    assert done["type"] == "done" and "copied_prompt_tokens" not in done, done
    w.close()
    return "".join(texts)


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_new_session_and_anonymous_start_from_another_slots_prefix(fake):
    w = fake("--echo-digest")
    assert w.ready["capabilities"]["prefix_sharing"] is True
    assert w.ready["min_shared_prefix"] == 16
    pa, pb, pn = SYS + "user a: list files", SYS + "user b: fix the bug", SYS + "anon: hello"
    _, da = w.generate(1, prompt=pa, session_id="a")
    assert da["prefill_plan"] == "new" and da["reused_prompt_tokens"] == 0
    tb, db = w.generate(2, prompt=pb, session_id="b")
    shared = _common(pa, pb)
    assert db["prefill_plan"] == "copied" and db["copy_source"] == "slot"
    assert db["reused_prompt_tokens"] == db["copied_prompt_tokens"] == shared
    assert db["prefilled_prompt_tokens"] == len(pb) - shared
    assert db["copy_ms"] >= 0
    tn, dn = w.generate(3, prompt=pn)  # anonymous: an empty unbound slot, filled by a copy
    assert dn["prefill_plan"] == "copied" and dn["copied_prompt_tokens"] == _common(pn, pa)
    # Isolation: each output equals a cold run's (the digest covers the whole slot state).
    assert "".join(tb) == _cold(fake, pb)
    assert "".join(tn) == _cold(fake, pn)
    # The source session is unaffected: its next turn still extends its own slot.
    ta, da2 = w.generate(4, prompt=pa + " more", session_id="a")
    assert da2["prefill_plan"] == "trimmed" and da2["reused_prompt_tokens"] == len(pa)
    assert "".join(ta) == _cold(fake, pa + " more")


def test_returning_session_starts_from_another_slot_when_its_own_state_is_gone(fake):
    # capacity 4 = 3 bindable; no spill budget: an evicted session's state is dropped.
    w = fake("--echo-digest", "--capacity", "4", "--spill-budget-bytes", "0")
    pa = SYS + "user a: first turn"
    w.generate(1, prompt=pa, session_id="a")
    w.generate(2, prompt=OTHER + "b", session_id="b")
    w.generate(3, prompt=OTHER + "c", session_id="c")
    _, dd = w.generate(4, prompt=SYS + "user d", session_id="d")  # evicts a (dropped)
    assert dd["type"] == "done"
    # a returns: it evicts b (least recently used; b's slot holds nothing of a's prompt), but
    # d's slot holds the system prompt: a starts from it.
    back = pa + "ok, second turn"
    texts, d = w.generate(5, prompt=back, session_id="a")
    assert d["prefill_plan"] == "copied" and d["copy_source"] == "slot"
    assert d["copied_prompt_tokens"] == _common(back, SYS + "user d")
    assert "".join(texts) == _cold(fake, back)


def test_new_session_starts_from_a_spilled_state_and_the_owner_still_restores(fake):
    # capacity 2 = one bindable slot: every new session evicts the previous one (spilled).
    w = fake("--echo-digest", "--capacity", "2")
    pa = SYS + "user a"
    w.generate(1, prompt=pa, session_id="a")
    w.generate(2, prompt=OTHER, session_id="c")   # evicts a: spilled
    pb = SYS + "user b: something else"
    texts, db = w.generate(3, prompt=pb, session_id="b")  # evicts c; a's spilled state holds SYS
    assert db["prefill_plan"] == "copied" and db["copy_source"] == "spill"
    assert db["copied_prompt_tokens"] == _common(pa, pb)
    assert "".join(texts) == _cold(fake, pb)
    # The spilled entry was copied, not taken: a still restores all of its own state.
    back = pa + " and more"
    texts, da = w.generate(4, prompt=back, session_id="a")
    assert da["prefill_plan"] == "restored" and da["restored_prompt_tokens"] == len(pa)
    assert "".join(texts) == _cold(fake, back)


def test_source_evicted_by_the_next_request_in_the_same_batch(fake):
    # Four requests read in one write are admitted before any step: the first copies a's
    # state; the last evicts a and prefills its own prompt into a's old slot. The copy is
    # complete at admission, so the copier's state is not disturbed.
    w = fake("--echo-digest", "--capacity", "4", "--token-delay-ms", "1")
    pa = SYS + "user a"
    w.generate(1, prompt=pa, session_id="a")
    px = SYS + "anonymous x"
    w.send_many([_gen(2, px), _gen(3, OTHER + "1", session_id="n1"), _gen(4, OTHER + "2", session_id="n2"),
                 _gen(5, OTHER + "3", session_id="n3")])
    res = w.collect_many([2, 3, 4, 5])
    texts, dx = res[2]
    assert dx["prefill_plan"] == "copied" and dx["copied_prompt_tokens"] == _common(pa, px)
    assert res[5][1]["type"] == "done"  # n3 took a's slot (a evicted and spilled)
    assert "".join(texts) == _cold(fake, px)
    # a comes back from the spill store intact.
    texts, da = w.generate(6, prompt=pa + " again", session_id="a")
    assert da["prefill_plan"] in ("restored", "copied")
    assert "".join(texts) == _cold(fake, pa + " again")


def test_source_cancelled_mid_prefill_after_the_copy(fake):
    # a prefills a long prompt in chunks; c decodes beside it, so each of c's tokens marks a
    # finished step. After two of them b arrives and copies what a's slot holds so far; then a
    # is cancelled. b is unaffected.
    w = fake("--echo-digest", "--prefill-ms-per-token", "1", "--batch-tokens", "64", "--prefill-chunk", "64")
    long_sys = SYS * 6  # ~1,800 tokens: ~1.8 s of prefill
    # c first: prefill chunks go FIFO, so c's one-token prompt is in the first step.
    w.send_many([_gen(1, "c"), _gen(2, long_sys + "user a", session_id="a")])
    seen = 0
    while seen < 2:
        rec = w.record()
        assert rec["id"] == 1 and rec["type"] == "token", rec
        seen += 1
    pb = long_sys + "user b"
    # b, then a ping: its pong means b was admitted (lines are handled in order).
    w.send_many([_gen(3, pb, session_id="b"), {"op": "ping", "id": 4}])
    while (rec := w.record())["type"] != "pong":
        assert rec["id"] == 1 and rec["type"] == "token", rec
    w.cancel(2)
    res = w.collect_many([1, 2, 3], timeout=60)
    assert res[2][1]["cancelled"] is True
    texts, db = res[3]
    assert db["prefill_plan"] == "copied" and 16 <= db["copied_prompt_tokens"] < len(long_sys)
    assert "".join(texts) == _cold(fake, pb)


def test_recurrent_state_is_shared_only_whole(fake):
    # A recurrent model cannot cut a state back: a state is a usable source only when all of
    # it is a prefix of the prompt (spec §6.2).
    w = fake("--echo-digest", "--recurrent")
    assert w.ready["capabilities"]["supports_truncate"] is False
    pa = SYS + "user a"
    w.generate(1, prompt=pa, session_id="a")
    pb = SYS + "user b"
    texts, db = w.generate(2, prompt=pb, session_id="b")  # a's state runs past the divergence
    assert db["prefill_plan"] == "new" and db["reused_prompt_tokens"] == 0
    assert "".join(texts) == _cold(fake, pb, "--recurrent")
    # An anonymous request that extends a's whole state (prompt + echoed answer: generation
    # ended by EOS, which is never fed back) starts from a copy of it.
    resident_a = pa + "".join(w.generate(3, prompt=pa, session_id="a")[0])
    pn = resident_a + "Xnext"
    texts, dn = w.generate(4, prompt=pn)
    assert dn["prefill_plan"] == "copied" and dn["copied_prompt_tokens"] == len(resident_a)
    assert "".join(texts) == _cold(fake, pn, "--recurrent")


def test_min_shared_prefix_zero_turns_sharing_off(fake):
    w = fake("--echo-digest", "--min-shared-prefix", "0")
    assert w.ready["capabilities"]["prefix_sharing"] is False
    w.generate(1, prompt=SYS + "a", session_id="a")
    _, db = w.generate(2, prompt=SYS + "b", session_id="b")
    assert db["prefill_plan"] == "new" and db["reused_prompt_tokens"] == 0


def test_short_common_prefix_is_not_copied(fake):
    w = fake("--echo-digest", "--min-shared-prefix", "32")
    w.generate(1, prompt="0123456789" * 2 + "tail a", session_id="a")  # 20 shared < 32
    _, db = w.generate(2, prompt="0123456789" * 2 + "tail b", session_id="b")
    assert db["prefill_plan"] == "new"


def test_a_burst_prefills_a_shared_prefix_once(fake):
    # Four sessions with the same system prompt arrive together: the first prefills it, the
    # other three wait for that prefill and start from a copy (spec §6.2 "in-flight prefixes").
    w = fake("--echo-digest", "--prefill-ms-per-token", "0.2", "--batch-tokens", "128", "--prefill-chunk", "128")
    prompts = {i: SYS + f"question {i}: " + "detail " * i for i in range(1, 5)}
    w.send_many([_gen(i, p, session_id=f"s{i}") for i, p in prompts.items() if i < 4] + [_gen(4, prompts[4])])
    res = w.collect_many(list(prompts), timeout=60)
    first = res[1][1]
    assert first["prefill_plan"] == "new" and first["prefilled_prompt_tokens"] == len(prompts[1])
    for i in (2, 3, 4):
        texts, done = res[i]
        assert done["prefill_plan"] == "copied" and done["copy_waited"] is True, done
        assert done["copied_prompt_tokens"] == _common(prompts[1], prompts[i])
        assert done["prefilled_prompt_tokens"] == len(prompts[i]) - done["copied_prompt_tokens"]
        assert "".join(texts) == _cold(fake, prompts[i])


def test_a_burst_on_a_recurrent_model_waits_for_the_checkpoint_at_the_mark(fake):
    """The same burst on a state that cannot be cut back (hybrid, recurrent): the first prefills
    the system prompt and takes a checkpoint at the control plane's mark where it ends; the
    other three wait for that checkpoint and start from it (spec §6.3), instead of prefilling
    the system prompt four times beside each other."""
    w = fake("--echo-digest", "--recurrent", "--prefill-ms-per-token", "0.2", "--batch-tokens", "128",
             "--prefill-chunk", "128")
    prompts = {i: SYS + f"question {i}: " + "detail " * i for i in range(1, 5)}
    w.send_many([{"op": "generate", "id": i, **({"session_id": f"s{i}"} if i < 4 else {}),
                  "prompt_segments": [{"text": SYS, "checkpoint": True}, {"text": p[len(SYS):]}]}
                 for i, p in prompts.items()])
    res = w.collect_many(list(prompts), timeout=60)
    assert res[1][1]["prefill_plan"] == "new" and res[1][1]["prefilled_prompt_tokens"] == len(prompts[1])
    for i in (2, 3, 4):
        texts, done = res[i]
        assert done["copy_waited"] is True and done["copy_source"] == "checkpoint", done
        assert done["reused_prompt_tokens"] == len(SYS)
        assert done["prefilled_prompt_tokens"] == len(prompts[i]) - len(SYS)
        assert "".join(texts) == _cold(fake, prompts[i], "--recurrent")


def test_waiters_go_on_when_the_prefill_they_wait_for_is_cancelled(fake):
    w = fake("--echo-digest", "--prefill-ms-per-token", "1", "--batch-tokens", "64", "--prefill-chunk", "64")
    long_sys = SYS * 4
    pa, pb = long_sys + "user a", long_sys + "user b"
    w.send_many([_gen(1, pa, session_id="a"), _gen(2, pb, session_id="b")])  # b waits for a
    w.cancel(1)
    res = w.collect_many([1, 2], timeout=60)
    assert res[1][1]["cancelled"] is True
    texts, db = res[2]
    assert db["type"] == "done" and db["prefill_plan"] in ("new", "copied")
    assert "".join(texts) == _cold(fake, pb)
