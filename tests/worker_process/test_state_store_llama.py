"""The persistent state store on the llama worker with the embedded SmolLM2 model (spec/worker-
protocol.md §6.4): a session's state written by one worker is loaded by the next one, and its
next turn's greedy text is exactly that of a worker that kept the session in its slot; a
worker with another context size (another fingerprint) never loads it. Marked slow like the
other real-model tests."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from testkit.worker_process import Worker

pytestmark = pytest.mark.slow

CHAT = "<|im_start|>system\n{s}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
SYSTEM = "You are a terse assistant for a software team. Answer with one short sentence. " * 12
TURN2 = "<|im_end|>\n<|im_start|>user\nAnd what about tests?<|im_end|>\n<|im_start|>assistant\n"


def _worker(bin_dir: Path, model: Path, state_dir: Path | None, ctx: str = "2048") -> Worker:
    store = ["--state-dir", str(state_dir)] if state_dir else []
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", "2",
                "--ctx", ctx, "--capacity", "3", *store])
    w.wait_ready(120)
    w.ids = itertools.count(1)  # type: ignore[attr-defined]
    return w


def _gen(w: Worker, **fields) -> tuple[str, dict]:
    texts, done = w.generate(next(w.ids), **fields)  # type: ignore[attr-defined]
    assert done["type"] == "done", done
    return "".join(texts), done


def _turns(w: Worker, session: str) -> tuple[list[dict], str, dict]:
    """Turn 1 of ``session``; returns turn 2's prompt segments, turn 1's text and done."""
    p1 = CHAT.format(s=SYSTEM, q="What does the parser module do?")
    t1, d1 = _gen(w, prompt=p1, max_new_tokens=8, session_id=session)
    ids1 = w.request({"op": "tokenize", "id": next(w.ids), "text": p1})["ids"]  # type: ignore[attr-defined]
    return [{"ids": ids1 + d1["generated_token_ids"]}, {"text": TURN2}], t1, d1


def test_a_restarted_llama_worker_resumes_a_session_from_disk(bin_dir, model, tmp_path):
    # The reference: a worker without a store whose session stays in its slot between turns.
    ref = _worker(bin_dir, model, None)
    assert ref.ready["state_store"] is None
    ref_turn2, _, _ = _turns(ref, "ref")
    t_ref, d_ref = _gen(ref, prompt_segments=ref_turn2, max_new_tokens=8, session_id="ref")
    assert ref.close() == 0

    state_dir = tmp_path / "states"
    w1 = _worker(bin_dir, model, state_dir)
    assert w1.ready["state_store"]["files"] == 0
    turn2, _, _ = _turns(w1, "s")
    assert turn2 == ref_turn2
    assert w1.close() == 0  # the drain writes the state
    assert list(state_dir.glob("*.tss"))

    w2 = _worker(bin_dir, model, state_dir)
    assert w2.ready["state_store"]["files"] >= 1
    t2, d2 = _gen(w2, prompt_segments=turn2, max_new_tokens=8, session_id="s")
    assert d2["prefill_plan"] == "copied" and d2["copy_source"] == "disk", d2
    assert d2["reused_prompt_tokens"] == d_ref["reused_prompt_tokens"] >= 0.9 * d2["prompt_tokens"]
    assert t2 == t_ref  # the loaded cells are exactly those first computed
    assert w2.close() == 0

    w3 = _worker(bin_dir, model, state_dir, ctx="1024")  # another fingerprint
    assert w3.ready["state_store"]["files"] == 0
    _, d3 = _gen(w3, prompt_segments=turn2, max_new_tokens=8, session_id="s")
    assert d3["reused_prompt_tokens"] == 0 and d3.get("copy_source") is None
    assert w3.close() == 0
