"""Self-speculative decoding through the worker processes (spec/worker-protocol.md §4.6).

Fake worker: the ready record, the done record's counts, identical output with and without
drafting, and a cancel during a drafted step. Real model (slow): at temperature 0 every output
of a set of prompts (a file re-emitted with edits, a tool call repeating paths, prose, JSON, a
stop string, multibyte text, a grammar) is token for token the one without speculation, and a
seeded sampled output is the same too. ``TRIOSERVE_SPEC_EXACTNESS_PROMPTS=N`` runs N prompts
(default 24: the suite's budget; the report's run used 200).
"""

from __future__ import annotations

import itertools
import json
import os
import random

import pytest

from testkit.worker_process import Worker

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
EDITED = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\nDONE"
FILE = "def area(width, height):\n    return width * height\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.json"
    path.write_text(json.dumps([EDITED]))
    return str(path)


def _run(w: Worker, rid: int, **fields):
    texts, done = w.generate(rid, **fields)
    assert done["type"] == "done", done
    return "".join(texts), done


def test_fake_ready_and_counts(spawn, script):
    on = spawn("trioserve-fake-worker", "--script", script, "--speculative", "auto",
               "--global-draft-tokens", "4096")
    off = spawn("trioserve-fake-worker", "--script", script)
    spec = on.ready["speculative"]
    assert spec["mode"] == "auto" and spec["draft_max"] == 12
    assert spec["global_index_tokens"] == 4096 and spec["global_index_bytes"] == 4096 * 20
    assert spec["sources"] == ["request", "global"]
    assert off.ready["speculative"]["mode"] == "off"
    prompt = "Rewrite:\n" + FILE + "Answer:\n"
    a, da = _run(on, 1, prompt=prompt)
    b, db = _run(off, 1, prompt=prompt)
    assert a == b == EDITED
    assert da["generated_token_ids"] == db["generated_token_ids"]
    assert "drafted_tokens" not in db
    assert 0 < da["accepted_draft_tokens"] <= da["drafted_tokens"]
    assert da["draft_steps"] > 0
    # A stop string inside a drafted run cuts at exactly the same place.
    a, da = _run(on, 2, prompt=prompt, stop=["perimeter"])
    b, db = _run(off, 2, prompt=prompt, stop=["perimeter"])
    assert a == b == EDITED[: EDITED.index("perimeter")]
    assert da["completion_tokens"] == db["completion_tokens"]
    # max_new_tokens inside a draft: exactly that many.
    a, da = _run(on, 3, prompt=prompt, max_new_tokens=9)
    assert a == EDITED[:9] and da["completion_tokens"] == 9 and da["finish_reason"] == "length"


def test_step_costs_are_measured_with_speculation_off_only_when_asked(spawn, script):
    """``--measure-step-cost`` (benchmarks) fills the ready record's step-cost table with
    speculation off; without it nothing is measured (no start-up time spent)."""
    measured = spawn("trioserve-fake-worker", "--script", script, "--measure-step-cost")
    spec = measured.ready["speculative"]
    assert spec["mode"] == "off" and "off_reason" not in spec
    assert spec["step_cost_ms"] and all(n > 0 and ms > 0 for n, ms in spec["step_cost_ms"]), spec
    assert spawn("trioserve-fake-worker", "--script", script).ready["speculative"]["step_cost_ms"] == []
    # The worker serves as before.
    assert _run(measured, 1, prompt="Rewrite:\n" + FILE + "Answer:\n")[0] == EDITED


def test_fake_refuses_bad_flag(bin_dir):
    w = Worker([str(bin_dir / "trioserve-fake-worker"), "--speculative", "sometimes"])
    assert w.read_line(10) is None  # no ready record: a usage error
    assert w.proc.wait(10) != 0
    assert "--speculative must be auto or off" in w.stderr_text()
    w.close()


def test_fake_cancel_during_drafted_steps_frees_the_slot(spawn, script):
    # One slot and a per-step delay: a cancel arriving while drafted steps run ends the
    # generation at the next step boundary; the slot takes the next generate at once.
    w = spawn("trioserve-fake-worker", "--script", script, "--speculative", "auto", "--capacity", "1",
              "--token-delay-ms", "40", "--draft-max", "2")
    w.send({"op": "generate", "id": 1, "prompt": "Rewrite:\n" + FILE})
    first = w.record(30)
    assert first["type"] == "token"
    w.cancel(1)
    texts = [first["text"]]
    while True:
        rec = w.record(30)
        if rec["type"] == "token":
            texts.append(rec["text"])
            continue
        break
    assert rec["type"] == "done" and rec["cancelled"] is True, rec
    assert len("".join(texts)) < len(EDITED)
    text, done = _run(w, 2, prompt="x")
    assert done["cancelled"] is False and text == EDITED


# -- real model ------------------------------------------------------------------------------

def _source_file(rng: random.Random, lines: int) -> str:
    names = ["parse", "render", "load", "store", "merge", "split", "check", "build"]
    out = []
    for i in range(lines // 4):
        name = f"{rng.choice(names)}_{i}"
        arg = rng.choice(["path", "items", "config", "text"])
        out += [f"def {name}({arg}):", f"    result = helper_{i % 7}({arg})",
                f"    return result + {i}", ""]
    return "\n".join(out)


def exactness_prompts(n: int, seed: int = 1) -> list[dict]:
    """n generate requests mixing the workloads the issue names (deterministic)."""
    rng = random.Random(seed)
    kinds = ["edit", "tool", "prose", "json", "stop", "multibyte", "grammar", "reemit"]
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        if kind in ("edit", "reemit"):
            src = _source_file(rng, rng.choice([16, 24, 40]))
            ask = ("Rewrite this file, renaming `result` to `value`, and output the whole file:\n"
                   if kind == "edit" else "Repeat this file exactly:\n")
            req = {"prompt": CHAT.format(q=ask + src), "max_new_tokens": 64}
        elif kind == "tool":
            path = f"src/module_{rng.randint(1, 99)}/file_{rng.randint(1, 9)}.py"
            q = (f"Earlier you called read_file with {{\"path\": \"{path}\"}}. Call it again for the "
                 f"same path, answering only with the JSON call.")
            req = {"prompt": CHAT.format(q=q), "max_new_tokens": 40}
        elif kind == "prose":
            topic = rng.choice(["the sea", "a library", "winter", "trains", "bread"])
            req = {"prompt": CHAT.format(q=f"Write a short paragraph about {topic}."), "max_new_tokens": 48}
        elif kind == "json":
            key = rng.choice(["name", "id", "size"])
            q = f"Give a JSON object with keys {key}, tags and items for a shopping list."
            req = {"prompt": CHAT.format(q=q), "max_new_tokens": 48}
        elif kind == "stop":
            q = "Count from one to twenty in words, separated by commas."
            req = {"prompt": CHAT.format(q=q), "max_new_tokens": 48,
                   "stop": [rng.choice(["five", "ten", ", s", "twelve"])]}
        elif kind == "multibyte":
            word = rng.choice(["café", "naïve", "日本語", "Ελλάδα", "😀 emoji"])
            req = {"prompt": CHAT.format(q=f"Repeat the word {word} five times."), "max_new_tokens": 40}
        else:
            req = {"prompt": CHAT.format(q="Answer yes or no: is water wet?"), "max_new_tokens": 8,
                   "grammar": 'root ::= "yes" | "no"'}
        req["kind"] = kind
        out.append(req)
    return out


def _llama(bin_dir, model, mode: str, *extra: str, threads: int = 1) -> Worker:
    # One thread by default: a shared CI machine runs it faster (two threads: the test below).
    # Flash attention on whatever the mode: `auto` turns it on for speculation only, and the
    # plain worker each test compares with must run the same kernels.
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", str(threads),
                "--ctx", "2048", "--capacity", "2", "--min-shared-prefix", "0", "--speculative", mode,
                "--flash-attn", "on", *extra])
    w.wait_ready(180)
    w.ids = itertools.count(1)  # type: ignore[attr-defined]
    return w


@pytest.mark.slow
def test_real_model_outputs_identical_with_and_without_speculation(bin_dir, model):
    n = int(os.environ.get("TRIOSERVE_SPEC_EXACTNESS_PROMPTS", "24"))
    prompts = exactness_prompts(n)
    # A flat step cost: draft whenever a draft exists (exactness must hold for any lengths; the
    # measured model may rightly choose none on a loaded machine).
    on = _llama(bin_dir, model, "auto", "--step-cost-ms", "1:1,64:1")
    off = _llama(bin_dir, model, "off")
    try:
        assert on.ready["speculative"]["mode"] == "auto"
        assert on.ready["speculative"]["step_cost_ms"] == [[1, 1.0], [64, 1.0]]
        assert off.ready["speculative"]["mode"] == "off"
        drafted = accepted = 0
        mismatches = []
        for req in prompts:
            fields = {k: v for k, v in req.items() if k != "kind"}
            a, da = _run(on, next(on.ids), **fields)  # type: ignore[attr-defined]
            b, db = _run(off, next(off.ids), **fields)  # type: ignore[attr-defined]
            if (a, da.get("generated_token_ids"), da["completion_tokens"], da["finish_reason"]) != (
                    b, db.get("generated_token_ids"), db["completion_tokens"], db["finish_reason"]):
                mismatches.append((req["kind"], a, b))
            if req["kind"] == "grammar":
                assert "drafted_tokens" not in da  # never drafted
            drafted += da.get("drafted_tokens", 0)
            accepted += da.get("accepted_draft_tokens", 0)
        assert not mismatches, mismatches[:3]
        assert accepted > 0, (drafted, accepted)
        # Seeded sampling: the same seed gives the same output with and without drafting.
        q = {"prompt": CHAT.format(q="Repeat this file exactly:\n" + _source_file(random.Random(5), 16)),
             "max_new_tokens": 48, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 11}
        a, _ = _run(on, next(on.ids), **q)  # type: ignore[attr-defined]
        b, _ = _run(off, next(off.ids), **q)  # type: ignore[attr-defined]
        assert a == b
    finally:
        assert on.close() == 0
        assert off.close() == 0


def _drafted_with_identical_outputs(on: Worker, off: Worker, reqs: list[dict], min_prompt_tokens: int = 0) -> int:
    """Runs each request on both workers, asserts the same text and ids (and prompts longer
    than ``min_prompt_tokens``); returns the tokens ``on`` drafted."""
    drafted = 0
    for req in reqs:
        a, da = _run(on, next(on.ids), **req)  # type: ignore[attr-defined]
        b, db = _run(off, next(off.ids), **req)  # type: ignore[attr-defined]
        assert da["prompt_tokens"] > min_prompt_tokens
        assert (a, da.get("generated_token_ids")) == (b, db.get("generated_token_ids"))
        drafted += da.get("drafted_tokens", 0)
    return drafted


@pytest.mark.slow
def test_real_model_measured_costs_probe_and_stay_exact(bin_dir, model):
    """With the measured cost table (no --step-cost-ms) a verbatim copy gets its shape probed
    (drafts verified although no drafted step of that shape was measured yet), and every
    output is still the plain one. One stream at a time: batched kernels are not
    bit-identical across batch shapes (§4.3), so two streams' outputs could differ by that."""
    src = _source_file(random.Random(3), 40)
    reqs = [{"prompt": CHAT.format(q="Repeat this file exactly:\n" + src), "max_new_tokens": 96},
            {"prompt": CHAT.format(q="Rewrite this file, renaming `result` to `value`:\n" + src),
             "max_new_tokens": 96}]
    on = _llama(bin_dir, model, "auto")
    off = _llama(bin_dir, model, "off")
    try:
        assert on.ready["speculative"]["step_cost_ms"]  # the start-up calibration ran
        assert _drafted_with_identical_outputs(on, off, reqs) > 0
    finally:
        assert on.close() == 0
        assert off.close() == 0


@pytest.mark.slow
def test_real_model_two_threads_exact_or_refused(bin_dir, model):
    """At two model threads llama.cpp's CPU flash attention computes a lone query past 256 KV
    cells (plain decoding) unlike a verify step's several, so the worker's start-up check turns
    drafting off and the ready record says why, rather than let drafts change outputs. With a
    quantized KV cache that split does not exist: drafting stays on, and every output, at
    contexts past that depth, is the plain one."""
    refused = _llama(bin_dir, model, "auto", "--step-cost-ms", "1:1,64:1", threads=2)
    try:
        spec = refused.ready["speculative"]
        assert spec["mode"] == "off", spec
        assert "not bit-identical to plain decoding" in spec["off_reason"]
        a, da = _run(refused, next(refused.ids), prompt=CHAT.format(q="Say hi."), max_new_tokens=8)  # type: ignore[attr-defined]
        assert a and "drafted_tokens" not in da  # it serves, without drafts
    finally:
        assert refused.close() == 0
    on = _llama(bin_dir, model, "auto", "--step-cost-ms", "1:1,64:1", "--kv-cache-type", "q8_0", threads=2)
    off = _llama(bin_dir, model, "off", "--kv-cache-type", "q8_0", threads=2)
    try:
        assert on.ready["speculative"]["mode"] == "auto" and "off_reason" not in on.ready["speculative"]
        reqs = [{"prompt": CHAT.format(q=q + _source_file(random.Random(seed), 60)), "max_new_tokens": 96}
                for seed in (3, 4)
                for q in ("Repeat this file exactly:\n", "Rewrite this file, renaming `result` to `value`:\n")]
        # Prompts past the depth where the split starts.
        assert _drafted_with_identical_outputs(on, off, reqs, min_prompt_tokens=300) > 0
    finally:
        assert on.close() == 0
        assert off.close() == 0
