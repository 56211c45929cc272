"""Structured outputs over real HTTP.

On the fake worker (no grammar support): validation and wiring — a constrained request is a
400 stating the worker cannot enforce it (never unconstrained output), schema and parameter
errors are 400s naming the parameter, and what reaches the runtime carries the grammar.

On the real model (``slow``; needs the llama worker's protocol-v2 ``grammar`` field): 20
schemas, json_object and forced tool calls always parse and validate, with streaming, stop
strings and cancellation; and the clients people use — the openai SDK's ``parse``, LangChain's
``with_structured_output`` (when installed) and the ``llm`` CLI's ``-o json_object 1``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import trio

from trioserve.core import constraints as structured

from trioserve.worker import protocol as worker_protocol
from trioserve.config import EMBEDDED_MODEL_ID

from testkit.core_requests import constrained_request
from testkit.structured_cases import (CASES, JSON_OBJECT_PROMPTS, MAX_TOKENS, PERSON, TIME_TOOL,
                                TOOL_PROMPTS, WEATHER_TOOL)
from ..conftest import chat_body, live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}


def wire(params) -> dict[str, Any]:
    """The generate record the worker reads for ``params`` (without the id)."""
    return json.loads(worker_protocol.prepare(worker_protocol.Generate(params), max_line_bytes=1 << 24).body)


def serving(srv) -> Any:
    """The serving core (template, profile, what the worker enforces)."""
    return srv.quart_app.services.default.core


def capture_submissions(srv) -> list:
    """Record the GenerateParams every request hands to the runtime (what the worker gets)."""
    seen: list = []
    runtime = srv.pool
    original = runtime.submit

    def submit(params, **kw):
        seen.append(params)
        return original(params, **kw)

    runtime.submit = submit
    return seen


# --- fake worker: no grammar support ------------------------------------------------------

CONSTRAINED = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": SCHEMA_FORMAT}, "response_format"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "parallel_tool_calls": False}, "tool_choice"),
    ({"tools": [TOOL], "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize("extra, param", CONSTRAINED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CONSTRAINED)])
async def test_constraint_on_worker_without_grammar_is_a_400(tmp_path, extra, param):
    async with live_server(tmp_path, script=['{"x": 1}']) as srv, srv.client() as client:
        assert serving(srv).grammar_supported is False
        for stream in (False, True):
            resp = await client.post("/v1/chat/completions", json=chat_body(stream=stream, **extra))
            assert resp.status_code == 400, resp.text
            assert resp.headers["content-type"].startswith("application/json")
            err = resp.json()["error"]
            assert (err["code"], err["param"]) == ("unsupported_parameter", param)
            assert "cannot enforce" in err["message"]
        assert srv.pool.dispatched == 0


async def test_unenforceable_schema_is_a_400_naming_the_keyword(tmp_path):
    schema = {"type": "object", "properties": {"price": {"type": "number", "minimum": 0}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        for stream in (False, True):
            resp = await client.post("/v1/chat/completions",
                                     json=chat_body(stream=stream, response_format=fmt))
            assert resp.status_code == 400
            err = resp.json()["error"]
            assert err["code"] == "invalid_value"
            assert err["param"] == "response_format.json_schema.schema.properties.price.minimum"
        assert srv.pool.dispatched == 0


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema"}}, "missing_required_parameter",
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
     "invalid_value", "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
    ({"tool_choice": "required"}, "invalid_value", "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "invalid_value", "tool_choice.function.name"),
]


@pytest.mark.parametrize("extra, code, param", BAD_REQUESTS, ids=[p for _, _, p in BAD_REQUESTS])
async def test_bad_structured_parameters(tmp_path, extra, code, param):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(**extra))
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == (code, param), err["message"]


async def test_unconstrained_requests_send_no_grammar(tmp_path):
    async with live_server(tmp_path, script=["a", "b", "c"]) as srv, srv.client() as client:
        seen = capture_submissions(srv)
        for extra in ({"response_format": {"type": "text"}}, {"tools": [TOOL]},
                      {"tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": False}):
            resp = await client.post("/v1/chat/completions", json=chat_body(**extra))
            assert resp.status_code == 200, resp.text
        assert [p.grammar for p in seen] == [None, None, None]
        assert all("grammar" not in wire(p) for p in seen)


async def test_grammar_reaches_the_worker_and_its_refusal_is_a_400(tmp_path):
    async with live_server(tmp_path, script=['{"name": "A", "age": 1}']) as srv, srv.client() as client:
        seen = capture_submissions(srv)
        serving(srv).grammar_supported = True  # pretend, so the request reaches the fake worker
        resp = await client.post("/v1/chat/completions",
                                 json=chat_body(response_format=SCHEMA_FORMAT, stop=["}"]))
        [params] = seen
        expected = structured.constraint_for(constrained_request(SCHEMA_FORMAT))
        assert params.grammar == expected.grammar and params.stop == ("}",)
        assert wire(params)["grammar"] == expected.grammar
        # Protocol v2 §6: the fake worker answers a grammar with unsupported_grammar.
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == ("unsupported_parameter", "response_format")
        assert srv.pool.history[-1]["code"] == "unsupported_grammar"


# --- real model -----------------------------------------------------------------------------


def llama_worker_path() -> str:
    """The llama worker under test: $TRIOSERVE_WORKER_DIR's (a fresh build), else the installed one."""
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""


def llama_server(tmp_path):
    return live_server(tmp_path, engine="llama", worker_bin=llama_worker_path(), threads=2,
                       max_context=2048)


def body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": EMBEDDED_MODEL_ID, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": MAX_TOKENS, **extra}


def require_grammar(srv) -> None:
    assert serving(srv).grammar_supported, (
        "the llama worker does not report capabilities.grammar (worker protocol v2 §6): "
        "build the worker from the merged 'worker' branch")


def schema_format(schema: dict[str, Any], name: str = "out") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.slow
async def test_twenty_schemas_parse_and_validate(tmp_path):
    failures = []
    async with llama_server(tmp_path) as srv, srv.client(timeout=300) as client:
        require_grammar(srv)
        for name, prompt, schema in CASES:
            resp = await client.post("/v1/chat/completions",
                                     json=body(prompt, response_format=schema_format(schema)))
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            try:
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                assert choice["finish_reason"] == "stop"
            except (ValueError, jsonschema.ValidationError, AssertionError) as exc:
                failures.append(f"{name}: {exc!r:.200} in {choice!r:.300}")
    assert not failures, f"{len(CASES) - len(failures)}/{len(CASES)} valid:\n" + "\n".join(failures)


@pytest.mark.slow
async def test_json_object_is_an_object_every_time(tmp_path):
    async with llama_server(tmp_path) as srv, srv.client(timeout=300) as client:
        require_grammar(srv)
        for prompt in JSON_OBJECT_PROMPTS:
            resp = await client.post("/v1/chat/completions",
                                     json=body(prompt, response_format={"type": "json_object"}))
            content = resp.json()["choices"][0]["message"]["content"]
            assert isinstance(json.loads(content), dict), content


@pytest.mark.slow
async def test_forced_tool_calls_are_valid_every_time(tmp_path):
    tools = [WEATHER_TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    choices = [("required", False), ({"type": "function", "function": {"name": "get_time"}}, False),
               ("required", True)]
    async with llama_server(tmp_path) as srv, srv.client(timeout=300) as client:
        require_grammar(srv)
        for choice, parallel in choices:
            for prompt in TOOL_PROMPTS:
                resp = await client.post("/v1/chat/completions", json=body(
                    prompt, tools=tools, tool_choice=choice, parallel_tool_calls=parallel))
                result = resp.json()["choices"][0]
                calls = result["message"].get("tool_calls")
                assert result["finish_reason"] == "tool_calls" and calls, result
                assert parallel or len(calls) == 1
                for call in calls:
                    name = call["function"]["name"]
                    assert isinstance(choice, str) or name == "get_time"
                    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


@pytest.mark.slow
async def test_streaming_stop_strings_and_cancellation_with_a_schema(tmp_path):
    fmt = schema_format(PERSON)
    prompt = "Describe Alice, who is 30 years old, as JSON."
    async with llama_server(tmp_path) as srv, srv.client(timeout=300) as client:
        require_grammar(srv)
        plain = (await client.post("/v1/chat/completions", json=body(prompt, response_format=fmt))).json()
        expected = plain["choices"][0]["message"]["content"]
        # streamed: the same JSON, chunk by chunk
        resp = await client.post("/v1/chat/completions",
                                 json=body(prompt, response_format=fmt, stream=True))
        events = parse_sse(resp.content)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        assert text == expected and json.loads(text)
        # a stop string still cuts constrained output
        cut = (await client.post("/v1/chat/completions",
                                 json=body(prompt, response_format=fmt, stop=[","]))).json()
        assert cut["choices"][0]["message"]["content"] == expected.split(",")[0]
        assert cut["choices"][0]["finish_reason"] == "stop"
        # leaving a constrained stream early frees the worker for the next request
        dispatched = srv.pool.dispatched
        async with client.stream("POST", "/v1/chat/completions",
                                 json=body(prompt, response_format=fmt, stream=True)) as stream:
            async for _ in stream.aiter_bytes():
                break
        with trio.fail_after(60):
            while srv.pool.busy:
                await trio.sleep(0.05)
        again = (await client.post("/v1/chat/completions", json=body(prompt, response_format=fmt))).json()
        assert again["choices"][0]["message"]["content"] == expected
        assert srv.pool.dispatched == dispatched + 2


@pytest.mark.slow
async def test_concurrent_generations_keep_their_own_grammar(tmp_path):
    """Generations batched in one worker step each follow their own schema (own grammar state).

    The pairs' schemas exclude each other (closed objects with disjoint required keys), so an
    output that followed the other request's grammar fails validation."""
    by_name = {name: (prompt, schema) for name, prompt, schema in CASES}
    pairs = [("person", "color"), ("sentiment", "weather"), ("address", "event")]
    failures: list[str] = []

    async def one(client: httpx.AsyncClient, name: str, stream: bool) -> None:
        prompt, schema = by_name[name]
        resp = await client.post("/v1/chat/completions", json=body(
            prompt, response_format=schema_format(schema), stream=stream))
        assert resp.status_code == 200, resp.text
        if stream:
            events = parse_sse(resp.content)
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        else:
            text = resp.json()["choices"][0]["message"]["content"]
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name}: {exc!r:.200} in {text!r:.300}")

    async with llama_server(tmp_path) as srv, srv.client(timeout=300) as client:
        require_grammar(srv)
        for a, b in pairs:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, client, a, False)
                nursery.start_soon(one, client, b, True)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
async def test_openai_sdk_parse_with_a_pydantic_model(tmp_path):
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population_millions: int = Field(ge=0, le=100)

    async with llama_server(tmp_path) as srv:
        require_grammar(srv)
        # Closed before the server stops: its pooled connection must not outlive the test.
        with OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0) as client:
            def run():
                return client.chat.completions.parse(
                    model=EMBEDDED_MODEL_ID, temperature=0, max_tokens=MAX_TOKENS, response_format=City,
                    messages=[{"role": "user", "content": "Describe Paris as JSON."}])

            completion = await trio.to_thread.run_sync(run)
    assert isinstance(completion.choices[0].message.parsed, City)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
async def test_langchain_with_structured_output(tmp_path, method):
    import langchain_openai  # the `test` extra installs it
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=30)
        age: int = Field(ge=0, le=120)

    async with llama_server(tmp_path) as srv:
        require_grammar(srv)
        # Our own HTTP client, closed here: by default langchain-openai keeps a process-wide
        # cached one whose pooled connection would outlive the test.
        with httpx.Client(timeout=300) as http_client:
            model = langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                                model=EMBEDDED_MODEL_ID, temperature=0,
                                                max_tokens=MAX_TOKENS, timeout=300, max_retries=0,
                                                http_client=http_client)
            runnable = model.with_structured_output(Person, method=method)
            person = await trio.to_thread.run_sync(runnable.invoke, "Alice is 30. Describe her.")
    assert isinstance(person, Person)


@pytest.mark.slow
async def test_llm_cli_json_object(tmp_path):
    llm_bin = Path(sys.executable).with_name("llm")
    async with llama_server(tmp_path) as srv:
        require_grammar(srv)
        user = tmp_path / "llm-user"
        user.mkdir()
        (user / "extra-openai-models.yaml").write_text(
            f"- model_id: trioserve\n  model_name: {EMBEDDED_MODEL_ID}\n"
            f"  api_base: \"{srv.url}/v1\"\n")
        env = {**os.environ, "LLM_USER_PATH": str(user)}
        with trio.fail_after(300):
            done = await trio.run_process(
                [str(llm_bin), "-m", "trioserve", "-o", "json_object", "1", "-o", "temperature", "0",
                 "--no-log", "Give the capital of France as a JSON object."],
                env=env, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert isinstance(json.loads(done.stdout), dict), done.stdout
