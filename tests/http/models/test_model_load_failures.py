"""A model that cannot start says why, once (spec §3 ``model_load_failed``, §14.5): a models
folder holding a GGUF without a chat template (the test extra's Gemma 3 270M *base* model)
answers its first request with the reason and the shipped template that fits, starts no new
load for the requests after it, and shows ``failed`` in ``/v1/models``; served alone, the same
file is a startup error (exit status 2, one line); ``--chat-template gemma3`` serves it.

``/v1/models`` also gives every model's context window and capabilities before it is loaded,
from its file's header (http/model_preview.py).

Only headers are read until the last test: no worker starts for a model without a template.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.worker_process import NotInstalled, gemma_path, model_path
from trioserve.worker.model_cost import read_gguf_info

from ..conftest import chat_body, live_server

ROOT = Path(__file__).resolve().parents[3]


def real_models() -> tuple[Path, Path]:
    try:
        return gemma_path(), model_path()
    except NotInstalled as exc:
        pytest.skip(str(exc))


def models_dir(tmp_path: Path) -> Path:
    """A models folder: the template-less Gemma base model and SmolLM2 (which has one)."""
    gemma, smollm2 = real_models()
    folder = tmp_path / "models"
    folder.mkdir()
    for name, path in (("gemma-base.gguf", gemma), ("smollm2.gguf", smollm2)):
        (folder / name).symlink_to(path)
    return folder


def metric(text: str, name: str, **labels: str) -> float:
    for row in text.splitlines():
        if row.startswith(name + "{") and all(f'{k}="{v}"' in row for k, v in labels.items()):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def test_a_gguf_without_a_chat_template_says_why_once(tmp_path):
    folder = models_dir(tmp_path)
    async with live_server(tmp_path, wait_ready=False, engine="llama", worker_bin="",
                           models_dir=str(folder), slots=1) as srv, srv.client() as client:
        body = chat_body(model="gemma-base")
        first = await client.post("/v1/chat/completions", json=body)
        # The reason, and a status the SDKs do not retry: 500 with x-should-retry: false.
        assert first.status_code == 500, first.text
        assert first.headers["x-should-retry"] == "false" and "Retry-After" not in first.headers
        error = first.json()["error"]
        assert error["code"] == "model_load_failed"
        assert "no chat template" in error["message"]
        assert "--chat-template gemma3" in error["message"]  # the family's shipped template
        for _ in range(10):  # retries within the backoff start no new load
            again = await client.post("/v1/chat/completions", json=body)
            assert again.status_code == 500 and again.json()["error"]["code"] == "model_load_failed"
            assert "--chat-template gemma3" in again.json()["error"]["message"]
        scrape = (await client.get("/metrics")).text
        loads = [row for row in scrape.splitlines()
                 if row.startswith("trioserve_model_loads_total{") and 'model="gemma-base"' in row]
        assert sum(float(row.rsplit(" ", 1)[1]) for row in loads) == 1, loads
        assert metric(scrape, "trioserve_model_loads_total", model="gemma-base",
                      outcome="failed") == 1
        entry = (await client.get("/v1/models/gemma-base")).json()
        assert entry["state"] == "failed" and "no chat template" in entry["failure"]
        # Claude Code's route: the same reason in Anthropic's envelope, not to be retried.
        messages = await client.post("/v1/messages", json={
            "model": "gemma-base", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 500 and messages.headers["x-should-retry"] == "false"
        assert messages.json()["error"]["type"] == "api_error"
        assert "--chat-template gemma3" in messages.json()["error"]["message"]


async def test_models_lists_context_and_capabilities_before_a_load(tmp_path):
    folder = models_dir(tmp_path)
    gemma, smollm2 = real_models()
    async with live_server(tmp_path, wait_ready=False, engine="llama", worker_bin="",
                           models_dir=str(folder)) as srv, srv.client() as client:
        entries = {e["id"]: e for e in (await client.get("/v1/models")).json()["data"]}
        small = entries["smollm2"]
        assert small["state"] == "not_loaded"
        # The training context from the header (no --max-context here), in both names.
        expected = read_gguf_info(smollm2).context_length
        assert expected and small["context_length"] == small["max_model_len"] == expected
        capabilities = small["capabilities"]
        assert capabilities["profile"] == "chatml" and capabilities["tools"] in ("template", "injected")
        base = entries["gemma-base"]
        # It cannot start: failed before any request, with the reason, and its context.
        assert base["state"] == "failed" and "--chat-template gemma3" in base["failure"]
        assert base["context_length"] == read_gguf_info(gemma).context_length
        assert "capabilities" not in base
    async with live_server(tmp_path, wait_ready=False, engine="llama", worker_bin="",
                           models_dir=str(folder), max_context=2048) as srv, srv.client() as client:
        entry = (await client.get("/v1/models/smollm2")).json()
        assert entry["context_length"] == 2048  # the configured window wins over the header's


def test_serving_it_alone_exits_2_with_one_line(tmp_path):
    gemma, _ = real_models()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "trioserve.cli", "serve", "--engine", "llama", "--model-path",
         str(gemma), "--port", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trioserve: "), done.stderr
    assert "no chat template" in lines[0] and "--chat-template gemma3" in lines[0]


@pytest.mark.slow
async def test_the_shipped_gemma3_template_serves_it(tmp_path):
    gemma, _ = real_models()
    async with live_server(tmp_path, engine="llama", worker_bin="", model_path=str(gemma),
                           chat_template="gemma3", max_context=512, slots=1) as srv, \
            srv.client(timeout=120) as client:
        response = await client.post("/v1/chat/completions", json={
            **chat_body(model=gemma.stem), "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] > 0
        capabilities = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
        assert (capabilities["profile"], capabilities["profile_chosen_by"]) == ("gemma3", "template")
