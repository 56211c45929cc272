"""Several models on one port (spec/README.md §2.1), black-box over HTTP on the fake worker:
each model is its own worker pool with its own script, so an answer shows which model's
worker produced it. Routing by ``model`` on Chat, Responses, Messages and completions,
aliases, the 404 listing, ``/v1/models``, per-model stored responses, per-model metrics, and
one model's worker killed while the other streams undisturbed."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import trio

from ..conftest import live_server, parse_sse

ALPHA_SAYS = "alpha speaking"
BETA_SAYS = "beta speaking, slowly and at length " * 6


def models_config(tmp_path: Path, *, beta_args: str = "", aliases: str = "") -> str:
    """Two fake models, each with its own script, both loaded at startup (``preload``; loads on
    demand are test_models_on_demand.py's); ``beta`` answers Claude's small-model names by a
    pattern alias."""
    for name, text in (("alpha", ALPHA_SAYS), ("beta", BETA_SAYS)):
        (tmp_path / f"{name}.json").write_text(json.dumps([text]))
    config = tmp_path / "models.toml"
    config.write_text(f"""
[[models]]
id = "alpha"
engine = "fake"
preload = true
[models.settings]
fake_script = "alpha.json"

[[models]]
id = "beta"
engine = "fake"
preload = true
aliases = ["claude-*haiku*"]
[models.settings]
fake_script = "beta.json"
worker_args = "{beta_args}"

[aliases]
{aliases}
""")
    return str(config)


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
            **extra}


async def test_each_model_answers_through_chat_responses_messages_and_completions(tmp_path):
    async with live_server(tmp_path, models_config=models_config(tmp_path)) as srv, \
            srv.client() as client:
        for model, says in (("alpha", ALPHA_SAYS), ("beta", BETA_SAYS)):
            resp = await client.post("/v1/chat/completions", json=chat(model))
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == model
            assert resp.json()["choices"][0]["message"]["content"] == says

            resp = await client.post("/v1/responses", json={"model": model, "input": "hi",
                                                             "max_output_tokens": 400})
            assert resp.status_code == 200, resp.text
            assert (resp.json()["model"], output_text(resp.json())) == (model, says)

            resp = await client.post("/v1/messages", json=chat(model))
            assert resp.status_code == 200, resp.text
            assert (resp.json()["model"], resp.json()["content"][0]["text"]) == (model, says)

            resp = await client.post("/v1/completions", json={"model": model, "prompt": "hi",
                                                              "max_tokens": 400})
            assert resp.status_code == 200, resp.text
            assert (resp.json()["model"], resp.json()["choices"][0]["text"]) == (model, says)

        # A stream reports the serving model too.
        async with client.stream("POST", "/v1/chat/completions",
                                 json=chat("beta", stream=True)) as resp:
            events = parse_sse(await resp.aread())
        assert {e["model"] for e in events if isinstance(e, dict)} == {"beta"}
        assert "".join(c["delta"].get("content") or "" for e in events if isinstance(e, dict)
                       for c in e["choices"]) == BETA_SAYS


async def test_aliases_and_unknown_names(tmp_path):
    async with live_server(tmp_path, models_config=models_config(tmp_path)) as srv, \
            srv.client() as client:
        # Claude Code's small-model name goes to beta by its pattern; the answer says so.
        resp = await client.post("/v1/messages", json=chat("claude-haiku-4-5-20251001"))
        assert resp.status_code == 200, resp.text
        assert (resp.json()["model"], resp.json()["content"][0]["text"]) == ("beta", BETA_SAYS)
        # Two models: no implicit claude-* rule; an unknown name lists what is served.
        for path in ("/v1/messages", "/v1/chat/completions"):
            resp = await client.post(path, json=chat("claude-sonnet-4-5"))
            assert resp.status_code == 404, resp.text
            error = resp.json()["error"]
            assert "'alpha', 'beta'" in error["message"]
        assert resp.json()["error"]["code"] == "model_not_found"
        # A large body's model is read too (off the event loop).
        big = chat("gamma")
        big["messages"][0]["content"] = "x" * 300_000
        resp = await client.post("/v1/chat/completions", json=big)
        assert resp.status_code == 404 and "'alpha', 'beta'" in resp.json()["error"]["message"]
        # Errors that come before the model in an API's order still do: no model, bad JSON.
        resp = await client.post("/v1/chat/completions", content=b"{",
                                 headers={"content-type": "application/json"})
        assert resp.status_code == 400
        resp = await client.post("/v1/chat/completions", json={"messages": []})
        assert resp.status_code == 400
        # The tokenizer routes take a model too; without one, the default model's.
        for body in ({"content": "hi", "model": "beta"}, {"content": "hi"}):
            resp = await client.post("/tokenize", json=body)
            assert resp.status_code == 200 and resp.json()["tokens"], resp.text
        resp = await client.post("/tokenize", json={"content": "hi", "model": "gamma"})
        assert resp.status_code == 404 and "'alpha', 'beta'" in resp.json()["error"]["message"]
        resp = await client.post("/detokenize", json={"tokens": [104, 105], "model": "alpha"})
        assert resp.status_code == 200, resp.text
        # Counting tokens routes by model as well.
        resp = await client.post("/v1/messages/count_tokens", json={
            "model": "nobody", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 404
    async with live_server(tmp_path, models_config=models_config(
            tmp_path, aliases='"*" = "alpha"')) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat("gpt-5-codex"))
        assert (resp.json()["model"], resp.json()["choices"][0]["message"]["content"]) == \
            ("alpha", ALPHA_SAYS)


async def test_models_list_every_model_with_its_state(tmp_path):
    async with live_server(tmp_path, models_config=models_config(tmp_path)) as srv, \
            srv.client() as client:
        listed = (await client.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["alpha", "beta"]
        for entry in listed:
            assert entry["state"] == "loaded"
            assert entry["context_length"] > 0 and "capabilities" in entry
        one = await client.get("/v1/models/beta")
        assert one.status_code == 200 and one.json()["id"] == "beta"
        missing = await client.get("/v1/models/gamma")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        health = (await client.get("/health")).json()
        assert health["status"] == "ready"
        assert [m["model"] for m in health["models"]] == ["alpha", "beta"]
        await client.post("/v1/chat/completions", json=chat("beta"))
        metrics = (await client.get("/metrics")).text
        assert 'trioserve_model_ready{model="alpha"} 1.0' in metrics
        assert 'trioserve_model_ready{model="beta"} 1.0' in metrics
        # The one generation is counted for beta, not alpha; its KV use is beta's.
        assert 'trioserve_model_generations_total{finish_reason="stop",model="beta"} 1.0' in metrics
        assert 'model="alpha"' not in "".join(
            line for line in metrics.splitlines() if line.startswith("trioserve_model_generations"))
        usage = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("trioserve_model_kv_cache_usage_ratio{")}
        assert usage["beta"] > 0 and usage["alpha"] == 0


async def test_stored_responses_belong_to_their_model(tmp_path):
    async with live_server(tmp_path, models_config=models_config(tmp_path)) as srv, \
            srv.client() as client:
        first = (await client.post("/v1/responses", json={"model": "beta", "input": "hi",
                                                          "max_output_tokens": 400})).json()
        stored = await client.get(f"/v1/responses/{first['id']}")
        assert stored.status_code == 200 and stored.json()["model"] == "beta"
        # Continuing on the same model works; from another model the id is not found (400).
        same = await client.post("/v1/responses", json={
            "model": "beta", "input": "more", "previous_response_id": first["id"],
            "max_output_tokens": 400})
        assert same.status_code == 200, same.text
        other = await client.post("/v1/responses", json={
            "model": "alpha", "input": "more", "previous_response_id": first["id"]})
        assert other.status_code == 400
        assert other.json()["error"]["code"] == "previous_response_not_found"
        assert "produced by the model 'beta'" in other.json()["error"]["message"]
        deleted = await client.delete(f"/v1/responses/{first['id']}")
        assert deleted.status_code == 200
        assert (await client.get(f"/v1/responses/{first['id']}")).status_code == 404


async def test_a_killed_model_worker_leaves_the_other_models_stream_undisturbed(tmp_path):
    async with live_server(tmp_path, models_config=models_config(
            tmp_path, beta_args="--token-delay-ms 10")) as srv, srv.client(timeout=30) as client:
        host = srv.services.host
        alpha_pool, beta_pool = host.services("alpha").pool, host.services("beta").pool
        doomed_pid = alpha_pool.worker_pid
        first = trio.Event()
        raw = bytearray()

        async def stream_beta() -> None:
            async with client.stream("POST", "/v1/chat/completions",
                                     json=chat("beta", stream=True)) as resp:
                assert resp.status_code == 200
                async for chunk in resp.aiter_bytes():
                    raw.extend(chunk)
                    if b"content" in raw:
                        first.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_beta)
            with trio.fail_after(10):
                await first.wait()
            # The stream holds its model (a load-on-demand host never unloads it meanwhile).
            assert (host.services("beta").active, host.services("alpha").active) == (1, 0)
            os.kill(doomed_pid, signal.SIGKILL)
        events = parse_sse(bytes(raw))
        assert events[-1] == "[DONE]"
        assert "".join(c["delta"].get("content") or "" for e in events if isinstance(e, dict)
                       for c in e["choices"]) == BETA_SAYS  # the whole answer
        assert beta_pool.restarts == 0
        with trio.fail_after(5):  # released when the request ends
            while host.services("beta").active:
                await trio.sleep(0.01)
        with trio.fail_after(15):
            while not (alpha_pool.restarts == 1 and alpha_pool.state == "ready"):
                await trio.sleep(0.01)
        resp = await client.post("/v1/chat/completions", json=chat("alpha"))
        assert resp.json()["choices"][0]["message"]["content"] == ALPHA_SAYS


async def test_a_model_that_cannot_be_kept_alive_leaves_the_others_serving(tmp_path):
    config = models_config(tmp_path, beta_args="--signal-after-tokens 0 --crash-signal sigill")
    async with live_server(tmp_path, models_config=config, max_crashes=2) as srv, \
            srv.client() as client:
        host = srv.services.host
        beta = host.services("beta").pool
        failed = await client.post("/v1/chat/completions", json=chat("beta"))
        assert failed.status_code == 503
        with trio.fail_after(15):
            while not beta.fatal.is_set():  # given up after its second start
                await client.post("/v1/chat/completions", json=chat("beta"))
                await trio.sleep(0.05)
        assert not host.fatal  # the server serves on (``trioserve serve`` does not exit)
        resp = await client.post("/v1/chat/completions", json=chat("alpha"))
        assert resp.json()["choices"][0]["message"]["content"] == ALPHA_SAYS
        health = (await client.get("/health")).json()
        beta_health = next(m for m in health["models"] if m["model"] == "beta")
        assert beta_health["crash"] == "illegal instruction (SIGILL)"
        assert host.services("alpha").pool.restarts == 0
