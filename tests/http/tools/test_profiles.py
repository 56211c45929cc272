"""Model profiles over real HTTP: capabilities in /v1/models, tool injection, reasoning_effort,
per-profile reasoning markers and stops, and chat template overrides.

The fake worker echoes the last 64 bytes of its prompt when it has no script and counts one
token per prompt byte, so the prompt trioserve rendered is observable from outside.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trioserve.config import Settings
from trioserve.http.services import build_services
from trioserve.model.profiles import tool_block
from trioserve.registry import RegistryError

from ..conftest import chat_body, fake_worker_path, live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
NO_SWITCH = ("Unsupported parameter: 'reasoning_effort' (this model's chat template has no "
             "thinking switch: it reads neither enable_thinking nor reasoning_effort).")


async def test_models_lists_the_profile_capabilities(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        entry = (await client.get("/v1/models")).json()["data"][0]
    assert entry["id"] == "fake"
    assert entry["capabilities"] == {
        "profile": "chatml", "profile_chosen_by": "template", "tool_format": "hermes",
        "tools": "injected", "thinking_switch": False, "reasoning_effort": False,
        "reasoning_markers": ["<think>", "</think>"]}


async def test_tools_are_injected_when_the_template_cannot_render_them(tmp_path):
    async with live_server(tmp_path) as srv, srv.client() as client:  # echo mode
        plain = (await client.post("/v1/chat/completions", json=chat_body("hi"))).json()
        with_tools = (await client.post("/v1/chat/completions", json=chat_body("hi", tools=[TOOL]))).json()
        off = (await client.post("/v1/chat/completions",
                                 json=chat_body("hi", tools=[TOOL], tool_choice="none"))).json()
    # The fake's ChatML template ignores tools: trioserve adds a system turn with the block,
    # and the fake counts one token per prompt byte.
    system_turn = "<|im_start|>system\n" + tool_block([TOOL]) + "<|im_end|>\n"
    grown = with_tools["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert grown == len(system_turn.encode())
    assert off["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # tool_choice none: not shown


async def test_with_injection_off_tools_are_a_400(tmp_path):
    async with live_server(tmp_path, script=["x"], tools_injection=False) as srv, srv.client() as client:
        caps = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
        resp = await client.post("/v1/chat/completions", json=chat_body(tools=[TOOL]))
        ok = await client.post("/v1/chat/completions", json=chat_body())
        assert srv.pool.dispatched == 1
    assert caps["tools"] == "rejected"
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("unsupported_parameter", "tools")
    assert "does not render tools" in err["message"]
    assert ok.status_code == 200


async def test_reasoning_effort_without_a_thinking_switch_is_a_400(tmp_path):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(reasoning_effort="low"))
        null = await client.post("/v1/chat/completions", json=chat_body(reasoning_effort=None))
        bad = await client.post("/v1/chat/completions", json=chat_body(reasoning_effort="max"))
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": NO_SWITCH, "type": "invalid_request_error",
                                     "param": "reasoning_effort", "code": "unsupported_parameter"}}
    assert null.status_code == 200
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("how", ["setting", "worker"])
async def test_reasoning_effort_switches_thinking_on_a_template_that_has_the_switch(tmp_path, how):
    qwen3 = str(TEMPLATES / "qwen3.jinja")
    source = dict(chat_template=qwen3) if how == "setting" else dict(worker_args=f"--chat-template {qwen3}")
    async with live_server(tmp_path, **source) as srv, srv.client() as client:  # echo mode
        caps = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
        off = (await client.post("/v1/chat/completions", json=chat_body("Hi", reasoning_effort="none"))).json()
        on = (await client.post("/v1/chat/completions", json=chat_body("Hi", reasoning_effort="high"))).json()
        kw = (await client.post("/v1/chat/completions", json=chat_body(
            "Hi", reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}))).json()
    assert (caps["profile"], caps["thinking_switch"], caps["reasoning_effort"], caps["tools"]) == (
        "qwen3", True, True, "template")
    # The echo is the end of the prompt the template rendered.
    assert off["choices"][0]["message"]["content"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on["choices"][0]["message"]["content"].endswith("Hi<|im_end|>\n<|im_start|>assistant\n")
    assert kw["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]


async def test_gemma4_profile_markers_and_stops(tmp_path):
    script = ["<|channel>thought\nPlan it.<channel|>The answer.", "Calling.<|tool_response>invented"]
    async with live_server(tmp_path, script=script * 2,
                           chat_template=str(TEMPLATES / "gemma4.jinja")) as srv, srv.client() as client:
        caps = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
        first = (await client.post("/v1/chat/completions", json=chat_body())).json()
        second = (await client.post("/v1/chat/completions", json=chat_body())).json()
        raw = (await client.post("/v1/chat/completions", json=chat_body(stream=True))).content
    assert caps["profile"] == "gemma4" and caps["reasoning_markers"] == ["<|channel>thought", "<channel|>"]
    assert first["choices"][0]["message"] == {"role": "assistant", "content": "The answer.",
                                              "reasoning_content": "Plan it."}
    assert second["choices"][0]["message"]["content"] == "Calling."  # extra stop <|tool_response>
    assert second["choices"][0]["finish_reason"] == "stop"
    chunks = [c for c in parse_sse(raw) if c != "[DONE]"]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert (reasoning, content) == ("Plan it.", "The answer.")


async def test_profile_setting_overrides_detection(tmp_path):
    async with live_server(tmp_path, script=["[THINK]hmm[/THINK]Yes."], profile="mistral") as srv, \
            srv.client() as client:
        caps = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
        body = (await client.post("/v1/chat/completions", json=chat_body())).json()
    assert (caps["profile"], caps["profile_chosen_by"]) == ("mistral", "setting")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Yes.", "reasoning_content": "hmm"}


async def test_typed_control_tokens_reach_the_model_as_text(tmp_path):
    typed = "<|im_start|>sys\nx"
    async with live_server(tmp_path) as srv, srv.client() as client:  # echo mode
        body = (await client.post("/v1/chat/completions", json=chat_body(typed))).json()
    # The prompt is unchanged (segments concatenate to it), and so is the echo of its end.
    assert body["choices"][0]["message"]["content"].endswith(
        typed + "<|im_end|>\n<|im_start|>assistant\n")


def test_an_unreadable_chat_template_file_stops_startup(tmp_path):
    # Checked as the server is built, before any worker starts (http/model_preview.py): a
    # startup error (`trioserve serve` exits 2 with this one line).
    settings = Settings(engine="fake", worker_bin=fake_worker_path(),
                        chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(RegistryError, match="cannot load the chat template.*missing.jinja"):
        build_services(settings)


# --- the real embedded model ---------------------------------------------------------------


@pytest.mark.slow
async def test_real_model_renders_tools_and_refuses_reasoning_effort(tmp_path):
    async with live_server(tmp_path, engine="llama", worker_bin="", threads=2,
                           max_context=2048) as srv, srv.client(timeout=120) as client:
        model = srv.settings.resolved_model_id()
        caps = (await client.get("/v1/models")).json()["data"][0]["capabilities"]
        base = {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "max_tokens": 1, "temperature": 0}
        plain = (await client.post("/v1/chat/completions", json=base)).json()
        tools = (await client.post("/v1/chat/completions", json={**base, "tools": [TOOL]})).json()
        effort = await client.post("/v1/chat/completions", json={**base, "reasoning_effort": "low"})
    assert caps["profile"] == "chatml" and caps["tools"] == "injected"
    assert tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50
    assert effort.status_code == 400
    assert effort.json()["error"]["message"] == NO_SWITCH
