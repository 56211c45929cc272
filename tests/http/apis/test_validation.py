"""Request validation over real HTTP on the fake worker: values clients really send (seed -1,
uint64 seeds) reach the worker in its range, and hostile bodies are clean 400s that never
reach the worker, never restart it and never take the server down."""

from __future__ import annotations

import json

import pytest

from ..conftest import chat_body, live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

HEADERS = {"content-type": "application/json"}


async def test_client_seeds_reach_the_worker_in_its_range(tmp_path):
    # Regression: -1 and 2^32 - 1 used to reach the worker as 2^32 - 1, which it refuses,
    # and the client got a 400 blaming 'messages'.
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        for seed in (-1, 2**32 - 1, 2**32, 2**64 - 1, -(2**63), 0):
            resp = await client.post("/v1/chat/completions", json=chat_body(seed=seed, temperature=0.7))
            assert resp.status_code == 200, (seed, resp.text)
            assert resp.json()["choices"][0]["message"]["content"] == "ok"


def raw_chat(**fields: str) -> bytes:
    """A body whose listed fields are raw JSON text (lone surrogate escapes, odd numbers)."""
    base = {"model": '"fake"', "messages": '[{"role": "user", "content": "hi"}]', **fields}
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in base.items()) + "}").encode()


HOSTILE = [
    (raw_chat(messages=r'[{"role": "user", "content": "a\ud800b"}]'), "invalid_value", "messages[0].content"),
    (raw_chat(stop=r'["\udfff"]'), "invalid_value", "stop[0]"),
    (raw_chat(**{r"\ud800": "1"}), "unsupported_parameter", "\\ud800"),
    (raw_chat(messages=r'[{"role": "assistant", "tool_calls": [{"id": "c", "function": '
                       r'{"name": "f", "arguments": "{\"a\": \"\\ud800\"}"}}]}, {"role": "user", "content": "x"}]'),
     "invalid_value", "messages[0].tool_calls[0].function.arguments"),
    (raw_chat(messages=json.dumps([{"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[" * 100_000}}]}])),
     "invalid_value", "messages[0].tool_calls[0].function.arguments"),
    (b"[" * 100_000, "invalid_json", None),
    (raw_chat(metadata='{"a": ' * 5000 + "1" + "}" * 5000), "invalid_json", None),
    (raw_chat(temperature="1e400"), "invalid_json", None),
    (raw_chat(seed="9" * 5000), "invalid_json", None),
    (raw_chat(temperature="NaN"), "invalid_json", None),
    (raw_chat(top_p="-Infinity"), "invalid_json", None),
]


async def test_hostile_bodies_are_clean_400s_and_the_server_stays_up(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        for raw, code, param in HOSTILE:
            resp = await client.post("/v1/chat/completions", content=raw, headers=HEADERS)
            assert resp.status_code == 400, (raw[:80], resp.text)
            assert resp.headers["content-type"].startswith("application/json")
            err = resp.json()["error"]
            assert (err["code"], err["param"]) == (code, param), err["message"]
        assert srv.pool.dispatched == 0
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200
        assert srv.pool.restarts == 0
