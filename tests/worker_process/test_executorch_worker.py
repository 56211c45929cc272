"""Process tests of trioserve-executorch-worker on the committed tiny random Llama .pte.

The prompts are token ids (the control plane tokenizes for this engine; see
trioserve/worker/prompt_encoder.py). Greedy outputs are compared with the ids ExecuTorch's own Python
runtime produced for the same program (tests/data/executorch/expected.json, recorded by
scripts/executorch/export_tiny_pte.py).
"""

from __future__ import annotations

import itertools
import subprocess
import time

import pytest
from tokenizers import Tokenizer

from testkit.worker_process import Worker
from testkit.executorch_assets import PROGRAMS, PTE, TOKENIZER, expected, executorch_worker

N_CTX = 256  # the program's max_context_len


@pytest.fixture(scope="module")
def worker_bin():
    return executorch_worker()


@pytest.fixture(scope="module", params=list(PROGRAMS))
def et(request, worker_bin):
    """A worker on each committed program: every test below runs on plain attention and on the
    fused --use_sdpa_with_kv_cache program (trioserve's llama:: kernels)."""
    w = Worker([str(worker_bin), "--model", str(PROGRAMS[request.param]), "--tokenizer", str(TOKENIZER),
                "--threads", "1", "--capacity", "1"])  # one slot: the warm-resume tests below rely on it
    w.wait_ready(60)
    w.ids = itertools.count(1)
    w.program = request.param
    yield w
    assert w.close() == 0


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(TOKENIZER))


def gen(w, **fields):
    texts, rec = w.generate(next(w.ids), **fields)
    return "".join(texts), rec


def ids_prompt(ids):
    return [{"ids": list(ids)}]


def test_handshake(et):
    r = et.ready
    assert r["engine"] == "executorch" and r["protocol"] == 2
    assert r["capacity"] == 1 and r["n_ctx"] == N_CTX and r["n_vocab"] == expected()["vocab_size"]
    assert r["capabilities"]["supports_cancel"] is True and r["capabilities"]["grammar"] is False
    assert r["capabilities"]["supports_truncate"] is True
    assert r["special_tokens"]["eos"] == "<|im_end|>" and r["special_tokens"]["eos_id"] == expected()["eos_id"]
    assert "<|im_start|>" in r["chat_template"]  # from tokenizer_config.json


def test_links_neither_libtorch_nor_libpython(worker_bin):
    out = subprocess.run(["ldd", str(worker_bin)], capture_output=True, text=True, check=True).stdout
    assert "libexecutorch.so" in out
    assert "libtorch" not in out and "libc10" not in out and "libpython" not in out, out
    assert "not found" not in out, out


@pytest.mark.parametrize("case", range(len(expected()["cases"])))
def test_greedy_ids_equal_executorch_python_runtime(et, tok, case):
    """Exact greedy parity for 32 tokens with ExecuTorch's own Python runtime on the plain
    program, for the plain program and for the fused one (the same function computed by
    trioserve's llama:: kernels); a case whose reference reaches EOS is compared up to it (the
    worker stops there and neither emits nor counts EOS)."""
    c = expected()["cases"][case]
    want = c["greedy_ids"]
    eos = expected()["eos_id"]
    if eos in want:
        want = want[: want.index(eos)]
    text, done = gen(et, prompt_segments=ids_prompt(c["prompt_ids"]), max_new_tokens=len(c["greedy_ids"]))
    assert done["type"] == "done", done
    assert done["generated_token_ids"] == want
    assert done["completion_tokens"] == len(want) and done["prompt_tokens"] == len(c["prompt_ids"])
    assert done["finish_reason"] == ("stop" if len(want) < len(c["greedy_ids"]) else "length")
    # The text is the UTF-8 decoding of the ids' bytes (U+FFFD where the random model emits
    # bytes that are not UTF-8), the same as the tokenizers library's decode.
    assert text == tok.decode(want, skip_special_tokens=False)


def test_a_32_token_case_without_eos_exists():
    """The parity above covers a full 32-token run (not only runs cut short by EOS)."""
    eos = expected()["eos_id"]
    assert any(len(c["greedy_ids"]) == 32 and eos not in c["greedy_ids"] for c in expected()["cases"])


def test_the_fused_program_needs_the_llama_kernels():
    """tiny_sdpa.pte really calls the two operators trioserve implements (so its parity above
    exercises them)."""
    data = PROGRAMS["tiny_sdpa"].read_bytes()
    assert b"llama::custom_sdpa" in data and b"llama::update_cache" in data
    assert b"llama::" not in PROGRAMS["tiny"].read_bytes()


def test_long_prompt_in_chunks_equals_warm_resume_in_pieces(et):
    """A 200-token prompt is 4 forward calls (<= 64 tokens each, growing start_pos: the fused
    attention's causal window at an offset); prefilled cold in one request or warm in three
    requests of a growing prompt, it gives the same continuation."""
    prompt = [10 + (i * 7) % 300 for i in range(200)]
    gen(et, prompt_segments=ids_prompt([3, 4]), max_new_tokens=1)  # another conversation first
    _, cold = gen(et, prompt_segments=ids_prompt(prompt), max_new_tokens=16)
    assert cold["reused_prompt_tokens"] == 0
    gen(et, prompt_segments=ids_prompt([3, 4]), max_new_tokens=1)
    for cut in (70, 150):  # the slot holds prompt[:cut] (+ one generated token, not reused)
        _, d = gen(et, prompt_segments=ids_prompt(prompt[:cut]), max_new_tokens=1)
    _, warm = gen(et, prompt_segments=ids_prompt(prompt), max_new_tokens=16)
    assert warm["reused_prompt_tokens"] == 150
    assert warm["generated_token_ids"] == cold["generated_token_ids"]


def test_warm_resume_continues_the_slot_and_equals_a_cold_run(et):
    c = expected()["cases"][1]
    turn1 = c["prompt_ids"]
    _, d1 = gen(et, prompt_segments=ids_prompt(turn1), max_new_tokens=8)
    follow = [40, 41, 42, 43]
    turn2 = turn1 + d1["generated_token_ids"] + follow
    t2_warm, d2 = gen(et, prompt_segments=ids_prompt(turn2), max_new_tokens=12)
    # Resident: the first prompt and every generated token but the last (never fed back).
    assert d2["prefill_plan"] == "exact_prefix"
    assert d2["reused_prompt_tokens"] == len(turn1) + len(d1["generated_token_ids"]) - 1
    assert d2["prefilled_prompt_tokens"] == len(turn2) - d2["reused_prompt_tokens"]
    # Cold: a prompt with another first token resets the slot; then the same turn-2 prompt in full.
    gen(et, prompt_segments=ids_prompt([5] + turn1[1:]), max_new_tokens=1)
    _, cold_reset = gen(et, prompt_segments=ids_prompt([7, 8, 9]), max_new_tokens=1)
    t2_cold, d3 = gen(et, prompt_segments=ids_prompt(turn2), max_new_tokens=12)
    assert d3["reused_prompt_tokens"] == 0
    assert d3["generated_token_ids"] == d2["generated_token_ids"] and t2_cold == t2_warm


def test_stop_string_cuts_and_keeps_the_slot_exact(et, tok):
    c = expected()["cases"][1]
    _, full = gen(et, prompt_segments=ids_prompt(c["prompt_ids"]), max_new_tokens=16)
    text = tok.decode(full["generated_token_ids"])
    stop = text[len(text) // 2:][:3]
    cut, done = gen(et, prompt_segments=ids_prompt(c["prompt_ids"]), max_new_tokens=16, stop=[stop])
    assert done["finish_reason"] == "stop" and stop not in cut and text.startswith(cut)
    assert "generated_token_ids" not in done


def test_text_prompt_is_a_clear_error_not_a_crash(et):
    """This worker takes ids only; text (a misconfigured parent) fails that request alone."""
    _, rec = gen(et, prompt="hello", max_new_tokens=4)
    assert rec["type"] == "error" and rec["code"] == "engine_error" and "tokeniz" in rec["message"]
    _, ok = gen(et, prompt_segments=ids_prompt([10, 11, 12]), max_new_tokens=2)
    assert ok["type"] == "done"


def test_bad_ids_and_context(et):
    _, rec = gen(et, prompt_segments=ids_prompt([1, 384]), max_new_tokens=2)
    assert rec["code"] == "invalid_token_id" and rec["token_id"] == 384
    _, rec = gen(et, prompt_segments=ids_prompt([10] * N_CTX), max_new_tokens=2)
    assert rec["code"] == "context_length_exceeded" and rec["n_ctx"] == N_CTX
    _, rec = gen(et, prompt_segments=ids_prompt([]), max_new_tokens=2)
    assert rec["code"] == "empty_prompt"
    # A prompt that leaves little room is clamped to the context, not overrun.
    _, done = gen(et, prompt_segments=ids_prompt([10] * (N_CTX - 3)), max_new_tokens=50)
    assert done["type"] == "done" and done["completion_tokens"] <= 3


def test_named_sessions_are_unsupported_with_one_slot(et):
    rec = et.request({"op": "session_open", "id": next(et.ids), "session_id": "s1"})
    assert rec["type"] == "error" and rec["code"] == "unsupported_session"


def _delayed(worker_bin, delay_ms):
    w = Worker([str(worker_bin), "--model", str(PTE), "--tokenizer", str(TOKENIZER), "--threads", "1",
                "--capacity", "1", "--test-step-delay-ms", str(delay_ms)])
    w.wait_ready(60)
    return w


def test_cancel_mid_decode_frees_the_worker_within_a_step(worker_bin):
    w = _delayed(worker_bin, 40)  # 40 ms per forward call
    try:
        w.send({"op": "generate", "id": 1, "prompt_segments": ids_prompt([10, 11, 12]), "max_new_tokens": 200})
        for _ in range(3):
            assert w.record()["type"] == "token"
        t0 = time.monotonic()
        w.cancel(1)
        _, done = w.collect(1)
        elapsed = time.monotonic() - t0
        assert done["type"] == "done" and done.get("cancelled") is True and done["finish_reason"] == "stop"
        assert done["completion_tokens"] < 200 and "generated_token_ids" not in done
        assert elapsed < 5.0  # a generous bound on a shared CPU: a step is ~40 ms, 200 steps ~8 s
        # The worker is free and its slot is usable.
        _, ok = w.generate(2, prompt_segments=ids_prompt([10, 11]), max_new_tokens=2)
        assert ok["type"] == "done" and ok["completion_tokens"] == 2
    finally:
        assert w.close() == 0


def test_cancel_inside_a_long_prefill(worker_bin):
    """A 250-token prompt is 4 forward calls of <= 64 tokens; the abort is checked before each,
    so the cancel lands inside the prefill and nothing of it stays resident."""
    w = _delayed(worker_bin, 400)
    try:
        prompt = [10 + (i % 300) for i in range(250)]
        w.send({"op": "generate", "id": 1, "prompt_segments": ids_prompt(prompt), "max_new_tokens": 4})
        time.sleep(0.6)  # inside the second forward call
        t0 = time.monotonic()
        w.cancel(1)
        texts, done = w.collect(1)
        assert time.monotonic() - t0 < 3.0
        assert texts == [] and done.get("cancelled") is True and done["completion_tokens"] == 0
        assert done["prompt_tokens"] == 250
        # The slot was rolled back (dirty): the next request prefills its prompt in full.
        _, nxt = w.generate(2, prompt_segments=ids_prompt(prompt[:3]), max_new_tokens=1)
        assert nxt["type"] == "done" and nxt["reused_prompt_tokens"] == 0
    finally:
        assert w.close() == 0


def test_startup_errors(worker_bin):
    def run(*flags):
        return subprocess.run([str(worker_bin), *flags], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)

    r = run("--model", str(PTE), "--tokenizer", str(TOKENIZER), "--capacity", "0")
    assert r.returncode == 2 and "--capacity" in r.stderr and r.stdout == ""
    r = run("--model", str(PTE))
    assert r.returncode == 2 and "--tokenizer is required" in r.stderr
    r = run("--model", str(TOKENIZER), "--tokenizer", str(TOKENIZER))  # not a program
    assert r.returncode == 1 and "failed to load the ExecuTorch program" in r.stderr and r.stdout == ""
    r = run("--model", str(PTE), "--tokenizer", str(PTE))  # not JSON
    assert r.returncode == 1 and "not valid JSON" in r.stderr and r.stdout == ""
