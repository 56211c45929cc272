"""The ExecuTorch engine end to end over real HTTP, on the committed tiny random Llama .pte:
the control plane tokenizes with tokenizer.json and the worker runs the program.

Greedy outputs are checked against the ids ExecuTorch's Python runtime produced for the same
prompt (tests/data/executorch/expected.json); cancellation uses the worker's test-only
``--test-step-delay-ms`` so a cancel can land inside a decode step or a long prefill.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio
from tokenizers import Tokenizer

from testkit.executorch_assets import PTE, TOKENIZER, expected, executorch_worker

from ..conftest import live_server, parse_sse
from ..connections.test_cancellation import cancelled_ids, open_raw_request, read_until, wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")

MODEL = "tiny"


def et_server(tmp_path, **overrides: Any):
    return live_server(tmp_path, engine="executorch", worker_bin=str(executorch_worker()),
                       model_path=str(PTE), tokenizer_path=str(TOKENIZER), threads=1, **overrides)


def body(messages: list[dict[str, str]] | str, **extra: Any) -> dict[str, Any]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {"model": MODEL, "messages": messages, "temperature": 0, **extra}


def reference_text(case: int) -> tuple[str, int]:
    """The reply ExecuTorch's Python runtime gives for expected case `case` (up to EOS)."""
    c = expected()["cases"][case]
    ids = c["greedy_ids"]
    if expected()["eos_id"] in ids:
        ids = ids[: ids.index(expected()["eos_id"])]
    return Tokenizer.from_file(str(TOKENIZER)).decode(ids, skip_special_tokens=False), len(ids)


async def test_chat_streaming_matches_the_python_runtime(tmp_path):
    want, n = reference_text(0)  # its prompt is this chat rendered by the ChatML template
    question = "Hello there, how are you today?"
    async with et_server(tmp_path) as srv, srv.client() as client:
        ready = srv.pool
        resp = await client.post("/v1/chat/completions", json=body(question, max_tokens=32))
        assert resp.status_code == 200, resp.text
        plain = resp.json()
        async with client.stream("POST", "/v1/chat/completions",
                                 json=body(question, max_tokens=32, stream=True,
                                           stream_options={"include_usage": True})) as s:
            assert s.status_code == 200
            events = parse_sse(await s.aread())
    assert ready.restarts == 0
    assert plain["choices"][0]["message"]["content"] == want
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == n
    assert plain["usage"]["prompt_tokens"] == len(expected()["cases"][0]["prompt_ids"])
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == want
    assert events[-2]["usage"]["completion_tokens"] == n
    # The second identical request reused the resident prompt (warm slot).
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_four_turn_session_resumes_warm_and_equals_a_cold_run(tmp_path):
    headers = {"x-session-id": "conv-1"}
    messages: list[dict[str, str]] = []
    usages = []
    replies = []
    # One slot: the "cold" run below relies on another conversation taking the session's slot.
    async with et_server(tmp_path, slots=1) as srv, srv.client() as client:
        for turn, question in enumerate(["Hi!", "Count: one two", "three four", "and five?"]):
            messages.append({"role": "user", "content": question})
            resp = await client.post("/v1/chat/completions", json=body(messages, max_tokens=10), headers=headers)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            usages.append(out["usage"])
            replies.append(out["choices"][0]["message"]["content"])
            if turn < 3:
                messages.append({"role": "assistant", "content": replies[-1]})
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
        assert cached[0] == 0
        for k in (1, 2, 3):
            # Everything the previous turn left resident is reused: its prompt and its reply
            # (less the last token when the reply was cut by max_tokens: it was never fed back).
            prev = usages[k - 1]
            assert cached[k] >= prev["prompt_tokens"] + prev["completion_tokens"] - 1, (k, cached, usages)
            assert usages[k]["prompt_tokens"] > cached[k]
        # Cold: another conversation takes the slot, then the fourth turn again in full.
        other = await client.post("/v1/chat/completions", json=body("unrelated text", max_tokens=2))
        assert other.status_code == 200
        cold = await client.post("/v1/chat/completions", json=body(messages, max_tokens=10), headers=headers)
        assert cold.status_code == 200
        cold_usage = cold.json()["usage"]
        assert cold_usage["prompt_tokens"] == usages[3]["prompt_tokens"]
        assert cold_usage["prompt_tokens_details"]["cached_tokens"] < usages[0]["prompt_tokens"]
        assert cold.json()["choices"][0]["message"]["content"] == replies[3]
        assert cold_usage["completion_tokens"] == usages[3]["completion_tokens"]


async def test_slots_stream_at_once_and_share_a_prefix(tmp_path):
    """Three slots on one program load over HTTP: two conversations streamed at the same time
    each get exactly their solo reply, and a third whose system prompt another slot holds
    reports those tokens cached and gets the reply a one-slot server gives it cold."""
    system = {"role": "system", "content": "You are a terse assistant. " * 5}
    questions = ["Hello there, how are you today?", "Count: one two three", "Name a colour."]

    async def ask(client, question, sys_msg=None):
        messages = ([sys_msg] if sys_msg else []) + [{"role": "user", "content": question}]
        resp = await client.post("/v1/chat/completions", json=body(messages, max_tokens=24))
        assert resp.status_code == 200, resp.text
        return resp.json()

    async with et_server(tmp_path, slots=1) as srv, srv.client() as client:
        solo = [(await ask(client, q))["choices"][0]["message"]["content"] for q in questions[:2]]
        cold = await ask(client, questions[2], system)
    async with et_server(tmp_path, slots=3) as srv, srv.client() as client:
        assert srv.pool.capacity == 3
        together: dict[int, str] = {}

        async def one(i):
            together[i] = (await ask(client, questions[i]))["choices"][0]["message"]["content"]

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        await ask(client, "Another question entirely.", system)  # a slot now holds the system prompt
        shared = await ask(client, questions[2], system)
    assert [together[0], together[1]] == solo
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert shared["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert shared["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"]


async def test_disconnect_mid_decode_cancels_within_a_step(tmp_path):
    async with et_server(tmp_path, worker_args="--test-step-delay-ms 30") as srv:
        pid = srv.pool.worker_pid
        # A plain-text prompt whose greedy continuation has no EOS in 32 tokens (case 1).
        stream = await open_raw_request(srv, body(expected()["cases"][1]["prompt"], max_tokens=200, stream=True))
        await read_until(stream, b'"content":')
        await stream.aclose()
        t0 = time.monotonic()
        await wait_for(lambda: not srv.pool.busy, timeout=5)
        assert time.monotonic() - t0 < 2.0
        assert cancelled_ids(srv) == [1]
        async with srv.client() as client:
            resp = await client.post("/v1/chat/completions", json=body("again", max_tokens=2))
            assert resp.status_code == 200
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


async def test_disconnect_mid_prefill_cancels(tmp_path):
    # 300 ms per forward call; a ~200-token prompt is several calls of <= 64 tokens.
    async with et_server(tmp_path, worker_args="--test-step-delay-ms 300") as srv:
        stream = await open_raw_request(srv, body("the quick brown fox " * 30, max_tokens=4, stream=True))
        await wait_for(lambda: srv.pool.busy)
        await trio.sleep(0.4)
        await stream.aclose()
        t0 = time.monotonic()
        await wait_for(lambda: not srv.pool.busy, timeout=5)
        assert time.monotonic() - t0 < 1.5
        assert cancelled_ids(srv) == [1]
        done = [r for r in srv.pool.history if r.get("type") == "done"][-1]
        assert done["completion_tokens"] == 0
        assert srv.pool.restarts == 0


async def test_structured_output_is_rejected_not_ignored(tmp_path):
    """No grammar sampler in this engine: a JSON-schema request is a 400, never free text."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with et_server(tmp_path) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=body(
            "give json", max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "unsupported_parameter"
        ok = await client.post("/v1/chat/completions", json=body("hi", max_tokens=2))
        assert ok.status_code == 200
