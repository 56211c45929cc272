"""The llama engine's greedy fast path (cpp/llama_engine.h ``pick``): at temperature 0 the
token is the first maximum of the logits row, read in place, instead of llama.cpp's greedy
sampler over a candidates array. Real model (slow): every output of a mixed set of prompts
(edits, tool calls, prose, JSON, a stop string, multibyte text, a grammar) is token for token
the same with the fast path and without it (``TRIOSERVE_LLAMA_GREEDY_FAST_PATH=0``), also
with speculative verification (which picks each drafted position the same way).
"""

from __future__ import annotations

import itertools

import pytest

from testkit.worker_process import Worker
from tests.worker_process.test_speculative import exactness_prompts


def _llama(bin_dir, model, fast: bool, *extra: str) -> Worker:
    # The profile line names the path the engine took, so the test sees the switch was honoured.
    env = {"TRIOSERVE_LLAMA_GREEDY_FAST_PATH": "1" if fast else "0", "TRIOSERVE_LLAMA_PROFILE": "1"}
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", "1",
                "--ctx", "2048", "--capacity", "2", "--min-shared-prefix", "0", *extra], env=env)
    w.wait_ready(180)
    w.ids = itertools.count(1)  # type: ignore[attr-defined]
    return w


def _outputs(w: Worker, prompts: list[dict]) -> list[tuple]:
    out = []
    for req in prompts:
        fields = {k: v for k, v in req.items() if k != "kind"}
        texts, done = w.generate(next(w.ids), **fields)  # type: ignore[attr-defined]
        assert done["type"] == "done", done
        out.append((req["kind"], "".join(texts), done["generated_token_ids"], done["finish_reason"]))
    return out


def _profile_line(w: Worker) -> str:
    assert w.proc.stdin is not None
    w.proc.stdin.close()
    assert w.proc.wait(30) == 0
    lines = [line for line in w.stderr_text().splitlines() if "profile:" in line]
    assert lines, w.stderr_text()
    return lines[-1]


@pytest.mark.slow
@pytest.mark.parametrize("speculative", ["off", "auto"])
def test_greedy_outputs_identical_with_and_without_fast_path(bin_dir, model, speculative):
    prompts = exactness_prompts(8, seed=3)  # one of each kind
    # A flat step cost makes auto verify every draft it finds (sample_draft's picks are tested).
    extra = ["--speculative", speculative] + (["--step-cost-ms", "1:1,64:1"] if speculative == "auto" else [])
    fast = _llama(bin_dir, model, True, *extra)
    slow = _llama(bin_dir, model, False, *extra)
    try:
        a = _outputs(fast, prompts)
        b = _outputs(slow, prompts)
        assert a == b
        assert all(ids for _, _, ids, _ in a)
        assert "greedy fast path on" in _profile_line(fast)
        assert "greedy fast path off" in _profile_line(slow)
    finally:
        fast.close()
        slow.close()
