"""On the fake engine: request-only errors come before availability, and
chat_template_kwargs follow the honesty rule of reasoning_effort."""

from __future__ import annotations

import pytest

from ..conftest import chat_body, live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


async def test_request_only_errors_come_before_loading(tmp_path):
    async with live_server(tmp_path, script=["x"], wait_ready=False,
                           worker_args="--slow-start-ms 3000") as srv, srv.client() as client:
        assert (await client.get("/health")).json()["status"] == "loading"
        cases = [
            (chat_body(response_format={"type": "xml"}), "response_format.type"),
            (chat_body(response_format={"type": "json_schema"}), "response_format.json_schema"),
            (chat_body(response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "patternProperties": {"a": {}}}}}),
             "response_format.json_schema.schema.patternProperties"),
            (chat_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
             "tool_choice.function.name"),
        ]
        for body, param in cases:
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, (param, r.text)
            assert r.json()["error"]["param"] == param, r.text
        # A valid request still learns that the model is loading.
        ok = await client.post("/v1/chat/completions", json=chat_body(
            response_format={"type": "json_object"}))
        assert ok.status_code == 503 and ok.json()["error"]["code"] == "worker_unavailable"


async def test_chat_template_kwargs_the_template_ignores_are_refused(tmp_path):
    # The fake worker's ChatML template has no thinking switch and reads no custom variable.
    async with live_server(tmp_path, script=["x"] * 3) as srv, srv.client() as client:
        r = await client.post("/v1/chat/completions", json=chat_body(
            chat_template_kwargs={"enable_thinking": True}))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "unsupported_parameter"
        assert error["param"] == "chat_template_kwargs.enable_thinking"
        r = await client.post("/v1/chat/completions", json=chat_body(
            chat_template_kwargs={"persona": "pirate"}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.persona"
        # "No thinking" is what this template does anyway: honoured.
        r = await client.post("/v1/chat/completions", json=chat_body(
            chat_template_kwargs={"enable_thinking": False}))
        assert r.status_code == 200, r.text
