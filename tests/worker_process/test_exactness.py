"""Outputs across paths, on the real model, under every CPU kernel variant the build holds
(spec/worker-protocol.md §4.5, §10).

ggml picks its kernels by the number of rows in a micro-batch and sums in kernel-specific
order, so on llama.cpp a logit's last bits depend on how a prompt's prefill was cut and on
what else shared the step; which greedy picks flip depends on the kernel variant (the AVX2
``haswell`` kernels flip one where the AVX-512 ones do not). Every variant is forced in turn
(``TRIOSERVE_CPU_VARIANT``), so an AVX-512 machine also checks what an AVX2 machine runs.

* ``--deterministic``: a generation's tokens equal a cold run's whatever the path — copied
  prefix, warm resume, spill and restore, a prefill beside other streams, concurrent streams.
* default mode: a copied prefix holds exactly the cells its source computed, so the output
  equals a run that computes the same pieces (a fresh worker prefilling the source prompt and
  then this one); equality with a cold run is not promised there.

Slow (real model); each variant starts two small workers. A variant this CPU cannot run is
skipped with the worker's own refusal.
"""

from __future__ import annotations

import itertools

import pytest

from testkit.worker_process import Worker, cpu_variants, refused_variant

pytestmark = pytest.mark.slow

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
SYSTEM = ("<|im_start|>system\nYou are a coding agent. You read files before you edit them, you "
          "explain each change in one sentence, you never invent file names, and you answer in "
          "English. Tools: read(path), edit(path, old, new), run(command). " * 6 + "<|im_end|>\n")
PA = SYSTEM + CHAT.format(q="Which tool reads a file?")
PB = SYSTEM + CHAT.format(q="Name the tool that runs a command.")
N = 16  # greedy tokens compared per generation
VARIANTS = cpu_variants()


def start(bin_dir, model, variant: str, *flags: str) -> Worker:
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", "2",
                "--cpu-extra-buffers", "off", *flags],
               env={"TRIOSERVE_CPU_VARIANT": variant} if variant else None)
    try:
        w.wait_ready(180)
    except AssertionError:
        why = refused_variant(w)
        w.close()
        if why is None:
            raise
        pytest.skip(f"CPU variant {variant}: {why}")
    if variant:
        assert w.ready["kernel_path"]["cpu_variant"] == variant
        assert w.ready["kernel_path"]["cpu_variant_forced"] is True
    w.ids = itertools.count(1)
    return w


def gen(w: Worker, **fields) -> dict:
    texts, done = w.generate(next(w.ids), **{"max_new_tokens": N, "temperature": 0, **fields})
    assert done["type"] == "done", done
    return done


def cold_ids(cold: Worker, **fields) -> list[int]:
    """Greedy ids of a cold run: the one-slot worker clears its slot with an unrelated prompt
    first, so nothing of the prompt is reused."""
    gen(cold, prompt_segments=[{"ids": [0]}], max_new_tokens=1)
    done = gen(cold, **fields)
    assert done["reused_prompt_tokens"] == 0, done
    return done["generated_token_ids"]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v or "own" for v in VARIANTS])
def test_deterministic_paths_equal_a_cold_run(bin_dir, model, variant):
    w = start(bin_dir, model, variant, "--deterministic", "--ctx", "2048", "--capacity", "3")
    cold = start(bin_dir, model, variant, "--deterministic", "--ctx", "2048", "--capacity", "1",
                 "--min-shared-prefix", "0")
    try:
        assert w.ready["deterministic"] is True and w.ready["prefill_grid"] == 64
        n_sys = len(w.request({"op": "tokenize", "id": next(w.ids), "text": SYSTEM})["ids"])
        # A copied prefix: session b starts from session a's slot, whole grid pieces only.
        gen(w, prompt=PA, session_id="a")
        db = gen(w, prompt=PB, session_id="b")
        assert db["prefill_plan"] == "copied" and db["reused_prompt_tokens"] % 64 == 0
        assert db["reused_prompt_tokens"] >= n_sys - 63
        assert db["generated_token_ids"] == cold_ids(cold, prompt=PB)
        # Warm resume: a's second turn keeps its first prompt's whole pieces.
        turn2 = PA + "read(path)<|im_end|>\n" + CHAT.format(q="And which tool edits one?")
        d2 = gen(w, prompt=turn2, session_id="a")
        assert d2["prefill_plan"] in ("exact_prefix", "trimmed") and d2["reused_prompt_tokens"] % 64 == 0
        assert d2["reused_prompt_tokens"] > 0
        ref2 = cold_ids(cold, prompt=turn2)
        assert d2["generated_token_ids"] == ref2
        # Spill and restore: session c evicts the least recently used idle session (b), whose
        # next turn comes back from host memory.
        gen(w, prompt=CHAT.format(q="Name a fruit."), session_id="c")
        turn_b = PB + "run(command)<|im_end|>\n" + CHAT.format(q="And which one reads?")
        db2 = gen(w, prompt=turn_b, session_id="b")
        assert db2["prefill_plan"] == "restored", db2
        assert db2["generated_token_ids"] == cold_ids(cold, prompt=turn_b)
        for sid in ("a", "b", "c"):
            w.request({"op": "session_close", "id": next(w.ids), "session_id": sid})
        # Concurrent streams and a prefill that shares its steps with them: each equals its
        # cold run (one llama_decode per slot; the prefill's pieces stay on the grid).
        long_prompt = CHAT.format(q="Summarize: " + "the quick brown fox jumps over the lazy dog. " * 30)
        prompts = [CHAT.format(q="Name three colors."), long_prompt, turn2]
        ids = [next(w.ids) for _ in prompts]
        w.send_many([{"op": "generate", "id": i, "prompt": p, "max_new_tokens": N, "temperature": 0}
                     for i, p in zip(ids, prompts)])
        res = w.collect_many(ids)
        assert res[ids[2]][1]["generated_token_ids"] == ref2
        for i, p in zip(ids[:2], prompts[:2]):
            assert res[i][1]["type"] == "done", res[i]
            assert res[i][1]["generated_token_ids"] == cold_ids(cold, prompt=p), p[:40]
    finally:
        assert w.close() == 0
        assert cold.close() == 0


# The default-mode property on the machine's own kernels and the AVX2 and AVX-512 families
# (the full variant sweep is the deterministic test's; this keeps the added time small).
SAME_PIECES_VARIANTS = [v for v in VARIANTS if v in ("", "haswell", "skylakex")]


@pytest.mark.parametrize("variant", SAME_PIECES_VARIANTS, ids=[v or "own" for v in SAME_PIECES_VARIANTS])
def test_a_copied_prefix_equals_a_run_of_the_same_pieces(bin_dir, model, variant):
    """Default mode: session b copies session a's slot (trimmed to the shared prefix) and
    prefills the rest; a fresh worker that prefills PA and then PB in the same slot computes
    the same pieces, and the greedy tokens are the same on every kernel variant."""
    w = start(bin_dir, model, variant, "--ctx", "2048", "--capacity", "3", "--step-target-ms", "0")
    ref = start(bin_dir, model, variant, "--ctx", "2048", "--capacity", "1", "--step-target-ms", "0")
    try:
        gen(w, prompt=PA, session_id="a")
        db = gen(w, prompt=PB, session_id="b")
        assert db["prefill_plan"] == "copied" and db["copy_source"] == "slot"
        gen(ref, prompt=PA, max_new_tokens=1)  # ends by length: the slot holds exactly PA
        dr = gen(ref, prompt=PB)
        assert dr["prefill_plan"] == "trimmed" and dr["reused_prompt_tokens"] == db["reused_prompt_tokens"]
        assert db["generated_token_ids"] == dr["generated_token_ids"]
    finally:
        assert w.close() == 0
        assert ref.close() == 0
