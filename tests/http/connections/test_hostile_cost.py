"""Costly requests are refused before they cost everyone, over real sockets.

* A ``json_schema`` enum of 20,000 values: a 400 naming the limit, from the control plane.
* An enum at the limit (256 values) on the real model: served, the answer one of the values,
  while another stream runs (the grammar's full-vocabulary masks run on the worker's sampler
  thread, off the shared step: cpp/sample_worker.h; what that spares the bystander is
  measured by bench/hostile_bench.py).
* 20,000 and 110,000 empty chat messages on the real model (a prompt made almost only of
  template-level special tokens, which cost the square of their number in llama.cpp's
  tokenizer): a ``400 context_length_exceeded``, with no worker restart.
* The same on the fake worker, where the refusal must come from the control plane's early
  bound (turns × the template's tokens per turn, trioserve/core/turn_floor.py): the message states
  exactly that bound; and a long conversation that fits is served, its prompt at least that
  bound (the bound is a lower bound).

Each runs while a bystander stream is generating: the bystander completes normally. How long
the refusals take and the bystander's longest gap are measured by bench/hostile_bench.py,
never asserted here.
"""

from __future__ import annotations

import json
import os

import pytest
import trio

from trioserve.model.schema_subset import MAX_ENUM_VALUES

from ..conftest import chat_body, live_server, parse_sse
from ..rawhttp import exchange

pytestmark = pytest.mark.usefixtures("no_leaks")


def llama_worker() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return os.path.join(override, "trioserve-llama-worker") if override else ""  # "": installed


async def run_with_bystander(client, body: dict, bystander: dict,
                             path: str = "/v1/chat/completions"):
    """Send ``body`` to ``path`` while ``bystander`` streams (a chat completion); return
    (response, bystander events)."""
    events: list = []
    ready = trio.Event()

    async def stream() -> None:
        async with client.stream("POST", "/v1/chat/completions", json=bystander) as resp:
            assert resp.status_code == 200
            raw = b""
            async for chunk in resp.aiter_bytes():
                raw += chunk
                ready.set()
        events.extend(parse_sse(raw))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        await ready.wait()
        resp = await client.post(path, json=body)
    return resp, events


def assert_completed(events: list) -> None:
    assert events[-1] == "[DONE]"
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finishes[-1] in ("stop", "length"), finishes


async def test_enum_of_20000_values_is_refused_naming_the_limit(tmp_path):
    async with live_server(tmp_path, script=["d" * 60], worker_args="--token-delay-ms 5") as srv, \
            srv.client() as client:
        pid = srv.pool.worker_pid
        schema = {"type": "string", "enum": [f"value {i}" for i in range(20_000)]}
        body = chat_body(response_format={"type": "json_schema",
                                          "json_schema": {"name": "pick", "schema": schema}})
        resp, events = await run_with_bystander(client, body, chat_body(stream=True))
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "invalid_value"
        assert error["param"] == "response_format.json_schema.schema.enum"
        assert f"limit of {MAX_ENUM_VALUES} values" in error["message"]
        assert_completed(events)
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


@pytest.mark.parametrize("count", [20_000, 110_000])
async def test_many_empty_messages_are_refused_by_the_early_bound(tmp_path, count):
    async with live_server(tmp_path, script=["d" * 40], worker_args="--token-delay-ms 5",
                           max_body_bytes=8 << 20) as srv, srv.client(timeout=60) as client:
        pid = srv.pool.worker_pid
        body = chat_body(max_tokens=4)
        body["messages"] = [{"role": "user", "content": ""}] * count
        resp, events = await run_with_bystander(client, body, chat_body(stream=True))
        assert resp.status_code == 400, resp.text[:300]
        error = resp.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "invalid_request_error", "context_length_exceeded", "messages")
        floor = srv.quart_app.services.default.chat.core.turn_floor
        assert floor and floor > 0
        assert f"take at least {count * floor} tokens" in error["message"], error["message"]
        assert_completed(events)
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text


async def test_many_empty_messages_on_the_messages_api_are_refused_by_the_early_bound(tmp_path):
    async with live_server(tmp_path, script=["d" * 40], worker_args="--token-delay-ms 5",
                           max_body_bytes=8 << 20) as srv, srv.client(timeout=60) as client:
        pid = srv.pool.worker_pid
        body = {"model": "fake", "max_tokens": 4,
                "messages": [{"role": "user", "content": ""}] * 20_000}
        resp, events = await run_with_bystander(client, body, chat_body(stream=True),
                                                path="/v1/messages")
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["type"] == "error"
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error"
        floor = srv.quart_app.services.default.chat.core.turn_floor
        assert floor and f"take at least {20_000 * floor} tokens" in error["message"], error
        assert_completed(events)
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        resp = await client.post("/v1/messages", json={
            "model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("path, body, param", [
    # Chat Completions with content parts, Messages with text blocks, Responses input items.
    ("/v1/chat/completions", chat_body(max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": ""}]}] * 20_000), "messages"),
    ("/v1/messages", {"model": "fake", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}]}] * 20_000}, None),
    ("/v1/responses", {"model": "fake", "max_output_tokens": 4, "input": [
        {"role": "user", "content": ""}, {"role": "user", "content": [{"type": "input_text", "text": ""}]},
        {"type": "message", "role": "user", "content": ""}] * 7_000}, "input"),
])
async def test_other_shapes_of_many_empty_turns_are_refused_by_the_early_bound(tmp_path, path, body,
                                                                               param):
    async with live_server(tmp_path, script=["d" * 40], worker_args="--token-delay-ms 5",
                           max_body_bytes=8 << 20) as srv, srv.client(timeout=60) as client:
        pid = srv.pool.worker_pid
        turns = len(body.get("messages") or body.get("input"))
        resp, events = await run_with_bystander(client, body, chat_body(stream=True), path=path)
        assert resp.status_code == 400, resp.text[:300]
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error"
        floor = srv.quart_app.services.default.chat.core.turn_floor
        assert floor and f"take at least {turns * floor} tokens" in error["message"], error
        if param is not None:
            assert (error["code"], error["param"]) == ("context_length_exceeded", param)
        assert_completed(events)
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text


def chunked(body: bytes, piece: int = 65536) -> bytes:
    """``body`` in chunked transfer coding, ending with the zero-size chunk."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece])
                   for i in range(0, len(body), piece))
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": "fake", "max_output_tokens": 4,
                       "input": [{"role": "user", "content": ""}] * 20_000}),
    ("/v1/messages", {"model": "fake", "max_tokens": 4,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}] * 20_000}),
])
async def test_many_turns_over_raw_sockets_with_good_and_broken_framing(tmp_path, path, body):
    """The early refusal behind real framing: the body chunked (refused by the turn bound),
    chunked with a broken last chunk, and cut short by the client (each ends only its own
    connection); then the same server answers with the same worker."""
    async with live_server(tmp_path, script=["ok"], max_body_bytes=8 << 20) as srv:
        pid = srv.pool.worker_pid
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                "Connection: close\r\n").encode()
        whole = await exchange(srv.port, head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(payload))
        assert whole.status == 400, whole.body[:300]
        assert "take at least" in whole.json()["error"]["message"]
        broken = chunked(payload)[:-5] + b"zz\r\n"  # the terminating chunk replaced by garbage
        bad = await exchange(srv.port, head + b"Transfer-Encoding: chunked\r\n\r\n" + broken)
        assert bad.status == 400 and bad.headers["connection"] == "close", bad
        assert bad.json()["error"]["code"] == "invalid_http_request"
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)  # half a body, then gone
        await stream.send_all(head + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload[:len(payload) // 2])
        await stream.aclose()
        async with srv.client() as client:
            resp = await client.post("/v1/chat/completions", json=chat_body())
            assert resp.status_code == 200, resp.text
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


async def test_responses_assistant_items_are_not_counted_as_turns(tmp_path):
    """Consecutive assistant items are one turn on /v1/responses: 9,000 of them (below the
    bound on items, limits.MAX_CONVERSATION_ITEMS) must not be refused by the per-turn bound:
    they are served as one turn (the fake's tokens are bytes: the joined turn is ~9,000 of
    them, far below 9,000 turns × the floor)."""
    async with live_server(tmp_path, script=["ok"], max_body_bytes=8 << 20, max_context=32768) as srv, \
            srv.client(timeout=60) as client:
        body = {"model": "fake", "max_output_tokens": 2,
                "input": [{"role": "user", "content": "hi"}]
                + [{"role": "assistant", "content": ""}] * 9_000 + [{"role": "user", "content": "go"}]}
        resp = await client.post("/v1/responses", json=body)
        # Counted as 9,002 turns, the fake's floor (28 tokens a turn) would refuse it.
        assert "take at least" not in resp.text, resp.text[:300]
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["usage"]["input_tokens"] < 32768


async def test_a_long_conversation_that_fits_is_served_and_meets_the_bound(tmp_path):
    turns = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}]
    async with live_server(tmp_path, script=["ok"], max_context=16384) as srv, \
            srv.client() as client:
        body = chat_body(max_tokens=2)
        body["messages"] = turns * 50 + [{"role": "user", "content": ""}]
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text[:300]
        floor = srv.quart_app.services.default.chat.core.turn_floor
        assert floor and floor > 0
        assert resp.json()["usage"]["prompt_tokens"] >= 101 * floor


@pytest.mark.slow
@pytest.mark.parametrize("count", [20_000, 110_000])
async def test_many_empty_messages_are_refused_without_stalling_the_worker(tmp_path, count):
    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(), threads=2,
                           max_body_bytes=8 << 20) as srv, srv.client(timeout=120) as client:
        pid = srv.pool.worker_pid
        body = {"model": srv.settings.resolved_model_id(), "max_tokens": 4,
                "messages": [{"role": "user", "content": ""}] * count}
        bystander = {"model": srv.settings.resolved_model_id(), "stream": True, "max_tokens": 24,
                     "temperature": 0, "messages": [{"role": "user", "content": "Count to ten."}]}
        resp, events = await run_with_bystander(client, body, bystander)
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert_completed(events)
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        print(json.dumps({"messages": count, "error": resp.json()["error"]["message"]}))


@pytest.mark.slow
async def test_an_enum_at_the_limit_is_served_while_another_stream_runs(tmp_path):
    values = [f"value number {i}" for i in range(MAX_ENUM_VALUES)]
    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(), threads=2) as srv, \
            srv.client(timeout=120) as client:
        pid = srv.pool.worker_pid
        model = srv.settings.resolved_model_id()
        schema = {"type": "string", "enum": values}
        body = {"model": model, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": "Pick one."}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "pick", "schema": schema}}}
        bystander = {"model": model, "stream": True, "max_tokens": 48, "temperature": 0,
                     "messages": [{"role": "user", "content": "Count to ten."}]}
        resp, events = await run_with_bystander(client, body, bystander)
        assert resp.status_code == 200, resp.text[:300]
        content = resp.json()["choices"][0]["message"]["content"]
        assert json.loads(content) in values, content
        assert_completed(events)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        assert text.strip(), events  # the bystander said something
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
