"""Chat completions over real HTTP on the fake worker: shapes, streaming, stops, usage,
multibyte text, every rejection, context overflow, queue overflow and health states."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from trioserve.config import Settings
from trioserve.http.services import build_services
from trioserve.registry import RegistryError

from ..conftest import chat_body, fake_worker_path, live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

MULTIBYTE = "héllo wörld — 日本語 🎉"


async def test_health_and_models(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ready"
        models = await client.get("/v1/models")
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["fake"]
        # The context window (the fake's default: its "training context" 4096, max_context 0).
        assert models.json()["data"][0]["context_length"] == 4096
        assert models.json()["data"][0]["max_model_len"] == 4096
        assert models.json()["object"] == "list"


async def test_non_stream_completion_and_usage(tmp_path):
    async with live_server(tmp_path, script=["Hello there!"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body("hi"))
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "chat.completion"
        assert body["id"].startswith("chatcmpl-")
        assert body["model"] == "fake"
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "Hello there!"}
        assert choice["finish_reason"] == "stop"
        usage = body["usage"]
        # The fake tokenizer is one token per UTF-8 byte.
        assert usage["completion_tokens"] == len(b"Hello there!")
        prompt = srv.quart_app.services.default.core.template.render(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True)
        assert usage["prompt_tokens"] == len(prompt.encode())
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_stream_sequence_with_usage(tmp_path):
    async with live_server(tmp_path, script=[MULTIBYTE]) as srv, srv.client() as client:
        body = chat_body(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = await resp.aread()
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    role_chunks = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(role_chunks) == 1 and chunks[0] is role_chunks[0]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(MULTIBYTE.encode())
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == MULTIBYTE


async def test_stream_without_usage_has_no_usage_chunk(tmp_path):
    async with live_server(tmp_path, script=["abc"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        events = parse_sse(resp.content)
    assert events[-1] == "[DONE]"
    assert all(c["choices"] for c in events[:-1])
    assert all("usage" not in c or c["usage"] is None for c in events[:-1])


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_across_token_boundaries_never_leaks(tmp_path, stream):
    # Every byte is a token, so the multi-byte stop "END" straddles three tokens.
    async with live_server(tmp_path, script=["alpha beta END gamma"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stop=["END", "zzz"], stream=stream))
        assert resp.status_code == 200
        if stream:
            events = parse_sse(resp.content)
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1] if c["choices"])
            reasons = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
        else:
            text = resp.json()["choices"][0]["message"]["content"]
            reasons = [resp.json()["choices"][0]["finish_reason"]]
    assert text == "alpha beta "
    assert reasons == ["stop"]


async def test_multibyte_stream_every_delta_is_whole_text(tmp_path):
    async with live_server(tmp_path, script=[MULTIBYTE * 3]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = parse_sse(resp.content)
    deltas = [c["choices"][0]["delta"].get("content") for c in events[:-1] if c["choices"]]
    assert "\ufffd" not in "".join(d or "" for d in deltas)
    assert "".join(d or "" for d in deltas) == MULTIBYTE * 3


async def test_max_tokens_gives_length(tmp_path):
    async with live_server(tmp_path, script=["0123456789"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=4))
        body = resp.json()
        assert body["choices"][0]["message"]["content"] == "0123"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4
        resp = await client.post("/v1/chat/completions", json=chat_body(max_completion_tokens=2))
        assert resp.json()["usage"]["completion_tokens"] == 2


REJECTIONS = [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -0.5}, "presence_penalty"),
    ({"logit_bias": {"42": 3}}, "logit_bias"),
    # On the fake worker (no grammar support) constrained outputs are refused, never silently
    # unconstrained; tests/http/tools/test_structured.py covers them fully.
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
]


@pytest.mark.parametrize("extra,param", REJECTIONS, ids=[p for _, p in REJECTIONS])
async def test_unsupported_parameters_are_rejected(tmp_path, extra, param):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(**extra))
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["code"] == "unsupported_parameter"
        assert err["param"] == param
        assert srv.pool.dispatched == 0


async def test_all_unsupported_parameters_named_in_one_message(tmp_path):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(n=3, logprobs=True, presence_penalty=1))
        err = resp.json()["error"]
        for name in ("n", "logprobs", "presence_penalty"):
            assert name in err["message"]


INVALID = [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 5}, "stop"),
]


@pytest.mark.parametrize("extra,param", INVALID, ids=[f"{p}={e[p]}" for e, p in INVALID])
async def test_invalid_values_are_400_with_param(tmp_path, extra, param):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(**extra))
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param
        assert err["code"] in ("invalid_value", "invalid_type")


@pytest.mark.parametrize("body,code", [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (json.dumps({"model": "fake"}).encode(), "missing_required_parameter"),
    (json.dumps({"model": "fake", "messages": []}).encode(), "invalid_value"),
    (json.dumps({"model": "fake", "messages": [{"role": "wizard", "content": "x"}]}).encode(), "invalid_value"),
])
async def test_malformed_bodies(tmp_path, body, code):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"})
        assert resp.status_code == 400
        assert resp.headers["content-type"].startswith("application/json")
        assert resp.json()["error"]["code"] == code


async def test_unknown_model_unknown_route_wrong_method(tmp_path):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json={**chat_body(), "model": "gpt-9"})
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "model_not_found"
        assert resp.json()["error"]["param"] == "model"
        resp = await client.get("/v1/nothing")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
        resp = await client.get("/v1/chat/completions")
        assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"


async def test_body_over_limit_is_413(tmp_path):
    async with live_server(tmp_path, script=["x"], max_body_bytes=10_000) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body("x" * 20_000))
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("stream", [False, True])
async def test_context_overflow_is_400_before_any_stream_byte(tmp_path, stream):
    async with live_server(tmp_path, script=["x"], max_context=256) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body("word " * 100, stream=stream))
        assert resp.status_code == 400
        assert resp.headers["content-type"].startswith("application/json")
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded"
        assert "256" in err["message"]
        # The same server still serves a prompt that fits.
        ok = await client.post("/v1/chat/completions", json=chat_body("short"))
        assert ok.status_code == 200


async def test_queue_overflow_is_503_with_retry_after(tmp_path):
    async with live_server(tmp_path, script=["slow output"], queue_depth=1,
                           worker_args="--capacity 1 --token-delay-ms 100") as srv, srv.client() as client:
        results: list[httpx.Response] = []

        async def one() -> None:
            results.append(await client.post("/v1/chat/completions", json=chat_body()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)  # runs on the worker
            with trio.fail_after(5):
                while not srv.pool.busy:
                    await trio.sleep(0.005)
            nursery.start_soon(one)  # waits in the queue
            with trio.fail_after(5):
                while srv.pool.queued < 1:
                    await trio.sleep(0.005)
            nursery.start_soon(one)  # overflows
    statuses = sorted(r.status_code for r in results)
    assert statuses == [200, 200, 503]
    busy = next(r for r in results if r.status_code == 503)
    assert busy.json()["error"]["code"] == "server_busy"
    assert int(busy.headers["retry-after"]) >= 1


async def test_health_loading_then_ready(tmp_path):
    async with live_server(tmp_path, script=["x"], wait_ready=False,
                           worker_args="--slow-start-ms 1500") as srv, srv.client() as client:
        resp = await client.get("/health")
        assert resp.status_code == 503
        assert resp.json()["status"] == "loading"
        chat = await client.post("/v1/chat/completions", json=chat_body())
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "worker_unavailable"
        assert "retry-after" in chat.headers
        await srv.wait_state("ready")
        assert (await client.get("/health")).status_code == 200


async def test_missing_template_is_a_startup_error_unless_fallback(tmp_path):
    async with live_server(tmp_path, script=["x"], wait_ready=False,
                           worker_args="--no-chat-template") as srv, srv.client() as client:
        await srv.wait_state("unavailable")
        resp = await client.get("/health")
        # /health gives only the public reason; the detail is in the log and the supervisor.
        assert resp.status_code == 503 and resp.json()["reason"] == "unavailable"
        assert "chat template" in srv.pool.reason
        assert srv.pool.fatal.is_set()
    async with live_server(tmp_path, script=["fine"], chatml_fallback=True,
                           worker_args="--no-chat-template") as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.json()["choices"][0]["message"]["content"] == "fine"


async def test_reasoning_is_split_from_content(tmp_path):
    script = ["<think>Let me count: 1, 2.</think>\nTwo."] * 2
    async with live_server(tmp_path, script=script) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        message = resp.json()["choices"][0]["message"]
        assert message["content"] == "Two."
        assert message["reasoning_content"] == "Let me count: 1, 2."
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
    chunks = [c for c in parse_sse(resp.content)[:-1] if c["choices"]]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert (reasoning, content) == ("Let me count: 1, 2.", "Two.")
    first_content = next(i for i, c in enumerate(chunks) if c["choices"][0]["delta"].get("content"))
    assert all(not c["choices"][0]["delta"].get("reasoning_content") for c in chunks[first_content:])


async def test_hf_tokenizer_dir_template_is_used(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}[{{ m.content }}]{% endfor %}<go>",
        "bos_token": "<s>", "eos_token": "</s>"}))
    # Without a script the fake worker echoes the end of the prompt it was given.
    async with live_server(tmp_path, hf_tokenizer_dir=str(hf)) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body("hi"))
        assert resp.json()["choices"][0]["message"]["content"] == "[hi]<go>"


def test_unloadable_template_is_a_startup_error(tmp_path):
    """A template that cannot be read is found before any worker starts (the model's header
    and template are checked when the services are built): `trioserve serve` exits 2 with
    this one line instead of starting a worker that cannot serve."""
    settings = Settings(engine="fake", worker_bin=fake_worker_path(), hf_tokenizer_dir=str(tmp_path / "missing"))
    with pytest.raises(RegistryError, match="cannot load the chat template.*tokenizer_config.json"):
        build_services(settings)