"""Smoke test on the real embedded model (SmolLM2-135M-Instruct through llama.cpp),
driven by the official OpenAI SDK: non-stream, stream with usage, and determinism."""

from __future__ import annotations

import pytest
import trio
from openai import OpenAI

from trioserve.config import EMBEDDED_MODEL_ID

from ..conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


async def test_openai_sdk_non_stream_and_stream(tmp_path):
    async with live_server(tmp_path, engine="llama", worker_bin="", threads=2,
                           max_context=2048) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def run() -> tuple:
            models = client.models.list()
            first = client.chat.completions.create(model=EMBEDDED_MODEL_ID, messages=MESSAGES,
                                                   max_tokens=24, temperature=0)
            second = client.chat.completions.create(model=EMBEDDED_MODEL_ID, messages=MESSAGES,
                                                    max_tokens=24, temperature=0)
            stream = client.chat.completions.create(model=EMBEDDED_MODEL_ID, messages=MESSAGES,
                                                    max_tokens=24, temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
            return models, first, second, list(stream)

        models, first, second, chunks = await trio.to_thread.run_sync(run)

    assert [m.id for m in models.data] == [EMBEDDED_MODEL_ID]
    text = first.choices[0].message.content
    assert text and "Paris" in text
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 10 and 0 < first.usage.completion_tokens <= 24
    # Greedy decoding is deterministic.
    assert second.choices[0].message.content == text
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == first.usage.completion_tokens
