"""``POST /v1/responses`` on the real embedded model (SmolLM2-135M-Instruct through llama.cpp),
driven by the official OpenAI SDK: ``responses.create`` and ``responses.stream`` (its typed
event parser and accumulator), a follow-up turn through ``previous_response_id`` under a
``prompt_cache_key``."""

from __future__ import annotations

import pytest
import trio
from openai import OpenAI

from trioserve.config import EMBEDDED_MODEL_ID

from .conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

QUESTION = "What is the capital of France? Answer in one word."


async def test_openai_sdk_responses_create_and_stream(tmp_path):
    async with live_server(tmp_path, engine="llama", worker_bin="", threads=2,
                           max_context=2048) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def run() -> tuple:
            first = client.responses.create(model=EMBEDDED_MODEL_ID, input=QUESTION,
                                            instructions="You are a helpful assistant.",
                                            max_output_tokens=24, temperature=0,
                                            prompt_cache_key="real-1")
            with client.responses.stream(model=EMBEDDED_MODEL_ID, input=QUESTION,
                                         max_output_tokens=24, temperature=0) as stream:
                events = list(stream)
                final = (stream.get_final_response() if events[-1].type == "response.completed"
                         else events[-1].response)
            # Instructions are not carried over by previous_response_id (as OpenAI's): resent.
            follow = client.responses.create(model=EMBEDDED_MODEL_ID, input="And of Italy?",
                                             instructions="You are a helpful assistant.",
                                             previous_response_id=first.id, max_output_tokens=24,
                                             temperature=0, prompt_cache_key="real-1")
            client.close()
            return first, events, final, follow

        first, events, final, follow = await trio.to_thread.run_sync(run)

    assert "Paris" in first.output_text and first.status in ("completed", "incomplete")
    assert first.usage.output_tokens <= 24
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas and "Paris" in deltas
    # The follow-up renders the stored turn first: its prompt starts with the whole first turn.
    cached = follow.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens, (cached, first.usage)
