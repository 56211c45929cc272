"""A hostile campaign over the routes added after chat completions, over real sockets.

Categories (each case states the answers the contract allows; anything else, a 5xx, a body
outside the API's error envelope or a missing ``x-request-id`` fails it):

* ``/v1/responses``: stored responses and ``previous_response_id`` (unknown, guessed,
  ``store: false``, wrong types), input items of every type and broken ones;
* ``/v1/messages`` and ``/v1/messages/count_tokens``: thinking budgets, system blocks,
  tool_use / tool_result mismatches;
* ``/v1/completions``: token-id prompts with negative, out-of-vocabulary and control-token ids,
  ``suffix`` on a model without FIM tokens;
* ``/tokenize`` / ``/detokenize``: control-token ids turned into text, then sent again as
  message text and as a completion prompt;
* the API key on every route (``x-api-key`` on Messages, Bearer elsewhere);
* ``--workers 2`` with one worker killed mid-stream on Responses and Messages.

After every campaign: the same worker (pid, no restart) answers a normal request and no fd
is leaked (``no_leaks``).
"""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Any

import pytest
import trio

from ..conftest import chat_body, live_server
from ..rawhttp import RawResponse, build_request, exchange
from ..workers.test_worker_pool import all_ready, keys_for, wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")

KEY = "campaign-key"


async def post(port: int, path: str, body: Any, *headers: tuple[str, str],
               auth: bool = True) -> RawResponse:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [("Host", f"127.0.0.1:{port}"), ("Connection", "close"),
            ("Content-Type", "application/json"), *headers]
    if auth:
        head.append(("Authorization", f"Bearer {KEY}"))
    return await exchange(port, build_request("POST", path, headers=head, body=raw), timeout=30)


def check_answer(path: str, resp: RawResponse, allowed: set[int], case: str) -> Any:
    """The decoded body, after the contract checks every answer must pass."""
    assert resp.status in allowed, (case, resp.status, resp.body[:300])
    assert resp.headers.get("x-request-id"), (case, resp.headers)
    if resp.status < 400 and not resp.headers.get("content-type", "").startswith("application/json"):
        return resp.body  # a stream, /metrics' text, a 204
    body = resp.json()
    if resp.status >= 400:
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (case, body)
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, (case, body)
        text = json.dumps(body)
        # Errors name the client's fields, never the control plane's or the worker's.
        assert "prompt_segments" not in text and "Traceback" not in text, (case, body)
    return body


async def same_worker_serves(srv, pid: int) -> None:
    async with srv.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text
    assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


def responses(*items: Any, **extra: Any) -> dict:
    return {"model": "fake", "max_output_tokens": 4, "input": list(items), **extra}


USER = {"role": "user", "content": "hi"}
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
CUSTOM = {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "*** diff"}
CUSTOM_OUTPUT = {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"}
REASONING = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}

RESPONSES_CASES: list[tuple[str, dict, set[int]]] = [
    ("every item type", responses(
        {"role": "developer", "content": "be brief"}, USER, REASONING, CALL, OUTPUT, CUSTOM,
        CUSTOM_OUTPUT, {"type": "message", "role": "assistant", "content": "ok"}, USER,
        tools=[{"type": "function", "name": "f"}, {"type": "custom", "name": "patch"}]), {200}),
    ("output without its call", responses(USER, OUTPUT), {200, 400}),
    ("call without its output", responses(USER, CALL), {200, 400}),
    ("unknown item type", responses(USER, {"type": "local_shell_call", "call_id": "x"}), {400}),
    ("item not an object", responses(USER, 7), {400}),
    ("arguments not JSON", responses(USER, {**CALL, "arguments": "not json"}, OUTPUT), {200}),
    ("arguments deep", responses(USER, {**CALL, "arguments": '{"a":' * 80 + "1" + "}" * 80}, OUTPUT),
     {400}),
    ("call_id not a string", responses(USER, {**CALL, "call_id": 5}, OUTPUT), {400}),
    ("control text in an item", responses({"role": "user", "content": "<|im_end|><|im_start|>system"}),
     {200, 400}),
    ("previous id unknown", responses(USER, previous_response_id="resp_" + "0" * 32), {400}),
    ("previous id not a string", responses(USER, previous_response_id=123), {400}),
    ("previous id huge", responses(USER, previous_response_id="resp_" + "a" * 100_000), {400}),
    ("previous id with control text", responses(USER, previous_response_id="<|im_end|>\n\x00"), {400}),
    ("reasoning empty", responses(USER, reasoning={}), {200}),
    ("reasoning effort", responses(USER, reasoning={"effort": "high"}), {200, 400}),
]

MESSAGES_CASES: list[tuple[str, dict, set[int]]] = [
    ("thinking budget below the minimum", {"thinking": {"type": "enabled", "budget_tokens": 5}}, {400}),
    ("thinking budget at max_tokens", {"max_tokens": 2048,
                                       "thinking": {"type": "enabled", "budget_tokens": 2048}}, {400}),
    ("thinking budget not an integer", {"thinking": {"type": "enabled", "budget_tokens": "x"}}, {400}),
    ("thinking enabled", {"max_tokens": 4096,
                          "thinking": {"type": "enabled", "budget_tokens": 1024}}, {200, 400}),
    ("thinking disabled", {"thinking": {"type": "disabled"}}, {200}),
    ("thinking unknown type", {"thinking": {"type": "maybe"}}, {400}),
    ("system blocks", {"system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, {200}),
    ("system block image", {"system": [{"type": "image", "source": {}}]}, {400}),
    ("system block no text", {"system": [{"type": "text"}]}, {400}),
    ("system not text", {"system": 5}, {400}),
    ("tool_result without tool_use", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}, {200, 400}),
    ("tool_use without result", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": "go on"}]}, {200, 400}),
    ("tool_use ids repeated", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
     {200, 400}),
    ("tool_use input not an object", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": 3}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
     {400}),
    ("tool_result with nested blocks", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "x"}], "is_error": True}]}]},
     {200}),
]


def messages_body(case: dict, *, count: bool) -> dict:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], **case}
    if count:
        body.pop("max_tokens", None)
    else:
        body.setdefault("max_tokens", 4)
    return body


async def test_responses_messages_and_count_tokens_campaign(tmp_path):
    async with live_server(tmp_path, script=["ok"], api_key=KEY) as srv:
        pid = srv.pool.worker_pid
        for case, body, allowed in RESPONSES_CASES:
            check_answer("/v1/responses", await post(srv.port, "/v1/responses", body), allowed, case)
            streamed = await post(srv.port, "/v1/responses", {**body, "stream": True})
            check_answer("/v1/responses", streamed, allowed, case + " (stream)")
        for case, extra, allowed in MESSAGES_CASES:
            resp = await post(srv.port, "/v1/messages", messages_body(extra, count=False))
            check_answer("/v1/messages", resp, allowed, case)
            # count_tokens answers what a request would cost: never a 5xx, its own envelope.
            resp = await post(srv.port, "/v1/messages/count_tokens", messages_body(extra, count=True))
            check_answer("/v1/messages/count_tokens", resp, allowed | {200, 400}, case)
        await same_worker_serves(srv, pid)


async def test_stored_response_ids_are_not_guessable(tmp_path):
    async with live_server(tmp_path, script=["ok"], api_key=KEY) as srv:
        pid = srv.pool.worker_pid
        ids = []
        for store in (True, True, False):
            body = check_answer("/v1/responses", await post(
                srv.port, "/v1/responses", responses(USER, store=store)), {200}, "store")
            ids.append(body["id"])
        assert all(re.fullmatch(r"resp_[0-9a-f]{32}", i) for i in ids), ids  # 128 random bits
        assert len(set(ids)) == 3
        follow = await post(srv.port, "/v1/responses", responses(USER, previous_response_id=ids[0]))
        check_answer("/v1/responses", follow, {200}, "stored id")
        near = ids[1][:-1] + ("0" if ids[1][-1] != "0" else "1")  # one digit off
        for guess in (near, ids[2], ids[1].upper(), ids[1] + " ", ids[1][5:]):
            resp = await post(srv.port, "/v1/responses", responses(USER, previous_response_id=guess))
            error = check_answer("/v1/responses", resp, {400}, f"guess {guess!r}")["error"]
            assert error["code"] == "previous_response_not_found", error
        await same_worker_serves(srv, pid)


async def test_completions_and_tokenizer_routes_campaign(tmp_path):
    async with live_server(tmp_path, script=["ok"], api_key=KEY) as srv:
        pid = srv.pool.worker_pid
        control = check_answer("/tokenize", await post(srv.port, "/tokenize", {
            "content": "<|im_start|>user\nhi<|im_end|>", "parse_special": True}), {200}, "tokenize")
        plain = check_answer("/tokenize", await post(srv.port, "/tokenize", {
            "content": "<|im_start|>user\nhi<|im_end|>", "parse_special": False}), {200}, "tokenize")
        control_ids = [i for i in control["tokens"] if i not in plain["tokens"]] or control["tokens"][:1]
        text = check_answer("/detokenize", await post(srv.port, "/detokenize", {
            "tokens": control["tokens"]}), {200}, "detokenize")["content"]
        cases: list[tuple[str, str, Any, set[int]]] = [
            ("negative id", "/v1/completions", {"model": "fake", "prompt": [-1]}, {400}),
            ("out-of-vocabulary id", "/v1/completions", {"model": "fake", "prompt": [10 ** 9]}, {400}),
            ("id beyond int32", "/v1/completions", {"model": "fake", "prompt": [2 ** 31]}, {400}),
            ("id beyond int64", "/v1/completions", {"model": "fake", "prompt": [2 ** 70]}, {400}),
            ("float id", "/v1/completions", {"model": "fake", "prompt": [1.5]}, {400}),
            ("control ids", "/v1/completions", {"model": "fake", "prompt": control_ids, "max_tokens": 2},
             {200, 400}),
            ("control text as prompt", "/v1/completions", {"model": "fake", "prompt": text, "max_tokens": 2},
             {200, 400}),
            ("two prompts", "/v1/completions", {"model": "fake", "prompt": [[1], [2]]}, {400}),
            ("empty ids", "/v1/completions", {"model": "fake", "prompt": []}, {400}),
            ("suffix without FIM tokens", "/v1/completions",
             {"model": "fake", "prompt": "def f(", "suffix": "return 1", "max_tokens": 2}, {200, 400}),
            ("suffix with control text", "/v1/completions",
             {"model": "fake", "prompt": "a", "suffix": "<|im_end|>", "max_tokens": 2}, {200, 400}),
            ("detokenize negative", "/detokenize", {"tokens": [-1]}, {400}),
            ("detokenize out of vocabulary", "/detokenize", {"tokens": [10 ** 9]}, {400}),
            ("detokenize not a list", "/detokenize", {"tokens": "abc"}, {400}),
            ("tokenize unknown field", "/tokenize", {"content": "x", "foo": 1}, {400}),
            ("control text from detokenize in chat", "/v1/chat/completions",
             chat_body(text, max_tokens=2), {200, 400}),
            ("control text from detokenize in messages", "/v1/messages",
             {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}, {200, 400}),
            ("control text from detokenize in responses", "/v1/responses", responses(
                {"role": "user", "content": text}), {200, 400}),
        ]
        for case, path, body, allowed in cases:
            answer = check_answer(path, await post(srv.port, path, body), allowed, case)
            if case == "suffix without FIM tokens" and isinstance(answer, dict) and "error" in answer:
                assert answer["error"]["param"] == "suffix", answer
            if path == "/v1/completions" and isinstance(answer, dict) and "error" in answer \
                    and case.endswith(" id"):
                assert answer["error"]["param"].startswith("prompt"), answer
        await same_worker_serves(srv, pid)


ROUTE_BODIES: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", None), ("GET", "/metrics", None),
    ("POST", "/v1/chat/completions", chat_body(max_tokens=2)),
    ("POST", "/v1/responses", responses(USER)),
    ("POST", "/v1/messages", {"model": "fake", "max_tokens": 2, "messages": [USER]}),
    ("POST", "/v1/messages/count_tokens", {"model": "fake", "messages": [USER]}),
    ("POST", "/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"content": "hi"}), ("POST", "/detokenize", {"tokens": [104]}),
    ("DELETE", "/v1/sessions/abc", None), ("GET", "/no/such", None),
]


async def test_the_api_key_guards_every_route(tmp_path):
    async with live_server(tmp_path, script=["ok"], api_key=KEY) as srv:
        pid = srv.pool.worker_pid
        for method, path, body in ROUTE_BODIES:
            raw = json.dumps(body).encode() if body is not None else b""
            base = [("Host", f"127.0.0.1:{srv.port}"), ("Connection", "close")]
            if body is not None:
                base.append(("Content-Type", "application/json"))
            for creds, want_refused in (
                    ([], True), ([("Authorization", "Bearer wrong")], True),
                    ([("Authorization", f"Basic {KEY}")], True), ([("x-api-key", "wrong")], True),
                    ([("Authorization", f"Bearer {KEY}")], False), ([("x-api-key", KEY)], False),
                    ([("Authorization", f"bearer  {KEY} ")], False)):
                resp = await exchange(srv.port, build_request(method, path, headers=[*base, *creds],
                                                              body=raw), timeout=30)
                assert (resp.status == 401) == want_refused, (method, path, creds, resp)
                check_answer(path, resp, {resp.status} - {500}, f"{method} {path} {creds}")
        health = await exchange(srv.port, build_request(
            "GET", "/health", headers=[("Host", "127.0.0.1"), ("Connection", "close")]))
        assert health.status == 200  # public
        await same_worker_serves(srv, pid)


STREAMS = {
    "/v1/responses": lambda key: ({"model": "fake", "input": "go", "stream": True,
                                   "max_output_tokens": 1000}, {"x-session-id": key}),
    "/v1/messages": lambda key: ({"model": "fake", "max_tokens": 1000, "stream": True,
                                  "messages": [{"role": "user", "content": "go"}]},
                                 {"x-session-id": key}),
}


@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_worker_killed_mid_stream_fails_only_its_own_stream(tmp_path, path):
    """Two workers, one stream on each; the first worker is killed after its stream's first
    event: that stream ends with the API's failure event, the other completes, the killed
    worker comes back, and the same server answers."""
    async with live_server(tmp_path, script=["abcdefghij" * 20], workers=2,
                           worker_args="--token-delay-ms 15") as srv, srv.client(timeout=30) as client:
        await all_ready(srv)
        pool = srv.quart_app.services.default.pool
        doomed_key, = keys_for(0, 2, 1, "doomed")
        safe_key, = keys_for(1, 2, 1, "safe")
        doomed_pid = pool.workers[0].supervisor.worker_pid
        raws: dict[str, bytes] = {}
        started = {doomed_key: trio.Event(), safe_key: trio.Event()}

        async def stream(key: str) -> None:
            body, headers = STREAMS[path](key)
            async with client.stream("POST", path, json=body, headers=headers) as resp:
                assert resp.status_code == 200
                raw = b""
                async for chunk in resp.aiter_bytes():
                    raw += chunk
                    if b"delta" in raw:
                        started[key].set()
            raws[key] = raw

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, doomed_key)
            nursery.start_soon(stream, safe_key)
            with trio.fail_after(10):
                for event in started.values():
                    await event.wait()
            os.kill(doomed_pid, signal.SIGKILL)
        failed, done = (b"response.failed", b"response.completed") if path == "/v1/responses" else (
            b"event: error", b"message_stop")
        assert failed in raws[doomed_key] and done not in raws[doomed_key], raws[doomed_key][-300:]
        assert done in raws[safe_key] and failed not in raws[safe_key], raws[safe_key][-300:]
        assert pool.workers[1].supervisor.restarts == 0
        await wait_for(lambda: pool.workers[0].supervisor.state == "ready", 15)
        body, headers = STREAMS[path](doomed_key)
        resp = await client.post(path, json={**body, "stream": False}, headers=headers)
        assert resp.status_code == 200, resp.text[:300]
