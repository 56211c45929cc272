"""The ExecuTorch worker on a real exported model (SmolLM2-135M-Instruct, 8da4w, XNNPACK, fused
attention: scripts/executorch/export_smollm2_pte.py), when one is on this machine.

The program is 190 MB and takes ~12 CPU-minutes to export, so it is not committed and CI does not
have it: these tests skip, saying how to make it, unless ``TRIOSERVE_TEST_PTE`` names a `.pte`
(its tokenizer.json beside it) or the export script's default output exists. The same
properties are tested on the committed tiny programs in CI (test_executorch_slots.py); here they
are checked where the cache is 30 layers deep, the vocabulary real and the weights quantized.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from testkit import REPO
from testkit.executorch_assets import executorch_worker
from testkit.worker_process import Worker

pytestmark = pytest.mark.slow

DEFAULT_PTE = REPO / "build" / "executorch-smollm2" / "smollm2.pte"


@pytest.fixture(scope="module")
def real_pte() -> Path:
    named = os.environ.get("TRIOSERVE_TEST_PTE")
    path = Path(named) if named else DEFAULT_PTE
    if not path.is_file() or not (path.parent / "tokenizer.json").is_file():
        pytest.skip(f"no real ExecuTorch program at {path} (with tokenizer.json beside it): export one with "
                    "scripts/executorch/export_smollm2_pte.py (~12 CPU-minutes, 190 MB, not in CI) and set "
                    "TRIOSERVE_TEST_PTE")
    return path


@pytest.fixture(scope="module")
def encode(real_pte):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(real_pte.parent / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def start(real_pte, *flags):
    w = Worker([str(executorch_worker()), "--model", str(real_pte), "--tokenizer",
                str(real_pte.parent / "tokenizer.json"), "--threads", "1", *flags])
    w.wait_ready(120)
    w.ids = itertools.count(1)
    return w


def segments(ids):
    return [{"ids": list(ids)}]


def test_real_program_completes_a_known_fact(real_pte, encode):
    """The export is the model, not noise: greedy text after a plain fact prompt names it."""
    w = start(real_pte, "--capacity", "1")
    try:
        texts, done = w.generate(1, prompt_segments=segments(encode("The capital of France is")),
                                 max_new_tokens=8)
    finally:
        assert w.close() == 0
    text = "".join(texts)
    assert done["type"] == "done" and "Paris" in text, (text, done)


def test_real_program_interleaved_slots_equal_solo_runs(real_pte, encode):
    """Two conversations decoding together on two slots of one program load give each one's
    solo greedy ids."""
    prompts = [encode("Write one sentence about the sea."), encode("List three prime numbers:")]
    w = start(real_pte, "--capacity", "2", "--min-shared-prefix", "0")
    try:
        solo = [w.generate(next(w.ids), prompt_segments=segments(p), max_new_tokens=24)[1]["generated_token_ids"]
                for p in prompts]
        ids = [next(w.ids) for _ in prompts]
        w.send_many([{"op": "generate", "id": i, "prompt_segments": segments(p), "max_new_tokens": 24}
                     for i, p in zip(ids, prompts)])
        out = w.collect_many(ids)
    finally:
        assert w.close() == 0
    for i, want in zip(ids, solo):
        assert out[i][1]["type"] == "done" and out[i][1]["generated_token_ids"] == want
    assert all(len(s) > 0 for s in solo)


def test_real_program_spilled_session_continues_like_one_never_evicted(real_pte, encode):
    prompt = encode("Tell me about the moon.")
    follow = encode(" And the sun?")

    def conversation(evict: bool):
        w = start(real_pte, "--capacity", "2", "--min-shared-prefix", "0")
        try:
            _, d1 = w.generate(next(w.ids), prompt_segments=segments(prompt), max_new_tokens=8, session_id="s1")
            if evict:
                for s, text in (("s2", "Hello there."), ("s3", "Good morning.")):
                    w.generate(next(w.ids), prompt_segments=segments(encode(text)), max_new_tokens=4, session_id=s)
            turn2 = prompt + d1["generated_token_ids"] + follow
            return w.generate(next(w.ids), prompt_segments=segments(turn2), max_new_tokens=16, session_id="s1")[1]
        finally:
            assert w.close() == 0

    evicted, kept = conversation(True), conversation(False)
    assert evicted["prefill_plan"] == "restored" and kept["prefill_plan"] == "exact_prefix"
    assert evicted["generated_token_ids"] == kept["generated_token_ids"]
