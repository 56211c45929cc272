"""The seeds' model families end to end (issue #48 item 4): the synthetic Qwen3.5, Qwen3.5-MoE
and Gemma 4 GGUFs (testkit/synthetic_models.py) served by the real llama worker over HTTP, one
tool turn each through Chat, Responses and Messages with a forced call, then the tool's result
sent back in the family's own format. One call each (parallel calls off: after it the grammar
admits only the end of the turn), and the city is an enum: a free string would let random weights
write on until the token budget ends, inside the call.

The weights are random, so only the format is checked: the forced call's grammar is the
family's (Qwen3.5's XML ``<tool_call><function=…>`` blocks, Gemma 4's ``<|tool_call>call:NAME{…}``
with ``<|"|>``-quoted strings), the output parser must turn what the grammar admitted back into
a structured call with the schema's arguments, and the template must render that call and its
result in the next prompt (the next turn is a valid request whose prompt is longer). Qwen3.5's
thinking switch is exercised both ways: off, the call comes first; on, the generation prompt
opens a ``<think>`` block, so what the model writes before any call is reasoning, split from the
content. A family takes a second or two here (tiny shapes, one slot), so these are not slow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from testkit.synthetic_models import make

from ..conftest import live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

FAMILIES = ("qwen35", "qwen35moe", "gemma4")
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
                          "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"
# Qwen3.5's template thinks unless switched off; Gemma 4's thinks only when switched on.
THINKING_OFF = {"qwen35": {"enable_thinking": False}, "qwen35moe": {"enable_thinking": False}, "gemma4": {}}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("seed-families")
    return {arch: make(arch, out) for arch in FAMILIES}


def _server(tmp_path: Path, model: Path):
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    worker = str(Path(override) / "trioserve-llama-worker") if override else ""
    return live_server(tmp_path, engine="llama", worker_bin=worker, model_path=str(model), threads=2,
                       max_context=1024, model_id="synthetic")


async def _post(client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(path, json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _chat_turn(client, arch: str) -> None:
    tool = {"type": "function", "function": WEATHER}
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = await _post(client, "/v1/chat/completions", {
        "model": "synthetic", "messages": messages, "tools": [tool], "max_tokens": 64, "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "chat_template_kwargs": THINKING_OFF[arch]})
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and set(arguments) == {"city"}, call
    assert arguments["city"] in ("Paris", "Lyon")
    assert not any(marker in (choice["message"]["content"] or "") for marker in ("<tool_call>", "<|tool_call>"))

    # The call and its result go back: the template renders both in the family's format.
    messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "18 C, clear"}]
    second = await _post(client, "/v1/chat/completions", {
        "model": "synthetic", "messages": messages, "tools": [tool], "max_tokens": 8, "temperature": 0,
        "chat_template_kwargs": THINKING_OFF[arch]})
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"], (first["usage"], second["usage"])


async def _responses_turn(client, arch: str) -> None:
    body = await _post(client, "/v1/responses", {
        "model": "synthetic", "input": QUESTION, "max_output_tokens": 64, "temperature": 0,
        "tools": [{"type": "function", **WEATHER}], "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, **({"reasoning": {"effort": "none"}} if THINKING_OFF[arch] else {})})
    calls = [item for item in body["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather", body["output"]
    assert set(json.loads(calls[0]["arguments"])) == {"city"}


async def _messages_turn(client, arch: str) -> None:
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    thinking = {"thinking": {"type": "disabled"}} if THINKING_OFF[arch] else {}
    body = await _post(client, "/v1/messages", {
        "model": "synthetic", "max_tokens": 64, "temperature": 0, "tools": [tool],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, **thinking,
        "messages": [{"role": "user", "content": QUESTION}]})
    uses = [block for block in body["content"] if block["type"] == "tool_use"]
    assert body["stop_reason"] == "tool_use" and len(uses) == 1, body
    assert uses[0]["name"] == "get_weather" and set(uses[0]["input"]) == {"city"}


@pytest.mark.parametrize("arch", FAMILIES)
async def test_a_forced_tool_turn_in_the_familys_format_through_every_api(tmp_path, models, arch):
    async with _server(tmp_path, models[arch]) as srv, srv.client() as client:
        await _chat_turn(client, arch)
        await _responses_turn(client, arch)
        await _messages_turn(client, arch)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
async def test_qwen35_thinking_switch_splits_the_reasoning(tmp_path, models, arch):
    """Thinking on (the template's default), the generation prompt opens ``<think>``: whatever the
    model writes before closing it is reasoning, so the content holds none of it; switched off,
    nothing is reasoning."""
    async with _server(tmp_path, models[arch]) as srv, srv.client() as client:
        base = {"model": "synthetic", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12,
                "temperature": 0}
        on = (await _post(client, "/v1/chat/completions", base))["choices"][0]["message"]
        off = (await _post(client, "/v1/chat/completions", {
            **base, "chat_template_kwargs": {"enable_thinking": False}}))["choices"][0]["message"]
    assert on.get("reasoning_content"), on
    assert "<think>" not in (on["content"] or "") and "</think>" not in on["reasoning_content"]
    assert not off.get("reasoning_content"), off
    assert off["content"], off


@pytest.mark.parametrize("arch", ["qwen35", "gemma4"])
async def test_a_sessions_turn_after_its_tool_call_starts_warm(tmp_path, models, arch):
    """A keyed session's forced tool call (the control plane stops the generation once the one
    allowed call is complete) and its result go back. The stopped generation's slot stays
    exact (spec §7), and the answer-start checkpoint sits before the header's newline, which
    Qwen3.5's template renders as a blank line before a call in the history (a different
    token there): the next turn reuses the whole first prompt up to its thinking tail. Both
    made this turn cold before (0 tokens reused on each family)."""
    tool = {"type": "function", "function": WEATHER}
    base = {"model": "synthetic", "tools": [tool], "temperature": 0, "prompt_cache_key": "agent",
            "chat_template_kwargs": THINKING_OFF[arch]}
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    async with _server(tmp_path, models[arch]) as srv, srv.client() as client:
        first = await _post(client, "/v1/chat/completions", {
            **base, "messages": messages, "max_tokens": 64, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        choice = first["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        messages += [choice["message"], {"role": "tool", "tool_call_id": choice["message"]["tool_calls"][0]["id"],
                                         "content": "18 C, clear"}]
        second = await _post(client, "/v1/chat/completions", {**base, "messages": messages, "max_tokens": 4})
    u1, u2 = first["usage"], second["usage"]
    # Up to the generation prompt's empty thinking block (Qwen3.5 with thinking off: the next
    # prompt renders the answer without it), which is a handful of tokens.
    assert u1["prompt_tokens"] - 8 <= u2["prompt_tokens_details"]["cached_tokens"] <= u1["prompt_tokens"], (u1, u2)
