"""Several slots on one load of an ExecuTorch program (trioserve-executorch-worker --capacity N).

Each slot is its own instance of the program's forward method with its own planned memory (the
KV cache), over one mapped program. These process tests run on both committed tiny programs:
the plain-attention one (state saved as whole planned arenas) and the --use_sdpa_with_kv_cache
one (state saved as the first `position` rows of the K/V buffers trioserve's
llama::update_cache kernel reports). Greedy references are the ids ExecuTorch's own Python
runtime produced (tests/data/executorch/expected.json) or the same worker's solo runs.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

from testkit.worker_process import Worker
from testkit.executorch_assets import PROGRAMS, TOKENIZER, expected, executorch_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def worker_bin():
    return executorch_worker()


@pytest.fixture(params=list(PROGRAMS))
def program(request):
    return request.param


def start(worker_bin, program, *flags):
    w = Worker([str(worker_bin), "--model", str(PROGRAMS[program]), "--tokenizer", str(TOKENIZER),
                "--threads", "1", *flags])
    w.wait_ready(60)
    w.ids = itertools.count(1)
    return w


def ids_prompt(ids):
    return [{"ids": list(ids)}]


def reference(case):
    """The Python runtime's greedy ids for expected case `case`, up to EOS (never emitted)."""
    c = expected()["cases"][case]
    want, eos = c["greedy_ids"], expected()["eos_id"]
    return c["prompt_ids"], (want[: want.index(eos)] if eos in want else want)


def test_ready_record_reports_slots_and_memory_per_slot(worker_bin, program):
    w = start(worker_bin, program, "--capacity", "3")
    try:
        r = w.ready
        et = r["executorch"]
        assert r["capacity"] == 3 and et["capacity"] == 3 and et["slots_requested"] == 3 and et["capped"] is None
        assert r["capabilities"]["eviction"] is True and r["capabilities"]["prefix_sharing"] is True
        assert et["state_layout"] == ("kv_rows" if program == "tiny_sdpa" else "arenas")
        assert len(et["program_hash"]) == 16 and et["program_bytes"] == PROGRAMS[program].stat().st_size
        # Measured, not assumed: an extra slot's resident growth holds its planned arenas
        # (allocated zeroed, so resident) and, with XNNPACK's weight cache on, far less than
        # another copy of the program's weights beyond them.
        assert et["planned_bytes_per_slot"] > 0
        assert et["bytes_per_extra_slot"] >= et["planned_bytes_per_slot"]
        assert et["bytes_per_extra_slot"] - et["planned_bytes_per_slot"] < et["program_bytes"] / 2
        assert et["weights_duplicated"] is False and et["xnnpack_weight_cache"] is True
        assert r["kv_cache_bytes"] > 0
    finally:
        assert w.close() == 0
    # Without the weight cache every instance packs its own weights: it costs more.
    w = start(worker_bin, program, "--capacity", "2", "--xnnpack-weight-cache", "off")
    try:
        off = w.ready["executorch"]
        assert off["xnnpack_weight_cache"] is False
        assert off["bytes_per_extra_slot"] > et["bytes_per_extra_slot"]
        assert off["weights_duplicated"] is True
        assert "the weights are duplicated per slot" in w.stderr_text()
    finally:
        assert w.close() == 0


def test_slots_are_capped_to_the_memory_budget(worker_bin):
    w = start(worker_bin, "tiny_sdpa", "--capacity", "4", "--memory-budget-bytes", "1")
    try:
        et = w.ready["executorch"]
        assert w.ready["capacity"] == 1 and et["capacity"] == 1 and et["slots_requested"] == 4
        assert "memory budget" in et["capped"]
        assert "serving 1 slots of the 4 requested" in w.stderr_text()
        _, done = w.generate(next(w.ids), prompt_segments=ids_prompt([10, 11, 12]), max_new_tokens=3)
        assert done["type"] == "done" and done["completion_tokens"] == 3
    finally:
        assert w.close() == 0


def test_interleaved_slots_give_each_slots_solo_greedy_ids(worker_bin, program):
    """Three generations in flight on three slots (their steps interleave: one forward call per
    slot per step) give exactly the ids each gives alone, which are the Python runtime's."""
    w = start(worker_bin, program, "--capacity", "3", "--min-shared-prefix", "0")
    try:
        cases = [reference(i) for i in range(len(expected()["cases"]))]
        solo = []
        for prompt, want in cases:
            _, d = w.generate(next(w.ids), prompt_segments=ids_prompt(prompt), max_new_tokens=32)
            assert d["generated_token_ids"] == want
            solo.append(d["generated_token_ids"])
        # Prompts of the other cases first, so every slot holds another conversation.
        w.generate(next(w.ids), prompt_segments=ids_prompt([7, 8, 9]), max_new_tokens=2)
        ids = [next(w.ids) for _ in cases]
        w.send_many([{"op": "generate", "id": i, "prompt_segments": ids_prompt(p), "max_new_tokens": 32}
                     for i, (p, _) in zip(ids, cases)])
        order: list[int] = []
        out = w.collect_many(ids, order=order)
        for i, want in zip(ids, solo):
            assert out[i][1]["type"] == "done" and out[i][1]["generated_token_ids"] == want
        # They really ran together: records of one id come between records of another.
        first_done = min(order.index(i) + len(out[i][0]) for i in ids)
        assert len(set(order[:first_done])) > 1
    finally:
        assert w.close() == 0


def test_spilled_session_continues_like_one_never_evicted(worker_bin, program):
    """Session s1 is evicted (two slots, two other sessions), spilled to host memory, restored
    when it returns, and continues with the ids of a worker where it was never evicted."""
    prompt1, _ = reference(1)
    follow = [40, 41, 42, 43]

    def conversation(w, evict):
        _, d1 = w.generate(next(w.ids), prompt_segments=ids_prompt(prompt1), max_new_tokens=8, session_id="s1")
        if evict:
            for s, p in (("s2", [20, 21, 22, 23]), ("s3", [30, 31, 32, 33])):
                _, d = w.generate(next(w.ids), prompt_segments=ids_prompt(p), max_new_tokens=4, session_id=s)
                assert d["type"] == "done"
        turn2 = prompt1 + d1["generated_token_ids"] + follow
        _, d2 = w.generate(next(w.ids), prompt_segments=ids_prompt(turn2), max_new_tokens=16, session_id="s1")
        return d2

    w = start(worker_bin, program, "--capacity", "2", "--min-shared-prefix", "0")
    try:
        evicted = conversation(w, evict=True)
    finally:
        assert w.close() == 0
    w = start(worker_bin, program, "--capacity", "2", "--min-shared-prefix", "0")
    try:
        kept = conversation(w, evict=False)
    finally:
        assert w.close() == 0
    assert evicted["prefill_plan"] == "restored"
    assert evicted["restored_prompt_tokens"] == kept["reused_prompt_tokens"] > len(prompt1)
    assert kept["prefill_plan"] == "exact_prefix"
    assert evicted["generated_token_ids"] == kept["generated_token_ids"] and len(kept["generated_token_ids"]) > 0


def test_shared_prefix_from_another_slot_is_cached_and_equals_a_cold_run(worker_bin, program):
    """While session a decodes in one slot, a new conversation b (anonymous: one slot always
    stays unbound), whose prompt shares a's first 30 tokens, starts in the other slot from a copy of a's state: 30 tokens cached, and the same output as
    a cold run of b's prompt."""
    base = [10 + (i * 11) % 300 for i in range(40)]
    prompt_b = base[:30] + [5, 6, 7]
    w = start(worker_bin, program, "--capacity", "2", "--min-shared-prefix", "8", "--test-step-delay-ms", "10")
    try:
        w.send({"op": "generate", "id": 1, "prompt_segments": ids_prompt(base), "max_new_tokens": 24,
                "session_id": "a"})
        _until_tokens(w, 1, 2)  # a is decoding: b cannot take its slot
        w.send({"op": "generate", "id": 2, "prompt_segments": ids_prompt(prompt_b), "max_new_tokens": 16})
        out = w.collect_many([1, 2])
    finally:
        assert w.close() == 0
    a, b = out[1][1], out[2][1]
    assert a["type"] == "done" and b["type"] == "done" and "spilled_session" not in b, (a, b)
    assert b["prefill_plan"] == "copied" and b["copy_source"] == "slot"
    assert b["copied_prompt_tokens"] == b["reused_prompt_tokens"] == 30
    cold = start(worker_bin, program, "--capacity", "1")
    try:
        _, c = cold.generate(next(cold.ids), prompt_segments=ids_prompt(prompt_b), max_new_tokens=16)
    finally:
        assert cold.close() == 0
    assert c["reused_prompt_tokens"] == 0
    assert b["generated_token_ids"] == c["generated_token_ids"]


def test_shared_prefix_from_a_spilled_session(worker_bin, program):
    """A spilled session's state is a prefix source too (copied, not taken): the new session
    reports the shared tokens as cached and its output equals a cold run's; the spilled session
    then still restores its own state."""
    base = [10 + (i * 13) % 300 for i in range(40)]
    prompt_b = base[:30] + [5, 6, 7]
    w = start(worker_bin, program, "--capacity", "2", "--min-shared-prefix", "8")
    try:
        _, a1 = w.generate(next(w.ids), prompt_segments=ids_prompt(base), max_new_tokens=4, session_id="a")
        for s, p in (("s2", [20, 21, 22, 23]), ("s3", [30, 31, 32, 33])):  # a is evicted and spilled
            w.generate(next(w.ids), prompt_segments=ids_prompt(p), max_new_tokens=2, session_id=s)
        _, b = w.generate(next(w.ids), prompt_segments=ids_prompt(prompt_b), max_new_tokens=16, session_id="b")
        _, a2 = w.generate(next(w.ids), prompt_segments=ids_prompt(base + a1["generated_token_ids"] + [9]),
                           max_new_tokens=4, session_id="a")
    finally:
        assert w.close() == 0
    assert b["prefill_plan"] == "copied" and b["copy_source"] == "spill"
    assert b["copied_prompt_tokens"] == b["reused_prompt_tokens"] == 30
    assert a2["prefill_plan"] == "restored" and a2["restored_prompt_tokens"] == len(base) + 3
    cold = start(worker_bin, program, "--capacity", "1")
    try:
        _, c = cold.generate(next(cold.ids), prompt_segments=ids_prompt(prompt_b), max_new_tokens=16)
    finally:
        assert cold.close() == 0
    assert b["generated_token_ids"] == c["generated_token_ids"]


def _until_tokens(w, rid, n):
    for _ in range(n):
        rec = w.record()
        assert rec["id"] == rid and rec["type"] == "token", rec


def test_cancel_mid_prefill_and_mid_decode_in_any_slot(worker_bin, program):
    """With every forward call slowed down (40 ms), a cancel lands inside one slot's long
    prefill while another slot decodes, then inside that slot's decode while a third prefills:
    each cancelled generation ends alone, and the others' ids are their solo ids."""
    (p0, want0), (p1, want1) = reference(0), reference(2)
    w = start(worker_bin, program, "--capacity", "3", "--min-shared-prefix", "0", "--test-step-delay-ms", "40",
              "--prefill-chunk", "64")
    try:
        long_prompt = [10 + (i % 300) for i in range(250)]  # 4 chunks of <= 64 tokens
        w.send({"op": "generate", "id": 1, "prompt_segments": ids_prompt(p0), "max_new_tokens": 32})
        _until_tokens(w, 1, 2)
        w.send({"op": "generate", "id": 2, "prompt_segments": ids_prompt(long_prompt), "max_new_tokens": 4})
        time.sleep(0.15)  # inside generation 2's prefill (4 chunks, >= 160 ms)
        w.cancel(2)
        w.send({"op": "generate", "id": 3, "prompt_segments": ids_prompt(p1), "max_new_tokens": 200})
        out: dict[int, dict] = {}
        toks: dict[int, int] = {1: 2, 2: 0, 3: 0}
        cancelled3 = False
        while len(out) < 3:
            rec = w.record()
            if rec["type"] == "token":
                toks[rec["id"]] += 1
                if rec["id"] == 3 and toks[3] == 3 and not cancelled3:
                    w.cancel(3)  # mid-decode of slot 3 while slot 1 may still run
                    cancelled3 = True
                continue
            out[rec["id"]] = rec
        assert out[2]["cancelled"] is True and out[2]["completion_tokens"] == 0 and toks[2] == 0
        assert out[3]["cancelled"] is True and 3 <= out[3]["completion_tokens"] < 200
        assert out[1]["type"] == "done" and out[1].get("cancelled") is not True
        assert out[1]["generated_token_ids"] == want0
        # Every slot is usable afterwards and gives its solo ids.
        _, d = w.generate(4, prompt_segments=ids_prompt(p1), max_new_tokens=32)
        assert d["generated_token_ids"] == want1
    finally:
        assert w.close() == 0


def test_capacity_flag_errors(worker_bin):
    r = subprocess.run([str(worker_bin), "--model", str(PROGRAMS["tiny"]), "--tokenizer", str(TOKENIZER),
                        "--capacity", "0"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "--capacity" in r.stderr and r.stdout == ""
    r = subprocess.run([str(worker_bin), "--model", str(PROGRAMS["tiny"]), "--tokenizer", str(TOKENIZER),
                        "--xnnpack-weight-cache", "maybe"], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "--xnnpack-weight-cache must be on or off" in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_slot_state_unit_tests(tmp_path, worker_bin):
    """cpp/tests/test_executorch_state.cpp (engine level: a saved state continues exactly in
    another slot, copies are complete, foreign / damaged / short states are refused), built
    against the same executorch wheel as the worker and run on both tiny programs."""
    site = sysconfig.get_paths()["purelib"]
    build = tmp_path / "build"
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DTRIOSERVE_BUILD_LLAMA=OFF",
                 "-DTRIOSERVE_BUILD_TESTS=ON", f"-DCMAKE_PREFIX_PATH={site}",
                 "-DCMAKE_BUILD_TYPE=Debug"]  # compiles faster; the tiny programs need no speed
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    binary = build / "test_executorch_state"
    for cmd in (configure, ["cmake", "--build", str(build), "-j2", "--target", "test_executorch_state"],
                [str(binary), str(PROGRAMS["tiny"].parent)]):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "test_executorch_state:" in result.stderr and " 0 failures" in result.stderr
