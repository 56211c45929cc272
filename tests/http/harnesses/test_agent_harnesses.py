"""Agent harnesses set up the way their users set them up, on the fake worker: one call when
parallel calls are turned off under ``tool_choice: auto`` (Chat, Responses, Messages; the
official SDKs and LangChain), role runs joined for a template that needs alternation (Codex's
recorded requests on a Gemma 3 template), Claude Code's default ``claude-*`` model names, and
the stored-response routes the OpenAI SDK calls (retrieve, delete, input_items).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from ..conftest import chat_body, live_server
from ..tools.test_forced_calls import FORMATS, NOOP, TEMPLATES, WEATHER, _script

pytestmark = pytest.mark.usefixtures("no_leaks")

DATA = Path(__file__).resolve().parents[2] / "data"
HERMES_WEATHER, HERMES_NOOP = FORMATS["hermes"][1], FORMATS["hermes"][2]
# Two calls, then text the model should never have written after them.
TWO_CALLS = f"{HERMES_WEATHER}\n{HERMES_NOOP}\nAnd some text after the calls."
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Weather for a city",
                     "input_schema": WEATHER["function"]["parameters"]}
ANTHROPIC_NOOP = {"name": "noop", "input_schema": {"type": "object", "properties": {}}}


def _openai(srv: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


# --- parallel calls off under tool_choice auto -------------------------------------------------


async def test_parallel_tool_calls_false_under_auto_gives_one_call_on_chat(tmp_path):
    async with live_server(tmp_path, script=[TWO_CALLS]) as srv:
        client = _openai(srv)
        whole = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER, NOOP], parallel_tool_calls=False)
        choice = whole.choices[0]
        assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        async with client.chat.completions.stream(
                model="fake", messages=[{"role": "user", "content": "Weather?"}],
                tools=[WEATHER, NOOP], parallel_tool_calls=False) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_completion()
        streamed = final.choices[0]
        assert [c.function.name for c in streamed.message.tool_calls or []] == ["get_weather"]
        assert streamed.finish_reason == "tool_calls"
        # parallel_tool_calls true (the default) still gets both calls.
        both = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, NOOP])
        assert [c.function.name for c in both.choices[0].message.tool_calls or []] == ["get_weather", "noop"]
        await client.close()


async def test_parallel_tool_calls_false_under_auto_gives_one_call_on_responses(tmp_path):
    async with live_server(tmp_path, script=[TWO_CALLS]) as srv:
        client = _openai(srv)
        tools: Any = [{"type": "function", "name": "get_weather",
                       "parameters": WEATHER["function"]["parameters"]},
                      {"type": "function", "name": "noop", "parameters": NOOP["function"]["parameters"]}]
        whole = await client.responses.create(model="fake", input="Weather?", tools=tools,
                                              parallel_tool_calls=False)
        assert [(o.type, getattr(o, "name", None)) for o in whole.output] == [("function_call", "get_weather")]
        assert whole.status == "completed" and whole.parallel_tool_calls is False
        async with client.responses.stream(model="fake", input="Weather?", tools=tools,
                                           parallel_tool_calls=False) as stream:
            async for _ in stream:
                pass
            final = await stream.get_final_response()
        assert [o.type for o in final.output] == ["function_call"]
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_disable_parallel_tool_use_gives_one_tool_use_block(tmp_path, stream):
    async with live_server(tmp_path, script=[TWO_CALLS]) as srv:
        client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        kwargs: Any = dict(model="fake", max_tokens=500, tools=[ANTHROPIC_WEATHER, ANTHROPIC_NOOP],
                           tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                           messages=[{"role": "user", "content": "Weather?"}])
        if stream:
            async with client.messages.stream(**kwargs) as events:
                async for _ in events:
                    pass
                message = await events.get_final_message()
        else:
            message = await client.messages.create(**kwargs)
        assert [(b.type, getattr(b, "name", None)) for b in message.content] == [("tool_use", "get_weather")]
        assert message.stop_reason == "tool_use"
        await client.close()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
async def test_langchain_bind_tools_without_parallel_calls_gets_one_call(tmp_path, fmt):
    import langchain_openai  # the `test` extra installs it

    template, weather, noop, _ = FORMATS[fmt]
    thinking = "Plan." if fmt == "qwen_xml" else None  # its template opens the block itself
    async with live_server(tmp_path, script=[_script(fmt, [weather, noop], thinking)],
                           chat_template=str(TEMPLATES / template)) as srv:
        with httpx.Client(timeout=30) as http_client:
            model = langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                                model="fake", max_retries=0, http_client=http_client)
            single = model.bind_tools([WEATHER, NOOP], parallel_tool_calls=False)
            answer = await trio.to_thread.run_sync(single.invoke, "Weather in Paris?")
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert not answer.invalid_tool_calls


# --- role runs on a template that needs alternation --------------------------------------------


async def test_codex_recorded_requests_render_on_a_gemma3_template(tmp_path):
    recorded = json.loads((DATA / "codex_requests.json").read_text())
    script = [f'<tool_call>\n{{"name": "exec_command", "arguments": {{"cmd": "ls {k}"}}}}\n</tool_call>'
              for k in range(2)] + ["Done."]
    async with live_server(tmp_path, script=script, max_context=65536,
                           chat_template=str(TEMPLATES / "gemma3.jinja")) as srv, \
            srv.client(timeout=60) as client:
        for entry in recorded:
            body = entry["body"]
            roles = [item.get("role") for item in body["input"] if item.get("type") == "message"]
            assert roles[:4] == ["developer", "developer", "user", "user"]  # what Codex sends
            resp = await client.post("/v1/responses", json=body)
            assert resp.status_code == 200, resp.text[:2000]
            assert b"response.completed" in resp.content
        # The same turns sent through Chat Completions, with a developer message mid-way.
        messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use tools."},
                    {"role": "user", "content": "one"}, {"role": "user", "content": "two"},
                    {"role": "assistant", "content": "ok"}, {"role": "developer", "content": "Mind the style."},
                    {"role": "user", "content": "three"}]
        resp = await client.post("/v1/chat/completions", json=chat_body(messages=messages))
        assert resp.status_code == 200, resp.text


# --- model names ------------------------------------------------------------------------------


async def test_claude_code_default_model_names_are_served_by_the_loaded_model(tmp_path):
    recorded = json.loads((DATA / "claude_code_requests.json").read_text())
    first = next(r for r in recorded["requests"] if r["path"] == "/v1/messages")
    async with live_server(tmp_path, script=["Hello."], max_context=400_000) as srv:
        client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        for name in ("claude-opus-4-8", "claude-haiku-4-5-20251001", "claude-sonnet-4-5"):
            message = await client.messages.create(model=name, max_tokens=50,
                                                   messages=[{"role": "user", "content": "Hi"}])
            assert message.model == "fake"  # what served it
        # Claude Code's recorded first request, with the name it sends when nothing is set.
        async with srv.client() as http:
            body = dict(first["body"], model="claude-opus-4-8")
            resp = await http.post("/v1/messages?beta=true", json=body, headers=first["headers"])
            assert resp.status_code == 200, resp.text[:2000]
            assert b'"model":"fake"' in resp.content
            # Other APIs and other names still need the served id.
            resp = await http.post("/v1/messages", json={"model": "gpt-5", "max_tokens": 5,
                                                         "messages": [{"role": "user", "content": "x"}]})
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
            resp = await http.post("/v1/chat/completions", json=chat_body(model="claude-opus-4-8"))
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        await client.close()


async def test_claude_names_can_be_turned_off(tmp_path):
    async with live_server(tmp_path, script=["Hello."], client_model_names=False) as srv, \
            srv.client() as http:
        resp = await http.post("/v1/messages", json={"model": "claude-opus-4-8", "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "x"}]})
        assert resp.status_code == 404, resp.text


# --- stored responses -------------------------------------------------------------------------


async def test_stored_responses_retrieve_delete_and_input_items_with_the_sdk(tmp_path):
    async with live_server(tmp_path, script=["First answer.", "Second answer."]) as srv:
        client = _openai(srv)
        first = await client.responses.create(
            model="fake", instructions="Be brief.",
            input=[{"role": "user", "content": "Hello"},
                   {"role": "assistant", "content": "Hi!"},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again"}]}])
        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == "First answer." and got.status == "completed"
        items = await client.responses.input_items.list(first.id)
        assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
            ("message", "user"), ("message", "assistant"), ("message", "user")]  # newest first
        assert all(i.id for i in items.data)
        ascending = await client.responses.input_items.list(first.id, order="asc", limit=2)
        assert [i.role for i in ascending.data] == ["user", "assistant"]  # type: ignore[union-attr]
        assert ascending.has_more
        rest = await client.responses.input_items.list(first.id, order="asc", after=ascending.data[-1].id)
        assert len(rest.data) == 1 and not rest.has_more
        # A streamed response is stored too, with its final state.
        async with client.responses.stream(model="fake", input="Stream me",
                                           previous_response_id=first.id) as stream:
            async for _ in stream:
                pass
            second = await stream.get_final_response()
        stored = await client.responses.retrieve(second.id)
        assert stored.output_text == "Second answer." and stored.previous_response_id == first.id
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.input_items.list(first.id)
        # store: false keeps nothing.
        unstored = await client.responses.create(model="fake", input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        async with srv.client() as http:
            resp = await http.get(f"/v1/responses/{second.id}/input_items?limit=0")
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "limit"
            resp = await http.get(f"/v1/responses/{second.id}?stream=true")
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported_parameter"
        await client.close()


# --- streamed arguments -----------------------------------------------------------------------

# A 2 KB argument (a file body with quotes, escapes and non-ASCII), as a model writes it:
# spaced JSON, so the canonical arguments differ from the raw text.
FILE_BODY = "".join(f'line {k}: "quoted" \\ tab\there é ✓\n' for k in range(60))
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}
WRITE_ARGS = {"path": "notes/a.txt", "content": FILE_BODY}
# Formats whose arguments stream as they are written (spec §10 "Streamed arguments"); the
# JSON ones here, qwen_xml and gemma4 in _streamed_script: every format.
STREAMED_FORMATS = {
    "hermes": '<tool_call>\n{"name": "write_file", "arguments": ARGS}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "write_file", "arguments": ARGS}]',
    "llama3_json": '{"name": "write_file", "parameters": ARGS}',
}


def _raw_args() -> str:
    return json.dumps(WRITE_ARGS, ensure_ascii=False, indent=1)  # not the canonical spelling


def _streamed_script(fmt: str) -> str:
    if fmt == "qwen_xml":  # its template opens the reasoning block itself
        return ("Plan.</think>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n"
                f"{WRITE_ARGS['path']}\n</parameter>\n<parameter=content>\n{FILE_BODY}\n"
                "</parameter>\n</function>\n</tool_call>")
    if fmt == "gemma4":
        return (f'<|tool_call>call:write_file{{path:<|"|>{WRITE_ARGS["path"]}<|"|>,'
                f'content:<|"|>{FILE_BODY}<|"|>}}<tool_call|>')
    return STREAMED_FORMATS[fmt].replace("ARGS", _raw_args())


@pytest.mark.parametrize("fmt", sorted([*STREAMED_FORMATS, "qwen_xml", "gemma4"]))
async def test_a_forced_call_streams_its_arguments_on_every_api(tmp_path, fmt):
    script = _streamed_script(fmt)
    canonical = json.dumps(WRITE_ARGS, ensure_ascii=False)
    assert len(canonical) >= 2048
    template = FORMATS[fmt][0]
    async with live_server(tmp_path, script=[script] * 3, chat_template=str(TEMPLATES / template),
                           worker_args="--grammar-unenforced --token-delay-ms 1") as srv:
        client = _openai(srv)
        # Chat Completions: argument pieces after a start chunk; the SDK's accumulator agrees.
        pieces: list[str] = []
        async with client.chat.completions.stream(
                model="fake", messages=[{"role": "user", "content": "Write it."}], tools=[WRITE],
                tool_choice="required") as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    pieces.append(event.arguments_delta)
            final = await stream.get_final_completion()
        [call] = final.choices[0].message.tool_calls or []
        assert call.function.arguments == canonical == "".join(pieces)
        assert len(pieces) >= 10, len(pieces)
        # Responses.
        deltas: list[str] = []
        async with client.responses.stream(
                model="fake", input="Write it.", tool_choice="required",
                tools=[{"type": "function", "name": "write_file",
                        "parameters": WRITE["function"]["parameters"]}]) as rstream:
            async for revent in rstream:
                if revent.type == "response.function_call_arguments.delta":
                    deltas.append(revent.delta)
            response = await rstream.get_final_response()
        [item] = [o for o in response.output if o.type == "function_call"]
        assert item.arguments == canonical == "".join(deltas)
        assert len(deltas) >= 10, len(deltas)
        await client.close()
        # Messages: input_json_delta pieces; the SDK's accumulator parses the input.
        aclient = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        partial: list[str] = []
        async with aclient.messages.stream(
                model="fake", max_tokens=4000, tool_choice={"type": "any"},
                tools=[{"name": "write_file", "input_schema": WRITE["function"]["parameters"]}],
                messages=[{"role": "user", "content": "Write it."}]) as mstream:
            async for mevent in mstream:
                if mevent.type == "content_block_delta" and mevent.delta.type == "input_json_delta":
                    partial.append(mevent.delta.partial_json)
            message = await mstream.get_final_message()
        [block] = [b for b in message.content if b.type == "tool_use"]
        assert block.input == WRITE_ARGS
        assert "".join(partial) == canonical and len(partial) >= 10, len(partial)
        await aclient.close()


async def test_free_form_calls_arrive_whole(tmp_path):
    """Under tool_choice auto nothing holds the model to a valid call, so a call is sent
    only once complete: one piece with the whole arguments."""
    script = STREAMED_FORMATS["hermes"].replace("ARGS", _raw_args())
    async with live_server(tmp_path, script=[script], worker_args="--token-delay-ms 1") as srv:
        client = _openai(srv)
        pieces: list[str] = []
        async with client.chat.completions.stream(
                model="fake", messages=[{"role": "user", "content": "Write it."}],
                tools=[WRITE]) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    pieces.append(event.arguments_delta)
        assert pieces == [json.dumps(WRITE_ARGS, ensure_ascii=False)]
        await client.close()
