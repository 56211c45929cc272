"""Two real models on one port (spec/README.md §2.1): SmolLM2-135M and Gemma 3 270M through
llama.cpp, each its own worker, reached through Chat Completions, Responses and Messages by
id and by an alias; each answer names the model that produced it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from testkit.worker_process import gemma_path, model_path
from trioserve.config import Settings
from trioserve.testing import serve_in_process

from ..conftest import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

# The Gemma 3 GGUF carries no chat template: the model's own, as its tokenizer_config.json has it.
GEMMA_TEMPLATE = Path(__file__).resolve().parents[2] / "data" / "templates" / "gemma3.jinja"
QUESTION = "What is the capital of France? Answer in one word."


def config(tmp_path: Path) -> str:
    path = tmp_path / "models.toml"
    path.write_text(f"""
[[models]]
id = "smollm2"
path = "{model_path()}"
context = 1024
slots = 1
preload = true

[[models]]
id = "gemma3"
path = "{gemma_path()}"
chat_template = "{GEMMA_TEMPLATE}"
context = 1024
slots = 1
preload = true
aliases = ["claude-*haiku*"]
""")
    return str(path)


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


async def test_smollm2_and_gemma3_from_one_port_through_three_apis(tmp_path):
    settings = Settings(threads=1, models_config=config(tmp_path), log_level="warning")
    # Two models load at once on a shared CPU: a longer wait than one model's.
    async with serve_in_process(settings, ready_timeout=240) as server:
        srv = LiveServer(server.url, server.quart_app)
        async with srv.client(timeout=120) as client:
            await _three_apis(srv, client)


async def _three_apis(srv: LiveServer, client: httpx.AsyncClient) -> None:
    listed = (await client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["state"], m["context_length"]) for m in listed] == \
        [("smollm2", "loaded", 1024), ("gemma3", "loaded", 1024)]
    # Two different models: the profiles their templates were recognised as differ.
    assert listed[0]["capabilities"]["profile"] != listed[1]["capabilities"]["profile"]
    seen: dict[str, set[str]] = {"smollm2": set(), "gemma3": set()}
    for model in ("smollm2", "gemma3"):
        chat = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 12, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == model
        seen[model].add(chat.json()["choices"][0]["message"]["content"])
        responses = await client.post("/v1/responses", json={
            "model": model, "input": QUESTION, "max_output_tokens": 12, "temperature": 0})
        assert responses.status_code == 200, responses.text
        assert responses.json()["model"] == model
        seen[model].add(output_text(responses.json()))
        messages = await client.post("/v1/messages", json={
            "model": model, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]})
        assert messages.status_code == 200, messages.text
        assert messages.json()["model"] == model
        seen[model].add(messages.json()["content"][0]["text"])
    # Claude Code's small-model name reaches Gemma by its alias.
    messages = await client.post("/v1/messages", json={
        "model": "claude-haiku-4-5-20251001", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}]})
    assert messages.status_code == 200, messages.text
    assert messages.json()["model"] == "gemma3"
    seen["gemma3"].add(messages.json()["content"][0]["text"])
    assert all(text.strip() for texts in seen.values() for text in texts)
    assert any("Paris" in text for text in seen["smollm2"]), seen
    # Each model's worker served its own requests: both pools ran generations.
    host = srv.services.host
    assert host.services("smollm2").pool.dispatched == 3
    assert host.services("gemma3").pool.dispatched == 4
