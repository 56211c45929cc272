"""Anthropic Messages over real HTTP on the fake worker (spec §16), driven by the ``anthropic``
SDK: ``messages.create``, ``messages.stream`` (whose accumulator checks the event order),
``count_tokens``; tool use with a scripted call; x-api-key auth and Anthropic's error envelope;
session reuse keyed by ``X-Claude-Code-Session-Id`` with a changing billing line; a client
that disconnects mid-stream.

The fake model's template is ChatML and its tokenizer one token per byte, so token counts are
exact and a follow-up turn reuses exactly the previous prompt + completion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest
import trio

from ..conftest import live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def sdk(srv, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=srv.url, api_key=kw.pop("api_key", "x"), max_retries=0, **kw)


async def test_create_returns_a_message_with_usage(tmp_path):
    async with live_server(tmp_path, script=["Hello there!"]) as srv:
        client = sdk(srv)
        msg = await client.messages.create(model="fake", max_tokens=100, system="Be brief.",
                                           messages=[{"role": "user", "content": "Hi"}])
        assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there!"
        assert msg.stop_reason == "end_turn"
        assert msg.usage.output_tokens == len("Hello there!")
        prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(prompt)
        count = await client.messages.count_tokens(model="fake", system="Be brief.",
                                                   messages=[{"role": "user", "content": "Hi"}])
        assert count.input_tokens == len(prompt)
        await client.close()


async def test_stream_with_a_tool_call_is_valid_for_the_sdk_accumulator(tmp_path):
    async with live_server(tmp_path, script=["Let me check.\n" + CALL]) as srv:
        client = sdk(srv)
        async with client.messages.stream(
                model="fake", max_tokens=300, tools=[WEATHER],
                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[0].text.strip() == "Let me check."
        call = final.content[1]
        assert call.name == "get_weather" and call.input == {"city": "Paris"}
        assert final.stop_reason == "tool_use"
        await client.close()


async def test_max_tokens_and_stop_sequences(tmp_path):
    async with live_server(tmp_path, script=["alpha beta END gamma", "0123456789"]) as srv:
        client = sdk(srv)
        msg = await client.messages.create(model="fake", max_tokens=100, stop_sequences=["END"],
                                           messages=[{"role": "user", "content": "x"}])
        assert msg.content[0].text == "alpha beta " and msg.stop_reason == "stop_sequence"
        assert msg.stop_sequence == "END"
        msg = await client.messages.create(model="fake", max_tokens=4,
                                           messages=[{"role": "user", "content": "x"}])
        assert msg.content[0].text == "0123" and msg.stop_reason == "max_tokens"
        await client.close()


async def test_claude_code_request_shape_is_accepted(tmp_path):
    """``?beta=true``, unknown anthropic-beta values, adaptive thinking, output_config,
    context_management, metadata, a system message inside messages and x-api-key auth."""
    body = {"model": "fake", "max_tokens": 32000, "stream": False,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cc_entrypoint=cli;"},
                       {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "system", "content": [{"type": "text", "text": "note"}]}],
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "medium"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})}}
    headers = {"x-api-key": "k-1", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,future-beta-2099",
               "x-claude-code-session-id": "s-1", "x-app": "cli"}
    async with live_server(tmp_path, script=["ok"], api_key="k-1") as srv, srv.client() as client:
        resp = await client.post("/v1/messages?beta=true", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert resp.json()["content"] == [{"type": "text", "text": "ok"}]
        # Wrong key: 401 in Anthropic's envelope.
        resp = await client.post("/v1/messages", json=body, headers={**headers, "x-api-key": "bad"})
        assert resp.status_code == 401
        assert resp.json()["type"] == "error"
        assert resp.json()["error"]["type"] == "authentication_error"


async def test_errors_use_anthropics_envelope_and_name_the_parameter(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv:
        client = sdk(srv)
        with pytest.raises(anthropic.BadRequestError) as exc:
            await client.messages.create(model="fake", max_tokens=10, messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                              "media_type": "image/png", "data": "AA=="}}]}])
        assert exc.value.body["error"]["type"] == "invalid_request_error"
        assert "messages[0].content[0]" in exc.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="other", max_tokens=10,
                                         messages=[{"role": "user", "content": "x"}])
        async with srv.client() as raw:
            resp = await raw.post("/v1/messages", json={"model": "fake", "messages": []})
            assert resp.status_code == 400 and resp.json()["type"] == "error"
            resp = await raw.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        await client.close()


async def test_tool_result_round_trip_and_forced_tool_needs_a_grammar(tmp_path):
    async with live_server(tmp_path, script=["It is sunny."]) as srv:
        client = sdk(srv)
        msg = await client.messages.create(model="fake", max_tokens=100, tools=[WEATHER], messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "sunny"}]}]}])
        assert msg.content[0].text == "It is sunny."
        # The fake worker has no grammar support: a forced tool is refused before generation.
        with pytest.raises(anthropic.BadRequestError) as exc:
            await client.messages.create(model="fake", max_tokens=100, tools=[WEATHER],
                                         tool_choice={"type": "tool", "name": "get_weather"},
                                         messages=[{"role": "user", "content": "x"}])
        assert "tool_choice" in exc.value.body["error"]["message"]
        await client.close()


def billing(turn: int) -> dict[str, str]:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{turn}; cc_entrypoint=cli;"}


async def test_eight_turn_session_reuses_the_previous_turns_despite_the_billing_line(tmp_path):
    """Reusable tokens of turn k = prompt + completion of turn k-1 (the fake model's
    resident state); a changing billing line must not cost any of them."""
    replies = [f"Answer number {k}, with some detail." for k in range(8)]
    async with live_server(tmp_path, script=replies) as srv:
        client = sdk(srv)
        messages: list[dict[str, Any]] = []
        reused, reusable = 0, 0
        previous_total = None
        for turn in range(8):
            messages.append({"role": "user", "content": f"Question {turn}: tell me more."})
            msg = await client.messages.create(
                model="fake", max_tokens=200, messages=messages,
                system=[billing(turn), {"type": "text", "text": "You are helpful. " * 20}],
                extra_headers={"X-Claude-Code-Session-Id": "cc-session-1"})
            usage = msg.usage
            if previous_total is not None:
                reused += usage.cache_read_input_tokens
                reusable += previous_total
            previous_total = usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens
            messages.append({"role": "assistant", "content": msg.content[0].text})
        print(f"\nreused {reused} of {reusable} reusable prompt tokens ({reused / reusable:.3f})")
        assert reused / reusable >= 0.9, (reused, reusable)
        await client.close()


async def test_disconnect_mid_stream_frees_the_slot(tmp_path):
    async with live_server(tmp_path, script=["x" * 3000, "next"], worker_args="--token-delay-ms 5",
                           slots=1) as srv:
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        payload = json.dumps({"model": "fake", "max_tokens": 5000, "stream": True,
                              "messages": [{"role": "user", "content": "go"}]}).encode()
        await stream.send_all(
            b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        data = b""
        with trio.fail_after(10):
            while b"text_delta" not in data:
                data += await stream.receive_some(65536)
        await stream.aclose()
        with trio.fail_after(10):
            while srv.pool.busy:
                await trio.sleep(0.005)
        done = [r for r in srv.pool.history if r.get("type") == "done"]
        assert done and done[0]["cancelled"] and done[0]["completion_tokens"] < 3000
        client = sdk(srv)
        msg = await client.messages.create(model="fake", max_tokens=10,
                                           messages=[{"role": "user", "content": "x"}])
        assert msg.content[0].text == "next"
        await client.close()


# --- the real embedded model ---------------------------------------------------------------


@pytest.mark.slow
async def test_real_model_sdk_create_stream_and_count_tokens(tmp_path):
    """SmolLM2-135M through llama.cpp: the SDK's create, stream (its accumulator) and
    count_tokens, whose count equals the prompt the create reported."""
    import os
    from pathlib import Path

    from trioserve.config import Settings
    from trioserve.testing import serve_in_process

    worker_dir = os.environ.get("TRIOSERVE_WORKER_DIR")
    settings = Settings(engine="llama", host="127.0.0.1", port=0, log_level="warning",
                        worker_bin=str(Path(worker_dir) / "trioserve-llama-worker") if worker_dir else "",
                        max_context=1024, slots=2, threads=1)
    async with serve_in_process(settings, ready_timeout=120) as srv:
        client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
        model = srv.quart_app.services.default.chat.core.model_id
        conversation = dict(model=model, system="You are a helpful assistant.",
                            messages=[{"role": "user", "content": "Name one colour."}])
        msg = await client.messages.create(max_tokens=12, extra_body={"temperature": 0}, **conversation)
        assert msg.content and msg.content[0].type == "text" and msg.content[0].text
        assert msg.stop_reason in ("end_turn", "max_tokens") and 1 <= msg.usage.output_tokens <= 12
        count = await client.messages.count_tokens(**conversation)
        assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
        async with client.messages.stream(max_tokens=12, extra_body={"temperature": 0},
                                          **conversation) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert final.content[0].text == text and text
        # Greedy, same prompt: the same answer; the whole prompt but its last token was resident.
        assert text == msg.content[0].text
        assert final.usage.cache_read_input_tokens == count.input_tokens - 1
        await client.close()


TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"


@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_budget_cuts_the_reasoning_and_the_model_answers(tmp_path, stream):
    """A reasoning block longer than budget_tokens is cut near the budget (the fake model
    thinks 3000 tokens); a second generation answers after the closed block, and the client
    sees one message: thinking then text, usage summing both generations' output."""
    thinking = "<think>\n" + "r" * 3000 + "\n</think>\n\nnever sent"
    async with live_server(tmp_path, script=[thinking, "final answer"], worker_args="--token-delay-ms 1",
                           chat_template=str(TEMPLATES / "qwen3.jinja")) as srv:
        client = sdk(srv)
        request = dict(model="fake", max_tokens=4000, messages=[{"role": "user", "content": "Think."}],
                       thinking={"type": "enabled", "budget_tokens": 1024})
        if stream:
            async with client.messages.stream(**request) as s:
                msg = await s.get_final_message()
        else:
            msg = await client.messages.create(**request)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        reasoning = msg.content[0].thinking
        assert set(reasoning) == {"r"} and 1000 <= len(reasoning) < 3000, len(reasoning)
        assert msg.content[1].text == "final answer" and msg.stop_reason == "end_turn"
        done = [r for r in srv.pool.history if r.get("type") == "done"]
        assert len(done) == 2 and done[0]["cancelled"] and not done[1]["cancelled"]
        assert 1024 <= done[0]["completion_tokens"] < 3000
        assert msg.usage.output_tokens == done[0]["completion_tokens"] + len("final answer")
        # The answer's prompt is the first prompt plus the closed reasoning block.
        assert done[1]["prompt_tokens"] >= done[0]["prompt_tokens"] + len(reasoning) + len("<think>\n\n</think>\n\n")
        await client.close()


async def test_reasoning_within_the_budget_is_one_generation(tmp_path):
    async with live_server(tmp_path, script=["<think>\nshort\n</think>\n\nanswer"],
                           chat_template=str(TEMPLATES / "qwen3.jinja")) as srv:
        client = sdk(srv)
        msg = await client.messages.create(model="fake", max_tokens=4000, thinking={"type": "enabled", "budget_tokens": 1024},
                                           messages=[{"role": "user", "content": "Think."}])
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking.strip() == "short" and msg.content[1].text == "answer"
        assert len([r for r in srv.pool.history if r.get("type") == "done"]) == 1
        await client.close()


async def test_tool_use_block_stops_when_the_call_ends_not_at_the_end(tmp_path):
    """The tool_use block's content_block_stop arrives while the model is still generating
    (1000 more tokens at 2 ms each follow the call), not with the message's end."""
    script = ["Checking.\n" + CALL + "\n" + "x" * 1000]
    async with live_server(tmp_path, script=script, worker_args="--token-delay-ms 2") as srv, \
            srv.client() as client:
        body = {"model": "fake", "max_tokens": 4000, "stream": True, "tools": [WEATHER],
                "messages": [{"role": "user", "content": "Weather?"}]}
        tool_index, stopped_while_generating, names = None, None, []
        pending = ""
        async with client.stream("POST", "/v1/messages", json=body) as resp:
            async for chunk in resp.aiter_text():
                pending += chunk
                *complete, pending = pending.split("\n\n")
                for block in complete:
                    data = json.loads(block.split("\ndata: ", 1)[1])
                    names.append(data["type"])
                    if data["type"] == "content_block_start" and data["content_block"]["type"] == "tool_use":
                        tool_index = data["index"]
                    if data["type"] == "content_block_stop" and data["index"] == tool_index:
                        generating = not any(r.get("type") == "done" for r in srv.pool.history)
                        stopped_while_generating = generating
        assert stopped_while_generating is True
        assert names[-1] == "message_stop" and names.count("content_block_start") == 3  # text, tool, text
