"""``logit_bias`` in the generate record (spec/worker-protocol.md §4): the llama engine adds
each bias to its token's logit before every other sampler, so -100 bans a token even at
temperature 0 and +100 forces one; speculative verification picks through the same chain, so
a biased generation is the same with drafting on. Engines that cannot apply a bias (the fake
worker's scripted bytes) refuse it; a bad list is an ``invalid_request`` error record and the
worker keeps serving. Real model: the embedded SmolLM2-135M (slow).
"""

from __future__ import annotations

import itertools

import pytest

from testkit.worker_process import Worker

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def _llama(bin_dir, model, *extra: str, threads: int = 2) -> Worker:
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", str(threads),
                "--ctx", "2048", "--capacity", "2", *extra])
    w.wait_ready(180)
    w.ids = itertools.count(1)  # type: ignore[attr-defined]
    return w


@pytest.fixture(scope="module")
def llama(bin_dir, model):
    w = _llama(bin_dir, model)
    yield w
    assert w.close() == 0


def _gen(w: Worker, q: str, n: int, **fields) -> dict:
    _, done = w.generate(next(w.ids), prompt=CHAT.format(q=q), max_new_tokens=n,  # type: ignore[attr-defined]
                         temperature=0, **fields)
    assert done["type"] == "done", done
    return done


def _eog_ids(w: Worker) -> list[int]:
    """The ids that end an answer of this chat model: EOS (<|im_end|>) and <|endoftext|>."""
    rec = w.request({"op": "tokenize", "id": next(w.ids), "text": "<|endoftext|>",  # type: ignore[attr-defined]
                     "special": True})
    assert rec["type"] == "tokens" and len(rec["ids"]) == 1, rec
    return sorted({w.ready["special_tokens"]["eos_id"], rec["ids"][0]})  # type: ignore[index]


@pytest.mark.slow
def test_ready_record_reports_logit_bias(llama):
    assert llama.ready["capabilities"]["logit_bias"] is True


@pytest.mark.slow
def test_banning_the_greedy_first_token_changes_it(llama):
    plain = _gen(llama, "What is the capital of France?", 6)["generated_token_ids"]
    banned = _gen(llama, "What is the capital of France?", 6,
                  logit_bias=[[plain[0], -100]])["generated_token_ids"]
    assert banned[0] != plain[0]
    # The same request without a bias is unchanged (the bias lives in that generation's sampler only).
    assert _gen(llama, "What is the capital of France?", 6)["generated_token_ids"] == plain


@pytest.mark.slow
def test_positive_bias_forces_a_token(llama):
    plain = _gen(llama, "Hello", 4)["generated_token_ids"]
    favoured = 1000 if plain[0] != 1000 else 1001
    forced = _gen(llama, "Hello", 4, logit_bias=[[favoured, 100]])["generated_token_ids"]
    assert forced[0] == favoured


@pytest.mark.slow
def test_banning_end_of_turn_runs_to_max_tokens(llama):
    short = _gen(llama, "Hello", 32)
    assert short["finish_reason"] == "stop" and len(short["generated_token_ids"]) < 32
    eog = _eog_ids(llama)
    long = _gen(llama, "Hello", 32, logit_bias=[[t, -100] for t in eog])
    assert long["finish_reason"] == "length"
    assert len(long["generated_token_ids"]) == 32
    assert not set(eog) & set(long["generated_token_ids"])


@pytest.mark.slow
def test_bias_also_applies_with_temperature(llama):
    eog = _eog_ids(llama)
    done = _gen(llama, "Hello", 24, logit_bias=[[t, -100] for t in eog])  # greedy reference
    sampled = llama.generate(next(llama.ids), prompt=CHAT.format(q="Hello"), max_new_tokens=24,
                             temperature=0.8, top_k=40, seed=7, logit_bias=[[t, -100] for t in eog])[1]
    assert done["finish_reason"] == sampled["finish_reason"] == "length"


BAD = [
    ({"logit_bias": [[49152, 1]]}, "outside the vocabulary"),  # the embedded model's n_vocab
    ({"logit_bias": [[-1, 1]]}, "logit_bias"),
    ({"logit_bias": [[1, "a"]]}, "logit_bias"),
    ({"logit_bias": [[1, 101]]}, "logit_bias"),
    ({"logit_bias": [[1, -100.5]]}, "logit_bias"),
    ({"logit_bias": [[1, 1], [1, 2]]}, "logit_bias"),
    ({"logit_bias": [[1.5, 1]]}, "logit_bias"),
    ({"logit_bias": [[1]]}, "logit_bias"),
    ({"logit_bias": {"1": 1}}, "logit_bias"),
    ({"logit_bias": [[1, True]]}, "logit_bias"),
]


@pytest.mark.slow
@pytest.mark.parametrize("fields,says", BAD)
def test_bad_bias_is_invalid_request_and_worker_keeps_serving(llama, fields, says):
    assert llama.ready["n_vocab"] == 49152
    _, rec = llama.generate(next(llama.ids), prompt="hi", max_new_tokens=2, **fields)
    assert rec["type"] == "error" and rec["code"] == "invalid_request", rec
    assert says in rec["message"]
    assert _gen(llama, "Hello", 2)["generated_token_ids"]


@pytest.mark.slow
def test_speculative_verification_matches_plain_decoding_with_a_bias(bin_dir, model):
    # A repetitive prompt gives the n-gram drafter something to propose; a flat step cost
    # makes the worker verify every draft it finds. One thread: at two, the start-up exactness
    # check turns drafting off on this model (test_speculative.py).
    q = "Repeat exactly, ten times: red green blue red green blue red green blue"
    # Flash attention on for both: `auto` turns it on for speculation only (spec §10).
    flags = ("--min-shared-prefix", "0", "--step-cost-ms", "1:1,64:1", "--flash-attn", "on")
    spec = _llama(bin_dir, model, "--speculative", "auto", *flags, threads=1)
    plain = _llama(bin_dir, model, "--speculative", "off", *flags, threads=1)
    try:
        eog = _eog_ids(plain)
        accepted = 0
        for bias in ([[t, -100] for t in eog], [[t, -100] for t in eog] + [[3817, 5.0]]):
            a = _gen(spec, q, 48, logit_bias=bias)
            b = _gen(plain, q, 48, logit_bias=bias)
            assert a["generated_token_ids"] == b["generated_token_ids"]
            assert a["finish_reason"] == "length"
            accepted += a["accepted_draft_tokens"]
        assert spec.ready["speculative"]["mode"] == "auto"
        assert accepted > 0  # drafts were verified through the biased chain, not skipped
        # Seeded sampling: the same draws with and without drafting.
        sampled = dict(temperature=0.8, top_k=40, seed=11, logit_bias=[[t, -100] for t in eog])
        a = spec.generate(next(spec.ids), prompt=CHAT.format(q=q), max_new_tokens=32, **sampled)[1]
        b = plain.generate(next(plain.ids), prompt=CHAT.format(q=q), max_new_tokens=32, **sampled)[1]
        assert a["generated_token_ids"] == b["generated_token_ids"]
    finally:
        assert spec.close() == 0
        assert plain.close() == 0


def test_fake_engine_refuses_a_bias_and_keeps_serving(fake):
    w = fake()
    assert w.ready["capabilities"]["logit_bias"] is False
    _, rec = w.generate(1, prompt="hi", max_new_tokens=2, logit_bias=[[1, -100]])
    assert rec["type"] == "error" and rec["code"] == "invalid_request", rec
    assert "fake engine cannot apply 'logit_bias'" in rec["message"]
    _, done = w.generate(2, prompt="hi", max_new_tokens=2, logit_bias=[])  # empty: no bias
    assert done["type"] == "done", done


def test_executorch_applies_a_bias():
    from testkit.executorch_assets import PTE, TOKENIZER, executorch_worker  # skips without the worker

    w = Worker([str(executorch_worker()), "--model", str(PTE), "--tokenizer", str(TOKENIZER),
                "--threads", "1", "--capacity", "1"])
    try:
        w.wait_ready(60)
        assert w.ready["capabilities"]["logit_bias"] is True
        n_vocab = w.ready["n_vocab"]
        prompt = [{"ids": [3, 4, 5, 6]}]

        def greedy(rid: int, **fields) -> list[int]:
            _, done = w.generate(rid, prompt_segments=prompt, max_new_tokens=4, temperature=0, **fields)
            assert done["type"] == "done", done
            return done["generated_token_ids"]

        plain = greedy(1)
        assert greedy(2, logit_bias=[[plain[0], -100]])[0] != plain[0]
        favoured = 7 if plain[0] != 7 else 8
        assert greedy(3, logit_bias=[[favoured, 100]])[0] == favoured
        _, rec = w.generate(4, prompt_segments=prompt, max_new_tokens=2, logit_bias=[[n_vocab, 1]])
        assert rec["type"] == "error" and rec["code"] == "invalid_request", rec
        assert greedy(5) == plain  # the bias lived in those generations only
    finally:
        w.close()
