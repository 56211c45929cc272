"""Sessions on the real embedded model (SmolLM2-135M-Instruct through llama.cpp): a 6-turn
agent conversation with tool calls and tool results in one session, where every turn after
the first reports most of the previous turn's prompt + completion as cached (spec §8, §12)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ..conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the team's documentation.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
]

SYSTEM = ("You are a careful assistant for a travel team. Use the tools when a question needs "
          "live data, then answer in one short sentence.")

# (user message, forced tool or None): forced turns end in a tool call whose result is sent
# back as a tool message; the others are plain answers.
TURNS = [
    ("What is the weather in Paris right now?", "get_weather"),
    (None, None),  # answer from the tool result
    ("Find our notes about Paris hotels.", "search_docs"),
    (None, None),
    ("And the weather in Rome?", "get_weather"),
    (None, None),
]


def llama_worker() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""


def reused_fractions(usages: list[dict[str, Any]]) -> list[float]:
    """cached(turn k) / (prompt + completion of turn k-1), for k >= 1."""
    return [u["prompt_tokens_details"]["cached_tokens"]
            / (prev["prompt_tokens"] + prev["completion_tokens"])
            for prev, u in zip(usages, usages[1:])]


async def run_agent(client, key: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    usages = []
    call_no = 0
    for user, forced in TURNS:
        if user is not None:
            messages.append({"role": "user", "content": user})
        body: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "messages": messages,
                                "tools": TOOLS, "temperature": 0, "max_tokens": 40,
                                "prompt_cache_key": key}
        # Tools stay declared on every turn (tool_choice "none" would drop them from the
        # rendered system prompt and so break the prefix).
        body["tool_choice"] = ({"type": "function", "function": {"name": forced}} if forced
                               else "auto")
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        usages.append(data["usage"])
        msg = data["choices"][0]["message"]
        turn: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
        if msg.get("tool_calls"):
            turn["tool_calls"] = msg["tool_calls"]
        messages.append(turn)
        for call in msg.get("tool_calls") or []:
            call_no += 1
            result = {"result": f"result {call_no} for {call['function']['arguments']}",
                      "ok": True}
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": json.dumps(result)})
        if forced:
            assert msg.get("tool_calls"), msg
    return usages


async def test_six_turn_agent_session_reuses_previous_turns(tmp_path, capsys):
    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(), threads=2,
                           max_context=4096) as srv, srv.client(timeout=300) as client:
        usages = await run_agent(client, "agent-real")
    fractions = reused_fractions(usages)
    with capsys.disabled():
        print("\nreused fractions per turn:", [round(f, 3) for f in fractions],
              "prompt tokens:", [u["prompt_tokens"] for u in usages])
    assert len(fractions) == 5
    assert all(f >= 0.9 for f in fractions), fractions
