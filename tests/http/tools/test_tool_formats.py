"""Tool calls in every supported format, end to end over real HTTP (spec §7, §10, §11).

Each case serves the fake worker with a small chat template of one model family, so the
profile (and with it the tool-call parser) is chosen from the template, and scripts the
"model" to answer in that family's syntax: reasoning where the family has it, content, a
call, more content, a second call. The fake emits its script one byte per token, so every
marker arrives split over many pieces, as the worst tokenizer would split it.

Checked: the non-streamed message, the exact streamed delta sequence (each call in its own
chunk as soon as it is complete, ``index`` counting calls, ids, ``finish_reason:
tool_calls``), what the official ``openai`` SDK assembles from the stream, that only text
that could still start a call marker is held back, and that a multi-turn tool conversation
(assistant ``tool_calls`` plus ``tool`` results) renders through each template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trioserve.model.profiles import PROFILES
from trioserve.model.tool_formats import parser_class

from ..conftest import chat_body, live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@dataclass(frozen=True)
class Case:
    tool_format: str
    template: str
    script: str  # what the model writes (reasoning, "Sure.", call 1, "Also:", call 2)
    reasoning: str | None
    between: str  # the content the parser releases between the two calls

    @property
    def content(self) -> str:
        return "Sure." + self.between


CASES = [
    Case("hermes", "chatml_hermes.jinja",
         '<think>Checking.</think>\n\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Paris"}}\n</tool_call>\nAlso:\n<tool_call>\n{"name": "get_time", '
         '"arguments": {"tz": "CET"}}\n</tool_call>',
         "Checking.", "\nAlso:"),
    # The template opens <think> in the prompt: the output starts inside the block.
    Case("qwen_xml", "qwen_xml.jinja",
         "Checking.</think>\n\nSure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
         "Paris\n</parameter>\n</function>\n</tool_call>\nAlso:\n<tool_call>\n"
         "<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>",
         "Checking.", "\nAlso:"),
    Case("gemma4", "gemma4.jinja",
         '<|channel>thought\nChecking.<channel|>Sure.<|tool_call>call:get_weather{city:<|"|>'
         'Paris<|"|>}<tool_call|>Also:<|tool_call>call:get_time{tz:<|"|>CET<|"|>}<tool_call|>',
         "Checking.", "Also:"),
    Case("llama3_json", "llama3.jinja",
         'Sure.\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
         'Also:\n{"name": "get_time", "parameters": {"tz": "CET"}}',
         None, "\nAlso:"),
    Case("mistral", "mistral.jinja",
         '[THINK]Checking.[/THINK]Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}\n'
         'Also:[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
         "Checking.", "\nAlso:"),
]
IDS = [c.tool_format for c in CASES]


def serve(tmp_path: Path, case: Case, script: list[str] | None = None):
    return live_server(tmp_path, script=[case.script] if script is None else script,
                       chat_template=str(TEMPLATES / case.template))


async def assert_profile_format(client, case: Case) -> None:
    caps = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
    assert (caps["tool_format"], caps["tools"]) == (case.tool_format, "template")


def decoded(call: dict[str, Any]) -> tuple[str, Any]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def collapse(events: list[Any]) -> list[tuple[Any, ...]]:
    """The stream as a list of steps: consecutive content (or reasoning) deltas merged
    into one step, every other chunk one step of its own."""
    steps: list[tuple[Any, ...]] = []
    for event in events:
        if event == "[DONE]":
            steps.append(("DONE",))
            continue
        (choice,) = event["choices"]
        delta, finish = choice["delta"], choice["finish_reason"]
        if finish is not None:
            assert delta == {}
            steps.append(("finish", finish))
        elif "role" in delta:
            assert delta == {"role": "assistant", "content": ""}
            steps.append(("role",))
        elif "tool_calls" in delta:
            assert list(delta) == ["tool_calls"]
            (call,) = delta["tool_calls"]  # one call per chunk
            assert set(call) == {"index", "id", "type", "function"}
            assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
            steps.append(("tool_call", call["index"], *decoded(call)))
        else:
            ((kind, text),) = delta.items()
            assert kind in ("content", "reasoning_content") and text
            if steps and steps[-1][0] == kind:
                steps[-1] = (kind, steps[-1][1] + text)
            else:
                steps.append((kind, text))
    return steps


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_non_streamed_calls_in_each_format(tmp_path, case):
    async with serve(tmp_path, case) as srv, srv.client() as client:
        await assert_profile_format(client, case)
        resp = await client.post("/v1/chat/completions",
                                 json=chat_body("Weather and time in Paris?", tools=TOOLS))
    assert resp.status_code == 200
    (choice,) = resp.json()["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == case.content
    assert message.get("reasoning_content") == case.reasoning
    assert [decoded(c) for c in message["tool_calls"]] == CALLS
    assert all(CALL_ID.fullmatch(c["id"]) and c["type"] == "function" for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_streamed_calls_come_as_each_completes(tmp_path, case):
    async with serve(tmp_path, case) as srv, srv.client() as client:
        await assert_profile_format(client, case)
        resp = await client.post("/v1/chat/completions", json=chat_body(
            "Weather and time in Paris?", tools=TOOLS, stream=True))
    assert resp.status_code == 200
    events = parse_sse(resp.content)
    expected = [("role",)]
    if case.reasoning:
        expected.append(("reasoning_content", case.reasoning))
    # The first call is sent before the content that follows it: as soon as it is complete.
    expected += [("content", "Sure."), ("tool_call", 0, *CALLS[0]), ("content", case.between),
                 ("tool_call", 1, *CALLS[1]), ("finish", "tool_calls"), ("DONE",)]
    assert collapse(events) == expected
    ids = [e["choices"][0]["delta"]["tool_calls"][0]["id"] for e in events[:-1]
           if "tool_calls" in e["choices"][0]["delta"]]
    assert len(set(ids)) == 2


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_openai_sdk_assembles_the_streamed_calls(tmp_path, case):
    from openai import AsyncOpenAI

    async with serve(tmp_path, case) as srv:
        client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        stream = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Weather and time in Paris?"}],
            tools=TOOLS, stream=True)
        calls: dict[int, dict[str, str]] = {}
        content, finish = "", None
        async for chunk in stream:
            choice = chunk.choices[0]
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
        await client.close()
    assert finish == "tool_calls"
    assert content == case.content
    assert sorted(calls) == [0, 1]
    assert [(calls[k]["name"], json.loads(calls[k]["arguments"])) for k in (0, 1)] == CALLS
    assert all(CALL_ID.fullmatch(calls[k]["id"]) for k in (0, 1))


def hung_after(script: str) -> dict[str, Any]:
    """Server settings for a worker that writes ``script`` and then hangs: the stall check
    kills it, so the stream ends with an error event and shows exactly what was released
    before the hang and what was still held back (a held tail is never sent)."""
    # The fake hangs when asked for the token after the first N: one more must be scripted.
    return dict(script=[script + "."], worker_args=f"--hang-after-tokens {len(script.encode())}",
                # Generous: a busy but healthy worker must still answer its ping in time.
                stall_timeout=1.0, health_timeout=2.0, restart=False)


async def stream_until_failure(tmp_path: Path, case: Case, script: str) -> str:
    """The content a stream sent before the worker hung after ``script``."""
    async with live_server(tmp_path, chat_template=str(TEMPLATES / case.template),
                           **hung_after(script)) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            "hi", tools=TOOLS, stream=True,
            # Qwen XML's template opens a <think> block unless thinking is off.
            chat_template_kwargs={"enable_thinking": False}))
    events = parse_sse(resp.content)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_unavailable"
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2])


@pytest.mark.parametrize("case", [c for c in CASES if c.tool_format != "llama3_json"],
                         ids=[i for i in IDS if i != "llama3_json"])
async def test_only_text_that_could_start_a_marker_is_held_back(tmp_path, case):
    # A marker prefix ruled out by "!" is released; the space before "b" is released with
    # "b"; the final marker prefix is held (and, the worker dying, never sent).
    marker = parser_class(case.tool_format).call_start_markers[0]
    script = "a " + marker[:-1] + "! b" + marker[:-1]
    assert await stream_until_failure(tmp_path, case, script) == "a " + marker[:-1] + "! b"


async def test_a_json_brace_is_held_only_while_it_could_start_a_llama3_call(tmp_path):
    case = next(c for c in CASES if c.tool_format == "llama3_json")
    # '{"a"' cannot start a call ('{"name"' or '{"type"' could): it is content at once.
    sent = await stream_until_failure(tmp_path, case, 'x {"a": 1}, {"na')
    assert sent == 'x {"a": 1},'


async def test_an_undeclared_tool_in_llama3_json_is_content(tmp_path):
    case = next(c for c in CASES if c.tool_format == "llama3_json")
    text = 'x {"a": 1} {"name": "nope", "parameters": {}}'
    async with serve(tmp_path, case, script=[text]) as srv, srv.client() as client:
        streamed = await client.post("/v1/chat/completions", json=chat_body("hi", tools=TOOLS, stream=True))
        plain = await client.post("/v1/chat/completions", json=chat_body("hi", tools=TOOLS))
    events = parse_sse(streamed.content)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == text
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert plain.json()["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_tool_choice_none_never_parses_calls(tmp_path, case):
    async with serve(tmp_path, case) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            "hi", tools=TOOLS, tool_choice="none"))
    (choice,) = resp.json()["choices"]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert "Paris" in choice["message"]["content"]


def conversation(city: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc123", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": "21C"},
    ]


@pytest.mark.parametrize("case", CASES, ids=IDS)
async def test_a_multi_turn_tool_conversation_renders_through_each_template(tmp_path, case):
    async with serve(tmp_path, case, script=["It is 21C in Paris."]) as srv, srv.client() as client:
        short = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": conversation("Paris"), "tools": TOOLS})
        longer = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": conversation("Paris, France"), "tools": TOOLS,
            "stream": True, "stream_options": {"include_usage": True}})
    assert short.status_code == 200 and longer.status_code == 200
    answer = short.json()
    message = answer["choices"][0]["message"]
    assert (message.get("reasoning_content") or "") + (message["content"] or "") == "It is 21C in Paris."
    assert answer["choices"][0]["finish_reason"] == "stop"
    # The fake counts one token per prompt byte: the earlier call's arguments are in the prompt.
    usage = parse_sse(longer.content)[-2]["usage"]
    assert usage["prompt_tokens"] - answer["usage"]["prompt_tokens"] == len(", France")


def test_no_profile_stop_string_can_cut_its_own_tool_markers():
    # The worker drops a stop string and everything after it (spec/worker-protocol.md
    # §4.1): a stop inside a marker would make that format's calls invisible.
    for profile in PROFILES:
        markers = parser_class(profile.tool_format).markers
        reasoning = (profile.reasoning.start, profile.reasoning.end) if profile.reasoning else ()
        for stop in profile.extra_stops:
            assert not any(stop in m for m in markers + reasoning), (profile.name, stop)
