"""A keyed session on a hybrid recurrent model over real HTTP (the fake worker's
``--recurrent``; spec §6.3): a thinking agent whose client sends the previous answer back
changed (its reasoning dropped) diverges from the slot right at the end of the previous
prompt. A recurrent state cannot be cut back there, so before checkpoints every such turn was
prefilled from zero (cached_tokens 0); now each turn resumes from the checkpoint the worker
took at the end of the previous prompt.

The fake tokenizer is one token per UTF-8 byte and its template is ChatML.
"""

from __future__ import annotations

from typing import Any

import pytest

from ..conftest import live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

THINKING_REPLY = "<think>Let me look at the files one by one first.</think>Here is the list."
ANSWER_ONLY = "Here is the list."


async def post(client, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(usage: dict[str, Any]) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("checkpoints", [4, 0], ids=["checkpoints", "no_checkpoints"])
async def test_turns_with_dropped_reasoning_reuse_the_previous_prompt(tmp_path, checkpoints):
    args = "--recurrent" + ("" if checkpoints else " --checkpoints 0")
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 8},
                                     {"role": "user", "content": "Give me the list."}]
    headers = {"x-session-id": "agent-1"}
    usages = []
    async with live_server(tmp_path, script=[THINKING_REPLY], worker_args=args) as srv, srv.client() as client:
        for n in range(4):
            body = await post(client, {"model": "fake", "messages": history, "temperature": 0}, headers)
            usages.append(body["usage"])
            # The client keeps only the answer: the template of a thinking model drops the
            # earlier turns' reasoning, so the next prompt differs right after this one.
            history = history + [{"role": "assistant", "content": ANSWER_ONLY},
                                 {"role": "user", "content": f"And part {n + 2}, please."}]
    assert cached(usages[0]) == 0
    for prev, cur in zip(usages, usages[1:]):
        if checkpoints:
            # The whole previous prompt (up to the assistant's turn start) comes from the
            # checkpoint; the spec allows 16 tokens of slack for templates that end a turn
            # differently than the next prompt continues it.
            assert cached(cur) >= prev["prompt_tokens"] - 16, usages
            assert cached(cur) <= prev["prompt_tokens"]
        else:
            assert cached(cur) == 0, usages  # append-only: a changed answer is a cold turn


@pytest.mark.parametrize("keyed", [True, False], ids=["sessions", "anonymous"])
async def test_sessions_sharing_a_system_prompt_start_from_its_checkpoint(tmp_path, keyed):
    """Sessions 2-4 share only the system prompt with session 1. A recurrent state cannot be cut
    back to it, so they reuse it only through the checkpoint the first session's slot took
    where the control plane marked the system prompt's end (checkpoint_hints.py); the
    worker's checkpoint memory is in /metrics."""
    system = "You are a careful coding agent. Read before you edit. " * 12
    async with live_server(tmp_path, script=[ANSWER_ONLY], worker_args="--recurrent", slots=4) as srv, \
            srv.client() as client:
        usages = []
        for n in range(4):
            headers = {"x-session-id": f"s{n}"} if keyed else {}
            body = await post(client, {"model": "fake", "temperature": 0, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": f"Task {n}: list the files."}]},
                headers)
            usages.append(body["usage"])
        metrics = (await client.get("/metrics")).text
    n_system = len(f"<|im_start|>system\n{system}<|im_end|>\n".encode())  # one token a byte
    assert cached(usages[0]) == 0
    for usage in usages[1:]:
        assert n_system - 16 <= cached(usage) <= n_system + 16, usages
    line = next(line for line in metrics.splitlines() if line.startswith("trioserve_checkpoint_bytes{"))
    assert float(line.rsplit(" ", 1)[1]) > 0
