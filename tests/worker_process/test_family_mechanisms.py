"""Every session mechanism on every synthetic family (issue #48 item 3): the dense Qwen3, the
hybrid Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet recurrent state + attention), and Gemma 3 and
Gemma 4 (sliding-window layers), each made by testkit/synthetic_models.py and run by the real
llama worker with ``--deterministic`` (spec/worker-protocol.md §4.5; speculation aside, which it turns off): a generation's greedy ids
then equal a cold run's whatever the path, so each mechanism is checked against a cold worker.

Per family, in one worker of three slots: a second session sharing the system prompt (copied
prefix; on the hybrid families from the checkpoint the first session's slot took at the mark the
control plane puts where the system prompt ends), warm resume of a session's next turn, a turn whose previous answer came back changed
(what a thinking model's template does: checkpoints on the hybrid families), spill and restore
after an eviction, two streams decoding beside each other, a grammar-constrained answer, and a
cancel as a long prefill starts that leaves the worker serving. Where the engine can verify
drafts (not the recurrent families) self-speculation is exact or says why it stays off.

Random weights: what the models say is never checked, only that the paths agree. The tiny
shapes take about a second a family here, so these are not marked slow.
"""

from __future__ import annotations

import itertools

import pytest

from testkit.synthetic_models import make
from testkit.worker_process import Worker
from trioserve.core.checkpoint_hints import find_marks, mark_segments
from trioserve.model.chat_template import ChatTemplate
from trioserve.worker.protocol import TextSegment

FAMILIES = ("qwen3", "qwen35", "qwen35moe", "gemma3", "gemma4")
HYBRID = {"qwen35", "qwen35moe"}
N = 12  # greedy tokens compared per generation
FLAGS = ("--threads", "2", "--ctx", "1024", "--cpu-extra-buffers", "off")
SYSTEM = ("You are a coding agent. You read files before you edit them, you explain each change in "
          "one sentence, and you never invent file names. Tools: read, edit, run. ") * 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("families")
    return {arch: make(arch, out) for arch in FAMILIES}


def _start(spawn, model, *flags: str) -> Worker:
    w = spawn("trioserve-llama-worker", "--model", str(model), *FLAGS, *flags)
    w.ids = itertools.count(1)
    st = w.ready["special_tokens"]
    w.template = ChatTemplate.from_string(w.ready["chat_template"], st["bos"] or "", st["eos"] or "")
    return w


def _render(w: Worker, *turns: str) -> str:
    """SYSTEM, then user/assistant turns alternating, then the generation prompt. Gemma 3's
    template has no system role of its own: it folds the system text into the first user turn,
    which is what the other families' prompts share too (the system text comes first)."""
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return w.template.render(messages, template_kwargs={"enable_thinking": False})


def _marked(w: Worker, prompt: str) -> list[dict]:
    """``prompt`` as segments with the control plane's checkpoint mark at the end of the
    system prompt (trioserve/core/checkpoint_hints.py), where the template allows one."""
    head = w.template.render([{"role": "system", "content": SYSTEM}], add_generation_prompt=False,
                             template_kwargs={"enable_thinking": False})
    if 0 < len(head) < len(prompt) and prompt.startswith(head):
        return [{"text": head, "checkpoint": True}, {"text": prompt[len(head):]}]
    return [{"text": prompt}]


def _gen(w: Worker, **fields) -> dict:
    _, done = w.generate(next(w.ids), **{"max_new_tokens": N, "temperature": 0, **fields})
    assert done["type"] == "done", done
    return done


def _cold(cold: Worker, prompt: str, **fields) -> list[int]:
    """Greedy ids of a cold run: the one-slot worker clears its slot first."""
    _gen(cold, prompt_segments=[{"ids": [1]}], max_new_tokens=1)
    done = _gen(cold, prompt=prompt, **fields)
    assert done["reused_prompt_tokens"] == 0, done
    return done["generated_token_ids"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_mechanism_equals_a_cold_run(arch, models, spawn):
    w = _start(spawn, models[arch], "--capacity", "3", "--deterministic")
    cold = _start(spawn, models[arch], "--capacity", "1", "--min-shared-prefix", "0", "--deterministic")
    n_sys = len(w.request({"op": "tokenize", "id": next(w.ids), "text": _render(w)})["ids"])

    # A second session sharing the system prompt starts from a copy of the first's slot.
    pa, pb = _render(w, "Which tool reads a file?"), _render(w, "Name the tool that runs a command.")
    _gen(w, prompt_segments=_marked(w, pa), session_id="a")
    db = _gen(w, prompt_segments=_marked(w, pb), session_id="b")
    assert db["prefill_plan"] == "copied" and db["reused_prompt_tokens"] >= n_sys - 64, db
    # A recurrent state cannot be cut back to the shared prefix: a starts from the checkpoint
    # slot a took where the system prompt ends (the mark, down to the grid).
    assert db["copy_source"] == ("checkpoint" if arch in HYBRID else "slot"), db
    assert db["generated_token_ids"] == _cold(cold, pb)

    # Warm resume: the session's next turn, its previous answer sent back as it was said.
    turn2 = _render(w, "Which tool reads a file?", "read", "And which tool edits one?")
    d2 = _gen(w, prompt_segments=_marked(w, turn2), session_id="a")
    assert d2["reused_prompt_tokens"] > 0, d2
    ref2 = _cold(cold, turn2)
    assert d2["generated_token_ids"] == ref2

    # The previous answer comes back changed: the slot diverges inside the last turn.
    changed = _render(w, "Which tool reads a file?", "read, then edit", "And which tool edits one?",
                      "edit", "Thanks. Which one runs tests?")
    d3 = _gen(w, prompt_segments=_marked(w, changed), session_id="a")
    assert d3["reused_prompt_tokens"] > 0, d3
    assert d3["generated_token_ids"] == _cold(cold, changed)

    # Spill and restore: session c evicts the least recently used idle session (b).
    _gen(w, prompt=_render(w, "Name a fruit."), session_id="c")
    turn_b = _render(w, "Name the tool that runs a command.", "run", "And which one reads?")
    db2 = _gen(w, prompt_segments=_marked(w, turn_b), session_id="b")
    assert db2["prefill_plan"] == "restored", db2
    assert db2["generated_token_ids"] == _cold(cold, turn_b)
    for sid in ("a", "b", "c"):
        w.request({"op": "session_close", "id": next(w.ids), "session_id": sid})

    # Two streams decoding beside each other, one of them prefilling a longer prompt.
    prompts = [_render(w, "Name three colors."), _render(w, "Summarize: " + "the fox jumps over the dog. " * 12)]
    ids = [next(w.ids) for _ in prompts]
    w.send_many([{"op": "generate", "id": i, "prompt": p, "max_new_tokens": N, "temperature": 0}
                 for i, p in zip(ids, prompts)])
    res = w.collect_many(ids)
    for i, p in zip(ids, prompts):
        assert res[i][1]["type"] == "done", res[i]
        assert res[i][1]["generated_token_ids"] == _cold(cold, p)


@pytest.mark.parametrize("arch", FAMILIES)
def test_grammar_and_cancel_mid_prefill(arch, models, spawn):
    w = _start(spawn, models[arch], "--capacity", "2", "--deterministic")
    texts, done = w.generate(next(w.ids), prompt=_render(w, "Yes or no?"), max_new_tokens=8,
                             temperature=0, grammar='root ::= "yes" | "no"')
    assert done["type"] == "done" and "".join(texts) in ("yes", "no"), (texts, done)

    # A long prompt is cancelled as it starts prefilling (the cancel is written right behind
    # the generate: the worker latches it, spec §7): it ends cancelled with nothing said, and
    # the session's slot then serves a turn exactly as a cold worker does.
    rid = next(w.ids)
    w.send({"op": "generate", "id": rid, "prompt": _render(w, "Summarize: " + "words and more words. " * 40),
            "max_new_tokens": 4, "temperature": 0, "session_id": "s"})
    w.cancel(rid)
    texts, done = w.collect(rid)
    assert done["cancelled"] is True and texts == [] and done["completion_tokens"] == 0, done
    cold = _start(spawn, models[arch], "--capacity", "1", "--min-shared-prefix", "0", "--deterministic")
    after = _render(w, "Still there?")
    assert _gen(w, prompt=after, session_id="s")["generated_token_ids"] == _cold(cold, after)


@pytest.mark.parametrize("arch", [a for a in FAMILIES if a not in HYBRID])
def test_self_speculation_is_exact_or_says_why_not(arch, models, spawn):
    """``--speculative auto`` either verifies drafts whose ids are plain decoding's, or stays off
    and says why in the ready record — never silently void. On these F16 models llama.cpp's
    multi-row kernels round a verify step's logits differently from a one-row step (the
    start-up exactness check measures it), so it stays off here (issue #51 item 4). An
    edit-like prompt repeats itself, so n-gram drafts would be tried where it is on. Flash
    attention on for both: ``auto`` turns it on for speculation only, and plain decoding is
    compared on the same kernels."""
    on = _start(spawn, models[arch], "--capacity", "1", "--speculative", "auto")
    off = _start(spawn, models[arch], "--capacity", "1", "--speculative", "off", "--flash-attn", "on")
    assert on.ready["kernel_path"]["flash_attention"] == "on"  # auto, for speculation
    spec = on.ready["speculative"]
    assert spec["mode"] == "auto" or "not bit-identical to plain decoding" in spec["off_reason"], spec
    prompt = _render(on, "Repeat: alpha beta gamma delta alpha beta gamma delta alpha beta")
    d_on = _gen(on, prompt=prompt, max_new_tokens=24)
    d_off = _gen(off, prompt=prompt, max_new_tokens=24)
    assert d_on["generated_token_ids"] == d_off["generated_token_ids"]


def _control_plane_marks(w: Worker, *turns: str) -> tuple[list[dict], int]:
    """The prompt of ``turns`` as the control plane sends it: segments with both checkpoint
    marks (system end, answer start: trioserve/core/checkpoint_hints.py); and the answer-start
    mark's position in tokens."""
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        return w.template.render(msgs, add_generation_prompt=generation_prompt, template_kwargs={"enable_thinking": False})

    prompt = render(messages, True)
    marks = find_marks(render, messages, prompt)
    assert marks.from_start is not None and marks.from_end is not None, marks
    segments = [{"text": seg.text, **({"checkpoint": True} if seg.checkpoint else {})}
                for seg in mark_segments((TextSegment(prompt),), marks)]
    answer_start = w.request({"op": "tokenize", "id": next(w.ids), "text": prompt[:len(prompt) - marks.from_end]})
    return segments, len(answer_start["ids"])


@pytest.mark.parametrize("arch", sorted(HYBRID))
def test_a_restarted_worker_resumes_a_hybrid_session_from_stored_prefix_states(arch, models, spawn, tmp_path):
    """The state store (spec §6.4) on a hybrid model: the stored end of a turn is no use when the
    next turn's history differs inside it, so the states at the checkpoint positions are stored
    too (the system prompt's end, the prompt's end). After a restart the session's next turn,
    whose previous answer came back changed, starts from turn 1's prompt, and a new session
    from the system prompt."""
    d = str(tmp_path / "states")
    w = _start(spawn, models[arch], "--capacity", "2", "--state-dir", d)
    head = w.template.render([{"role": "system", "content": SYSTEM}], add_generation_prompt=False,
                             template_kwargs={"enable_thinking": False})
    n_sys = len(w.request({"op": "tokenize", "id": next(w.ids), "text": head})["ids"])
    segments, answer_start = _control_plane_marks(w, "Which tool reads a file?")
    assert n_sys < answer_start
    _gen(w, prompt_segments=segments, session_id="a")
    assert w.close() == 0  # the drain at stdin EOF finishes the writes
    w = _start(spawn, models[arch], "--capacity", "2", "--state-dir", d)
    assert w.ready["state_store"]["files"] >= 3  # system end, answer start, prompt end (+ the turn)
    segments, _ = _control_plane_marks(w, "Which tool reads a file?", "read, then edit", "And which tool edits one?")
    d2 = _gen(w, prompt_segments=segments, session_id="a")
    assert d2["copy_source"] == "disk" and answer_start - 2 <= d2["reused_prompt_tokens"] <= answer_start, d2
    segments, _ = _control_plane_marks(w, "Name the tool that runs a command.")
    d3 = _gen(w, prompt_segments=segments, session_id="b")
    assert n_sys - 2 <= d3["reused_prompt_tokens"] < answer_start, d3
