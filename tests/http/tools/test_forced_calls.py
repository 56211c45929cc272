"""Forced tool calls and JSON in every tool-call format over HTTP, on the fake worker.

The fake runs with ``--grammar-unenforced``: it reports grammar support and writes its script
whatever the grammar says, so these tests check the constrained request path end to end — a
grammar is compiled for each format (``tool_choice`` required / named, ``parallel_tool_calls``
true / false) instead of a 400, the exact output the grammar spells comes back as calls, and
the official ``openai`` SDK parses every result. That the grammars admit exactly that output is
checked against llama.cpp's engine in tests/unit/core/test_constraints_forced_calls.py; that a real
model follows them, in test_forced_calls_real_model.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from openai import OpenAI

from ..conftest import chat_body, live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}

# format -> (template, one call to get_weather(city=Paris), a call to noop(), separator for two)
FORMATS = {
    "hermes": ("chatml_hermes.jinja",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', "\n"),
    "qwen_xml": ("qwen_xml.jinja",
                 "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "</function>\n</tool_call>",
                 "<tool_call>\n<function=noop>\n</function>\n</tool_call>", "\n"),
    "gemma4": ("gemma4.jinja", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
               "<|tool_call>call:noop{}<tool_call|>", ""),
    "llama3_json": ("llama3.jinja", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "noop", "parameters": {}}', "; "),
    "mistral": ("mistral.jinja", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                '{"name": "noop", "arguments": {}}', ", "),
}


def _script(fmt: str, calls: list[str], thinking: str | None) -> str:
    _, _, _, sep = FORMATS[fmt]
    body = sep.join(calls)
    if fmt == "mistral":
        body = "[TOOL_CALLS][" + body + "]"
    if thinking is None:
        return body
    return {"hermes": f"<think>{thinking}</think>\n\n",
            "qwen_xml": f"{thinking}</think>\n\n",  # its template opens the block in the prompt
            "gemma4": f"<|channel>thought\n{thinking}<channel|>",
            "llama3_json": "", "mistral": f"[THINK]{thinking}[/THINK]"}[fmt] + body


@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_forced_calls_in_every_format(tmp_path, fmt):
    template, weather, noop, _ = FORMATS[fmt]
    thinking = None if fmt == "llama3_json" else "Let me see."
    cases = [  # (tool_choice, parallel, script calls, expected names)
        ("required", False, [weather], ["get_weather"]),
        ("required", True, [weather, noop], ["get_weather", "noop"]),
        ({"type": "function", "function": {"name": "noop"}}, False, [noop], ["noop"]),
        ({"type": "function", "function": {"name": "noop"}}, True, [noop, noop], ["noop", "noop"]),
    ]
    scripts = [_script(fmt, calls, thinking) for _, _, calls, _ in cases]
    async with live_server(tmp_path, script=scripts, chat_template=str(TEMPLATES / template),
                           worker_args="--grammar-unenforced") as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=30, max_retries=0)

        def run():
            with client:
                return [client.chat.completions.create(
                    model="fake", messages=[{"role": "user", "content": "Weather in Paris?"}],
                    tools=[WEATHER, NOOP], tool_choice=choice, parallel_tool_calls=parallel)
                    for choice, parallel, _, _ in cases]

        results = await trio.to_thread.run_sync(run)
    for (choice, parallel, _, names), result in zip(cases, results):
        choice_out = result.choices[0]
        message = choice_out.message
        assert choice_out.finish_reason == "tool_calls", (fmt, choice, message)
        assert [c.function.name for c in message.tool_calls] == names, (fmt, choice, parallel)
        for c in message.tool_calls:
            assert json.loads(c.function.arguments) == ({"city": "Paris"} if c.function.name == "get_weather" else {})
        assert not message.content, (fmt, message.content)
        reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
        if thinking is not None:
            assert reasoning == thinking, (fmt, reasoning)


async def test_thinking_template_with_response_format_gives_json_content(tmp_path):
    # qwen3.jinja has a thinking switch: the grammar admits the reasoning block first, and the
    # block is split off, so content is the JSON alone.
    script = ['<think>The user wants JSON.</think>\n\n{"answer": 42}']
    async with live_server(tmp_path, script=script, chat_template=str(TEMPLATES / "qwen3.jinja"),
                           worker_args="--grammar-unenforced") as srv, srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            "Answer as JSON.", response_format={"type": "json_object"}))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert json.loads(message["content"]) == {"answer": 42}
    assert message["reasoning_content"] == "The user wants JSON."


@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_forced_call_shape_errors_are_400s_in_every_format(tmp_path, fmt):
    template = FORMATS[fmt][0]
    async with live_server(tmp_path, script=["x"], chat_template=str(TEMPLATES / template),
                           worker_args="--grammar-unenforced") as srv, srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_langchain_reads_forced_calls_in_every_format(tmp_path, fmt):
    import httpx
    import langchain_openai  # the `test` extra installs it

    template, weather, noop, _ = FORMATS[fmt]
    thinking = "Plan." if fmt == "qwen_xml" else None  # its template opens the block itself
    scripts = [_script(fmt, [weather], thinking), _script(fmt, [weather, noop], thinking)]
    async with live_server(tmp_path, script=scripts, chat_template=str(TEMPLATES / template),
                           worker_args="--grammar-unenforced") as srv:
        # Our own HTTP client, closed here (langchain-openai's cached one would outlive the test).
        with httpx.Client(timeout=30) as http_client:
            model = langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                                model="fake", max_retries=0, http_client=http_client)
            single = model.bind_tools([WEATHER, NOOP], tool_choice="required", parallel_tool_calls=False)
            several = model.bind_tools([WEATHER, NOOP], tool_choice="required")
            one = await trio.to_thread.run_sync(single.invoke, "Weather in Paris?")
            two = await trio.to_thread.run_sync(several.invoke, "Weather in Paris?")
    assert [(c["name"], c["args"]) for c in one.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert [(c["name"], c["args"]) for c in two.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                               ("noop", {})]
    assert not one.invalid_tool_calls and not two.invalid_tool_calls
