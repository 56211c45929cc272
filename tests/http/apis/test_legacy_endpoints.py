"""Legacy and helper endpoints over real HTTP on the fake worker (spec §15): /v1/completions
(text and token-id prompts, streaming, fill-in-the-middle with the worker's FIM tokens, the 400
without them), /tokenize and /detokenize in llama-server's shapes, and the context window in
/v1/models.

The fake tokenizer is one token per UTF-8 byte; without a script the fake model echoes the
last 64 bytes of its prompt, so the output shows exactly which prompt the worker got.
"""

from __future__ import annotations

import openai
import pytest
import trio

from ..conftest import live_server

pytestmark = pytest.mark.usefixtures("no_leaks")


async def test_text_prompt_completion_echoes_the_raw_prompt(tmp_path):
    async with live_server(tmp_path) as server, server.client() as client:
        resp = await client.post("/v1/completions", json={"model": "fake", "prompt": "Once upon",
                                                           "max_tokens": 100})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        choice = body["choices"][0]
        # No chat template: the model saw exactly the prompt text.
        assert choice["text"] == "Once upon" and choice["finish_reason"] == "stop"
        assert body["usage"]["prompt_tokens"] == len("Once upon")
        assert body["usage"]["completion_tokens"] == len("Once upon")


async def test_token_id_prompt_and_default_max_tokens(tmp_path):
    ids = list(b"abcdefghijklmnopqrstuvwxyz")
    async with live_server(tmp_path) as server, server.client() as client:
        resp = await client.post("/v1/completions", json={"model": "fake", "prompt": [ids]})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        # OpenAI's default of 16 tokens for this endpoint.
        assert choice["text"] == "abcdefghijklmnop" and choice["finish_reason"] == "length"


async def test_streamed_completion_with_usage_through_the_openai_sdk(tmp_path):
    async with live_server(tmp_path) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x")
        stream = await client.completions.create(model="fake", prompt="stream me", max_tokens=50,
                                                 stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        await client.close()
        assert text == "stream me" and finish == "stop"
        assert usage is not None and usage.prompt_tokens == 9 and usage.completion_tokens == 9


async def test_suffix_builds_a_fim_prompt_from_the_workers_fim_tokens(tmp_path):
    async with live_server(tmp_path, worker_args="--fim-tokens") as server, server.client() as client:
        resp = await client.post("/v1/completions", json={
            "model": "fake", "prompt": "def f(x):\n    ", "suffix": "\n    return y", "max_tokens": 200})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        # <fim_prefix> prefix <fim_suffix> suffix <fim_middle>: 3 control tokens + the text bytes.
        assert body["usage"]["prompt_tokens"] == len("def f(x):\n    ") + len("\n    return y") + 3
        # The echo skips the control tokens: prefix then suffix, in PSM order.
        assert body["choices"][0]["text"] == "def f(x):\n    \n    return y"


async def test_suffix_without_fim_tokens_is_a_400_naming_it(tmp_path):
    async with live_server(tmp_path) as server, server.client() as client:
        resp = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "suffix": "b"})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["code"] == "unsupported_parameter" and error["param"] == "suffix"
        assert "fill-in-the-middle" in error["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"model": "fake"}, 400, "prompt"),
    ({"model": "fake", "prompt": 5}, 400, "prompt"),
    ({"model": "fake", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "fake", "prompt": [1, "x"]}, 400, "prompt[1]"),
    ({"model": "fake", "prompt": [1, 300]}, 400, "prompt"),  # outside the fake vocabulary
    ({"model": "fake", "prompt": ""}, 400, "prompt"),
    ({"model": "fake", "prompt": "a", "n": 2}, 400, "n"),
    ({"model": "fake", "prompt": "a", "echo": True}, 400, "echo"),
    ({"model": "fake", "prompt": "a", "logprobs": 3}, 400, "logprobs"),
    ({"model": "fake", "prompt": "a", "bogus": 1}, 400, "bogus"),
    ({"model": "other", "prompt": "a"}, 404, "model"),
])
async def test_bad_completion_requests_fail_with_the_parameter_named(tmp_path, body, status, param):
    async with live_server(tmp_path) as server, server.client() as client:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["param"] == param


async def test_disconnect_mid_stream_frees_the_slot(tmp_path):
    async with live_server(tmp_path, script=["x" * 5000, "next"], worker_args="--token-delay-ms 5",
                           slots=1) as server, server.client() as client:
        async with client.stream("POST", "/v1/completions", json={
                "model": "fake", "prompt": "go", "max_tokens": 4000, "stream": True}) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_bytes():
                break
        with trio.fail_after(10):
            while server.pool.busy:
                await trio.sleep(0.005)
        done = [r for r in server.pool.history if r.get("type") == "done"]
        assert done[0]["cancelled"] and done[0]["completion_tokens"] < 4000
        resp = await client.post("/v1/completions", json={"model": "fake", "prompt": "b",
                                                           "max_tokens": 3}, timeout=10)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "nex"


async def test_tokenize_and_detokenize_round_trip(tmp_path):
    async with live_server(tmp_path) as server, server.client() as client:
        resp = await client.post("/tokenize", json={"content": "héllo"})
        assert resp.status_code == 200, resp.text
        tokens = resp.json()["tokens"]
        assert tokens == list("héllo".encode())
        resp = await client.post("/detokenize", json={"tokens": tokens})
        assert resp.json() == {"content": "héllo"}
        # with_pieces: a byte that is not UTF-8 alone is given as its byte values.
        resp = await client.post("/tokenize", json={"content": "hé", "with_pieces": True})
        assert resp.json()["tokens"] == [{"id": 104, "piece": "h"}, {"id": 0xC3, "piece": [0xC3]},
                                         {"id": 0xA9, "piece": [0xA9]}]
        resp = await client.post("/tokenize", json={"content": ""})
        assert resp.json() == {"tokens": []}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 3}, "content"),
    ("/tokenize", {"content": "a", "extra": 1}, "extra"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [999]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
async def test_bad_tokenizer_requests_are_400s(tmp_path, path, body, param):
    async with live_server(tmp_path) as server, server.client() as client:
        resp = await client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


async def test_models_lists_the_context_window(tmp_path):
    async with live_server(tmp_path, max_context=3000) as server, server.client() as client:
        entry = (await client.get("/v1/models")).json()["data"][0]
        assert entry["context_length"] == 3000 and entry["max_model_len"] == 3000


# --- the real embedded model ---------------------------------------------------------------


def _llama_worker() -> str:
    import os
    from pathlib import Path
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""


@pytest.mark.slow
async def test_real_model_completion_tokenize_and_fim_refusal(tmp_path):
    """SmolLM2's GGUF has no FIM tokens (the worker reports none), so ``suffix`` is a 400; a
    plain completion continues the text; /tokenize ↔ /detokenize round-trips and parses its
    control tokens only with ``parse_special``."""
    from trioserve.config import Settings
    from trioserve.testing import serve_in_process

    settings = Settings(engine="llama", worker_bin=_llama_worker(), host="127.0.0.1", port=0,
                        log_level="warning", max_context=512, slots=1, threads=1)
    async with serve_in_process(settings, ready_timeout=120) as server:
        import httpx
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]
            assert model["context_length"] == 512 and model["max_model_len"] == 512
            resp = await client.post("/v1/completions", json={
                "model": model["id"], "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["text"]
            resp = await client.post("/v1/completions", json={
                "model": model["id"], "prompt": "def f(", "suffix": "):", "max_tokens": 4})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix"

            text = "Hello <|im_start|> world"
            special = (await client.post("/tokenize", json={"content": text})).json()["tokens"]
            plain = (await client.post("/tokenize", json={"content": text,
                                                          "parse_special": False})).json()["tokens"]
            assert 1 in special and 1 not in plain  # <|im_start|> is id 1 in SmolLM2
            back = (await client.post("/detokenize", json={"tokens": special})).json()["content"]
            assert back == text
            with_bos = (await client.post("/tokenize", json={"content": "Hi", "add_special": True})).json()
            assert with_bos["tokens"][0] == 1
            pieces = (await client.post("/tokenize", json={"content": "Hi there",
                                                           "with_pieces": True})).json()["tokens"]
            assert "".join(p["piece"] for p in pieces) == "Hi there"
