"""``POST /v1/responses`` on the real embedded model (SmolLM2-135M-Instruct through llama.cpp),
driven by the official OpenAI SDK: ``responses.create`` and ``responses.stream`` (its typed
event parser and accumulator), a follow-up turn through ``previous_response_id`` under a
``prompt_cache_key``."""

from __future__ import annotations

import pytest
import trio
from openai import OpenAI

from trioserve.config import EMBEDDED_MODEL_ID

from ..conftest import live_server

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


TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "search_docs", "description": "Search the team's documentation.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
]
# (user message, forced tool or None), as tests/http/sessions/test_sessions_real_model.py, over 8 turns.
TURNS = [("What is the weather in Paris right now?", "get_weather"), (None, None),
         ("Find our notes about Paris hotels.", "search_docs"), (None, None),
         ("And the weather in Rome?", "get_weather"), (None, None),
         ("Find our notes about Rome museums.", "search_docs"), (None, None)]


async def test_eight_turn_agent_session_through_responses_reuses_previous_turns(tmp_path, capsys):
    """An agent loop as Codex runs it (store false, the whole input resent, keyed by
    prompt_cache_key): every turn reuses most of the previous turn's prompt + output."""
    async with live_server(tmp_path, engine="llama", worker_bin="", threads=2,
                           max_context=4096) as srv, srv.client(timeout=300) as client:
        items: list[dict] = [{"type": "message", "role": "developer", "content": (
            "You are a careful assistant for a travel team. Use the tools when a question needs "
            "live data, then answer in one short sentence.")}]
        usages = []
        for user, forced in TURNS:
            if user is not None:
                items.append({"type": "message", "role": "user", "content": user})
            body = {"model": EMBEDDED_MODEL_ID, "input": items, "tools": TOOLS, "temperature": 0,
                    "max_output_tokens": 40, "store": False, "prompt_cache_key": "agent-responses",
                    "tool_choice": {"type": "function", "name": forced} if forced else "auto"}
            resp = await client.post("/v1/responses", json=body)
            assert resp.status_code == 200, resp.text
            data = resp.json()
            usages.append(data["usage"])
            for item in data["output"]:
                items.append({k: v for k, v in item.items() if k != "status"})
                if item["type"] == "function_call":
                    items.append({"type": "function_call_output", "call_id": item["call_id"],
                                  "output": f'{{"result": "ok for {item["arguments"]}"}}'})
            if forced:
                assert any(i["type"] == "function_call" for i in data["output"]), data["output"]
    fractions = [u["input_tokens_details"]["cached_tokens"] / (p["input_tokens"] + p["output_tokens"])
                 for p, u in zip(usages, usages[1:])]
    with capsys.disabled():
        print("\nresponses reuse per turn:", [round(f, 3) for f in fractions],
              "input tokens:", [u["input_tokens"] for u in usages])
    assert len(fractions) == 7
    assert all(f >= 0.9 for f in fractions), fractions
