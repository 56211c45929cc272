"""A JSON answer never repeats a key within one object (spec §5.6), end to end on the
fake worker.

The fake runs with ``--grammar-unenforced`` (the constrained request path runs; the script is
the "model"). Its sampler applies the worker's real key stage (cpp/json_key_guard.h, attached by
the worker loop from the generate record's ``unique_keys``): a scripted quote that would close a
repeated key is refused and the fake takes the next allowed byte (``#``), as a model whose best
token is masked takes its next best. So a script that repeats a key shows exactly what the
stage changed, and that nothing else changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.json_keys import unique_pairs

from ..conftest import chat_body, live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
KITTY = '{"name": "Kitty", "age": 1269, "name": "Tom", "toys": [{"name": "ball", "name": "x"}]}'
KITTY_UNIQUE = '{"name": "Kitty", "age": 1269, "name#": "Tom", "toys": [{"name": "ball", "name#": "x"}]}'


async def test_json_object_answer_does_not_repeat_a_key(tmp_path):
    async with live_server(tmp_path, script=[KITTY, KITTY, KITTY], worker_args="--grammar-unenforced") as srv, \
            srv.client() as client:
        plain = await client.post("/v1/chat/completions", json=chat_body("A cat?"))
        r = await client.post("/v1/chat/completions", json=chat_body(
            "A cat as JSON?", response_format={"type": "json_object"}))
        s = await client.post("/v1/chat/completions", json=chat_body(
            "A cat as JSON?", response_format={"type": "json_object"}, stream=True))
    # Unconstrained text is not touched; the constrained answer is.
    assert plain.json()["choices"][0]["message"]["content"] == KITTY
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content == KITTY_UNIQUE
    assert json.loads(content, object_pairs_hook=unique_pairs)["name#"] == "Tom"
    events = parse_sse(s.content)
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if isinstance(e, dict) and e.get("choices"))
    assert streamed == KITTY_UNIQUE


async def test_json_schema_answer_and_escaped_spellings(tmp_path):
    # "\u0061" is the key "a": the second spelling is caught too.
    script = ['{"a": 1, "\\u0061": 2, "b": "a"}']
    schema = {"type": "object", "additionalProperties": {"type": "integer"}}
    async with live_server(tmp_path, script=script, worker_args="--grammar-unenforced") as srv, \
            srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body("JSON", response_format={
            "type": "json_schema", "json_schema": {"name": "m", "schema": schema}}))
    content = r.json()["choices"][0]["message"]["content"]
    assert content == '{"a": 1, "\\u0061#": 2, "b": "a"}'
    assert json.loads(content, object_pairs_hook=unique_pairs) == {"a": 1, "a#": 2, "b": "a"}


async def test_thinking_block_is_left_alone(tmp_path):
    # qwen3.jinja has a thinking switch: an optional block comes first; keys repeated inside
    # the reasoning are text, not JSON.
    script = ['<think>{"a": 1, "a": 2} is wrong.</think>\n\n{"a": 1, "a": 2}']
    async with live_server(tmp_path, script=script, chat_template=str(TEMPLATES / "qwen3.jinja"),
                           worker_args="--grammar-unenforced") as srv, srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            "JSON", response_format={"type": "json_object"}))
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == '{"a": 1, "a": 2} is wrong.'
    assert message["content"] == '{"a": 1, "a#": 2}'


async def test_forced_call_arguments_do_not_repeat_a_key(tmp_path):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    script = ['<tool_call>\n{"name": "f", "arguments": {"x": 1, "y": {"x": 2}, "x": 3}}\n</tool_call>']
    async with live_server(tmp_path, script=script, chat_template=str(TEMPLATES / "chatml_hermes.jinja"),
                           worker_args="--grammar-unenforced") as srv, srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            "call f", tools=[tool], tool_choice="required"))
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls", out
    arguments = out["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments, object_pairs_hook=unique_pairs) == {"x": 1, "y": {"x": 2}, "x#": 3}


async def test_raw_text_call_values_are_not_read_as_json(tmp_path):
    # Qwen XML values are raw text: a quote there is no key, so the stage is off.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    value = '{"a": 1, "a": 2}'
    script = [f"<tool_call>\n<function=f>\n<parameter=q>\n{value}\n</parameter>\n</function>\n</tool_call>"]
    async with live_server(tmp_path, script=script, chat_template=str(TEMPLATES / "qwen_xml.jinja"),
                           worker_args="--grammar-unenforced") as srv, srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            "call f", tools=[tool], tool_choice="required",
            chat_template_kwargs={"enable_thinking": False}))
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"q": value}


async def test_budget_inside_a_refused_key_ends_with_length(tmp_path):
    async with live_server(tmp_path, script=['{"a": 1, "a": 2}'], worker_args="--grammar-unenforced") as srv, \
            srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            "JSON", response_format={"type": "json_object"}, max_tokens=12))
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "length"
    assert out["message"]["content"] == '{"a": 1, "a#'
