"""Sliding-window models: the window cache and checkpoints, on the fake worker (spec §6.3).

``--swa N`` makes the fake model a sliding-window model. With the small window cache
(``--swa-cache checkpoints``) a slot holds only its last N positions after each step, so it can
be cut back only that far; the worker saves a checkpoint of the window at the end of every
prompt's prefill (a turn boundary) and brings an older position back from it. With
``--echo-digest`` the echo starts with a digest of the slot's WHOLE state, so an output equal
to a cold worker's proves the slot held exactly the prompt.
"""

from __future__ import annotations

import pytest

from testkit.worker_process import gemma_path

from .session_turns import cold_echo, session_turn

SYS = "You are a careful assistant. Answer briefly and cite the files you read. " * 3
WINDOW = 16
SWA = ("--echo-digest", "--swa", str(WINDOW), "--swa-cache", "checkpoints")


def _cold(fake, prompt: str) -> str:
    return cold_echo(fake, SWA, prompt)


_turn = session_turn


def test_ready_record_reports_the_window_cache(fake):
    w = fake(*SWA, "--swa-checkpoints", "3")
    assert w.ready["n_swa"] == WINDOW and w.ready["swa_cache"] == "checkpoints"
    assert w.ready["checkpoints_per_slot"] == 3
    full = fake("--swa", str(WINDOW), "--swa-cache", "full")
    assert full.ready["swa_cache"] == "full" and full.ready["checkpoints_per_slot"] == 0
    # The small window cache costs less KV memory than the full-size one.
    assert w.ready["kv_cache_bytes"] < full.ready["kv_cache_bytes"]
    plain = fake()
    assert plain.ready["n_swa"] == 0 and plain.ready["swa_cache"] is None
    assert plain.ready["checkpoints_per_slot"] == 0


def test_auto_keeps_the_full_cache_only_when_it_fits_the_budget(fake):
    # The fake's full-size cache: 4 bytes a token x --ctx x --capacity = 4 x 1024 x 4.
    fits = fake("--swa", "8", "--ctx", "1024", "--kv-budget-bytes", str(4 * 1024 * 4))
    assert fits.ready["swa_cache"] == "full"
    short = fake("--swa", "8", "--ctx", "1024", "--kv-budget-bytes", str(4 * 1024 * 4 - 1))
    assert short.ready["swa_cache"] == "checkpoints" and short.ready["checkpoints_per_slot"] == 4


def test_an_edit_inside_the_window_is_a_plain_truncation(fake):
    w = fake(*SWA)
    p1 = SYS + "user: list the files"
    _turn(w, 1, p1, max_new_tokens=2)  # the window ends 1-2 tokens past the prompt
    p2 = p1[:-6] + "read the files"  # diverges 6 tokens back: inside the window
    out, d = _turn(w, 2, p2)
    assert d["prefill_plan"] == "trimmed" and d["reused_prompt_tokens"] == len(p1) - 6
    assert "checkpoint_ms" not in d
    assert out == _cold(fake, p2)


def test_a_divergence_before_the_window_restores_a_checkpoint(fake):
    w = fake(*SWA)
    p1 = SYS + "user: list the files"
    out1, d1 = _turn(w, 1, p1)
    assert len(out1) > WINDOW  # the answer pushed the window past the end of the prompt
    # The client re-sends the conversation with the assistant's answer rewritten: the prompt
    # diverges right after p1, which the window no longer reaches.
    p2 = p1 + "[answer rewritten by the client] user: and now?"
    out2, d2 = _turn(w, 2, p2)
    assert d2["prefill_plan"] == "checkpoint"
    assert d2["reused_prompt_tokens"] == len(p1)  # from the checkpoint at p1's end, not from zero
    assert d2["prefilled_prompt_tokens"] == len(p2) - len(p1)
    assert d2["checkpoint_ms"] >= 0
    assert out2 == _cold(fake, p2)


def test_the_newest_checkpoint_at_or_before_the_divergence_is_used(fake):
    w = fake(*SWA)
    p1 = SYS + "user: first"
    out1, _ = _turn(w, 1, p1)
    p2 = p1 + out1 + "user: second question, a longer one"
    out2, d2 = _turn(w, 2, p2)
    assert d2["prefill_plan"] in ("exact_prefix", "trimmed")  # the window reaches the end
    # Turn 3 edits turn 2's user message: it diverges between the checkpoints at p1's and p2's
    # ends, so the one at p1's end is restored.
    p3 = p1 + out1 + "user: second question, edited"
    out3, d3 = _turn(w, 3, p3)
    assert d3["prefill_plan"] == "checkpoint" and d3["reused_prompt_tokens"] == len(p1)
    assert out3 == _cold(fake, p3)
    # The checkpoint at p2's end was dropped (the slot diverged before it); p1's still serves.
    p4 = p1 + "user: another branch"
    _, d4 = _turn(w, 4, p4)
    assert d4["prefill_plan"] == "checkpoint" and d4["reused_prompt_tokens"] == len(p1)


def test_without_a_checkpoint_the_prompt_is_prefilled_from_zero(fake):
    w = fake(*SWA, "--swa-checkpoints", "0")
    assert w.ready["checkpoints_per_slot"] == 0
    p1 = SYS + "user: list the files"
    _turn(w, 1, p1)
    p2 = p1 + "[answer rewritten] user: and now?"
    out2, d2 = _turn(w, 2, p2)
    assert d2["prefill_plan"] == "mismatch" and d2["reused_prompt_tokens"] == 0
    assert out2 == _cold(fake, p2)


def test_beyond_the_bound_the_oldest_checkpoint_goes_but_the_shortest_stays(fake):
    """Three turns take three checkpoints (each prompt's end). With room for two, the one at p2's
    end goes and p1's — the shortest, where other prompts of this slot leave it (a system
    prompt's end, spec §6.3) — stays: an edit of turn 3's message then resumes from p1."""
    def three_turns(w) -> tuple[str, str, str]:
        p1 = SYS + "user: one"
        o1, _ = _turn(w, 1, p1)
        p2 = p1 + o1 + "user: two"
        o2, _ = _turn(w, 2, p2)
        p3 = p2 + o2 + "user: three"
        _turn(w, 3, p3)
        return p1, p2, p2 + o2 + "user: THREE"

    kept = fake(*SWA, "--swa-checkpoints", "3")
    p1, p2, edit = three_turns(kept)
    out, d = _turn(kept, 4, edit)
    assert d["prefill_plan"] == "checkpoint" and d["reused_prompt_tokens"] == len(p2)
    assert out == _cold(fake, edit)

    evicted = fake(*SWA, "--swa-checkpoints", "2")  # the checkpoint at p2's end was dropped
    p1, p2, edit = three_turns(evicted)
    out, d = _turn(evicted, 4, edit)
    assert d["prefill_plan"] == "checkpoint" and d["reused_prompt_tokens"] == len(p1)
    assert out == _cold(fake, edit)


def test_the_full_size_window_cache_truncates_anywhere(fake):
    w = fake("--echo-digest", "--swa", str(WINDOW), "--swa-cache", "full")
    p1 = SYS + "user: list the files"
    _turn(w, 1, p1)
    p2 = SYS + "user: something else"
    out, d = _turn(w, 2, p2)
    assert d["prefill_plan"] == "trimmed" and d["reused_prompt_tokens"] == len(SYS) + len("user: ")
    assert out == _cold(fake, p2)


def test_another_slots_slid_state_is_shared_only_whole(fake):
    # A copy would have to be cut back to the shared prefix, which the source's window no
    # longer reaches (and its checkpoints stay with its slot): a new session sharing only the
    # system prompt prefills it. A prompt extending the source's WHOLE state copies it.
    w = fake(*SWA)
    pa = SYS + "user a"
    outa, _ = w.generate(1, prompt=pa, session_id="a")
    pb = SYS + "user b"
    texts, db = w.generate(2, prompt=pb, session_id="b")
    assert db["prefill_plan"] == "new" and db["reused_prompt_tokens"] == 0
    assert "".join(texts) == _cold(fake, pb)
    fork = pa + "".join(outa) + "user: a sub-agent's task"
    texts, df = w.generate(3, prompt=fork)
    assert df["prefill_plan"] == "copied" and df["copied_prompt_tokens"] == len(pa) + len("".join(outa))
    assert "".join(texts) == _cold(fake, fork)
    # Within the source's window a copy is trimmed as usual.
    near = pa + "".join(outa)[:-4] + "tail"
    texts, dn = w.generate(4, prompt=near)
    assert dn["prefill_plan"] == "copied" and dn["copied_prompt_tokens"] == len(near) - 4
    assert "".join(texts) == _cold(fake, near)


def test_a_spilled_window_state_comes_back_whole(fake):
    # capacity 2 = one bindable slot: b evicts a (spilled with its window), a returns.
    w = fake(*SWA, "--capacity", "2")
    pa = SYS + "user a"
    outa, _ = w.generate(1, prompt=pa, session_id="a")
    w.generate(2, prompt="something unrelated " * 3, session_id="b")
    back = pa + "".join(outa) + "user: next"
    texts, d = w.generate(3, prompt=back, session_id="a")
    assert d["prefill_plan"] == "restored" and d["restored_prompt_tokens"] == len(pa) + len("".join(outa))
    assert "".join(texts) == _cold(fake, back)


@pytest.mark.slow
def test_gemma3_prompt_diverging_before_the_window_restores_a_checkpoint(spawn):
    """The llama.cpp path on a real sliding-window model (Gemma 3 270M of the test extra,
    window 512): with the small window cache, a session's third turn that rewrites the first
    answer diverges where the window no longer reaches after the long second turn; it starts
    from the checkpoint at the end of the first prompt (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) and
    its greedy tokens equal those of a fresh worker that prefills the first prompt and then the
    rest: the same computation. (Not a single-prefill cold run: on this model where a prefill is
    split alone changes the 6th greedy token of this prompt, checkpoints or not — measured.)"""
    flags = ("--model", str(gemma_path()), "--ctx", "2048", "--capacity", "2", "--threads", "2",
             "--batch-tokens", "128", "--prefill-chunk", "128", "--step-target-ms", "0",
             "--cpu-extra-buffers", "off", "--swa-cache", "checkpoints")
    w = spawn("trioserve-llama-worker", *flags)
    assert w.ready["n_swa"] == 512 and w.ready["swa_cache"] == "checkpoints"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    p1 = "List: " + " ".join(f"{words[i % 10]}{i}" for i in range(30)) + "\nQuestion: go on.\nAnswer:"
    o1, d1 = w.generate(1, prompt=p1, session_id="s", max_new_tokens=4)
    # A long second turn: ~900 tokens, more than the window cache holds (512 + a batch, padded).
    p2 = p1 + "".join(o1) + "\nUser: " + " ".join(f"{words[i * 7 % 10]}{i}" for i in range(230)) + "\nAnswer:"
    _, d2 = w.generate(2, prompt=p2, session_id="s", max_new_tokens=4)
    assert d2["prefill_plan"] == "exact_prefix" and d2["prompt_tokens"] > 800
    p3 = p1 + " [rewritten]\nUser: what comes next?\nAnswer:"
    o3, d3 = w.generate(3, prompt=p3, session_id="s", max_new_tokens=8)
    assert d3["prefill_plan"] == "checkpoint", d3  # "trimmed" if the window still held p1's end
    assert d3["reused_prompt_tokens"] == d1["prompt_tokens"]
    assert d3["prefilled_prompt_tokens"] == d3["prompt_tokens"] - d1["prompt_tokens"]
    ref = spawn("trioserve-llama-worker", *flags)
    ref.generate(1, prompt=p1, max_new_tokens=1)  # ends by length: the slot holds exactly p1
    oref, dref = ref.generate(2, prompt=p3, max_new_tokens=8)
    assert dref["prefill_plan"] == "exact_prefix" and dref["reused_prompt_tokens"] == d1["prompt_tokens"]
    assert d3["generated_token_ids"] == dref["generated_token_ids"] and o3 == oref
