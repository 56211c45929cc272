"""Sessions over real HTTP on the fake worker (spec §12): the session key and its precedence,
key validation, cached_tokens in both response modes, anonymous prefix reuse, LRU eviction
with spill/restore, requests for a busy session waiting behind it, and DELETE.

The fake tokenizer is one token per UTF-8 byte and its template is ChatML, so a follow-up
turn that sends the previous reply back extends the previous prompt + completion exactly:
the reused (cached) prompt tokens must equal the previous turn's prompt + completion.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from ..conftest import live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

REPLY = "Sure, here it is."


def turn_body(history: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": history, **extra}


def first_turn() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are terse. " * 8},
            {"role": "user", "content": "Give me the list."}]


def second_turn(reply: str = REPLY) -> list[dict[str, Any]]:
    return first_turn() + [{"role": "assistant", "content": reply},
                           {"role": "user", "content": "And now the second part, please."}]


async def post(client, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text
    return resp.json()


async def post_stream_usage(client, body: dict[str, Any]) -> dict[str, Any]:
    body = dict(body, stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        raw = await resp.aread()
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    return events[-2]["usage"]


def cached(usage: dict[str, Any]) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


# --- cached_tokens and anonymous prefix reuse ---------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["non_stream", "stream"])
async def test_anonymous_follow_up_reports_the_reused_prefix_as_cached(tmp_path, stream):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        if stream:
            u1 = await post_stream_usage(client, turn_body(first_turn()))
            u2 = await post_stream_usage(client, turn_body(second_turn()))
        else:
            u1 = (await post(client, turn_body(first_turn())))["usage"]
            u2 = (await post(client, turn_body(second_turn())))["usage"]
    assert cached(u1) == 0
    # Everything the first turn left in the slot is the new prompt's prefix.
    assert cached(u2) == u1["prompt_tokens"] + u1["completion_tokens"]
    assert u2["prompt_tokens"] > cached(u2)


async def test_edited_history_reuses_only_the_common_prefix(tmp_path):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        u1 = (await post(client, turn_body(first_turn())))["usage"]
        u2 = (await post(client, turn_body(second_turn("An edited reply."))))["usage"]
    # The replies differ from their first character: exactly the first prompt is shared.
    assert cached(u2) == u1["prompt_tokens"]


# --- session keys -------------------------------------------------------------------------


async def held(client, key: str) -> bool:
    """Whether the server holds session ``key`` (DELETE answers 204, else 404); frees it."""
    resp = await client.delete(f"/v1/sessions/{key}")
    assert resp.status_code in (204, 404), resp.text
    return resp.status_code == 204


@pytest.mark.parametrize("body_fields, headers, winner", [
    ({"prompt_cache_key": "A", "session_id": "C"}, {"x-session-affinity": "B", "x-session-id": "D"}, "A"),
    ({"session_id": "C"}, {"x-session-affinity": "B", "x-session-id": "D"}, "B"),
    ({"session_id": "C"}, {"x-session-id": "D"}, "C"),
    ({}, {"x-session-id": "D"}, "D"),
])
async def test_session_key_precedence(tmp_path, body_fields, headers, winner):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        await post(client, turn_body(first_turn(), **body_fields), headers)
        assert {k: await held(client, k) for k in "ABCD"} == {k: k == winner for k in "ABCD"}


async def test_anonymous_requests_open_no_session(tmp_path):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        await post(client, turn_body(first_turn()))
        resp = await client.delete("/v1/sessions/anything")
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "session_not_found"


@pytest.mark.parametrize("body_fields, headers, param", [
    ({"prompt_cache_key": ""}, {}, "prompt_cache_key"),
    ({"prompt_cache_key": "k" * 257}, {}, "prompt_cache_key"),
    ({"prompt_cache_key": "a\u0001b"}, {}, "prompt_cache_key"),
    ({"session_id": "a\nb"}, {}, "session_id"),
    ({"session_id": ""}, {}, "session_id"),
    ({}, {"x-session-affinity": ""}, "x-session-affinity"),
    ({}, {"x-session-id": "a\tb"}, "x-session-id"),
    ({}, {"x-session-id": "k" * 300}, "x-session-id"),
    # The winning source is checked even when a later one is fine.
    ({"prompt_cache_key": "", "session_id": "ok"}, {}, "prompt_cache_key"),
])
async def test_bad_session_keys_are_invalid_value(tmp_path, body_fields, headers, param):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=turn_body(first_turn(), **body_fields),
                                 headers=headers)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", param)


async def test_longest_valid_key_and_retention_values_are_accepted(tmp_path):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        key = "k" * 256
        for retention in ("in_memory", "24h"):
            await post(client, turn_body(first_turn(), prompt_cache_key=key,
                                         prompt_cache_retention=retention))
        assert await held(client, key)


# --- named sessions: reuse, eviction, spill/restore ---------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["non_stream", "stream"])
async def test_named_session_follow_up_is_cached(tmp_path, stream):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        key = {"prompt_cache_key": "agent-1"}
        if stream:
            u1 = await post_stream_usage(client, turn_body(first_turn(), **key))
            u2 = await post_stream_usage(client, turn_body(second_turn(), **key))
        else:
            u1 = (await post(client, turn_body(first_turn(), **key)))["usage"]
            u2 = (await post(client, turn_body(second_turn(), **key)))["usage"]
        assert cached(u2) == u1["prompt_tokens"] + u1["completion_tokens"]


def other_session_turn(i: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Unrelated conversation number {i}: " + "x" * 40}]


@pytest.mark.parametrize("budget, restored", [(1 << 20, True), (0, False)],
                         ids=["spilled", "dropped"])
async def test_evicted_session_is_restored_from_spill(tmp_path, budget, restored):
    # capacity 2: one bindable slot, so every other session evicts the previous one.
    async with live_server(tmp_path, script=[REPLY], worker_args="--capacity 2",
                           spill_budget_bytes=budget) as srv, srv.client() as client:
        u1 = (await post(client, turn_body(first_turn(), prompt_cache_key="A")))["usage"]
        for i in range(2):  # B evicts A, then an anonymous request runs too
            await post(client, turn_body(other_session_turn(i), prompt_cache_key="B"))
            await post(client, turn_body(other_session_turn(i + 10)))
        u2 = (await post(client, turn_body(second_turn(), prompt_cache_key="A")))["usage"]
        records = srv.quart_app.services.default.pool.history
        last = [r for r in records if r.get("session_id") == "A"][-1]
    if restored:
        assert cached(u2) == u1["prompt_tokens"] + u1["completion_tokens"]
        assert last["prefill_plan"] == "restored"
        assert last["restored_prompt_tokens"] == cached(u2)
    else:
        assert cached(u2) < u1["prompt_tokens"]
        assert last["prefill_plan"] != "restored"


async def test_more_sessions_than_slots_all_succeed_concurrently(tmp_path):
    async with live_server(tmp_path, script=[REPLY], worker_args="--capacity 2 --token-delay-ms 5") as srv, \
            srv.client() as client:
        results: dict[int, int] = {}

        async def one(i: int) -> None:
            resp = await client.post("/v1/chat/completions",
                                     json=turn_body(other_session_turn(i), prompt_cache_key=f"s{i}"))
            results[i] = resp.status_code

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(one, i)
        assert results == {i: 200 for i in range(5)}


async def test_requests_for_a_busy_session_wait_behind_it(tmp_path):
    # Four requests on one session at once: the runtime runs them one after another (the
    # worker's session_busy never reaches a client), each one extending the same slot.
    async with live_server(tmp_path, script=[REPLY], worker_args="--capacity 4 --token-delay-ms 10") as srv, \
            srv.client() as client:
        statuses: list[int] = []

        async def one() -> None:
            resp = await client.post("/v1/chat/completions",
                                     json=turn_body(first_turn(), prompt_cache_key="shared"))
            statuses.append(resp.status_code)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
        assert statuses == [200] * 4
        history = srv.quart_app.services.default.pool.history
        assert [r["type"] for r in history] == ["done"] * 4
        assert all(r["session_id"] == "shared" for r in history)
        # One at a time: every later request found the earlier one's prompt resident.
        assert sum(r["reused_prompt_tokens"] > 0 for r in history) == 3


# --- DELETE /v1/sessions/{key} ------------------------------------------------------------


async def test_delete_session(tmp_path):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        missing = await client.delete("/v1/sessions/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "session_not_found"
        u1 = (await post(client, turn_body(first_turn(), prompt_cache_key="gone")))["usage"]
        deleted = await client.delete("/v1/sessions/gone")
        assert deleted.status_code == 204 and deleted.content == b""
        assert (await client.delete("/v1/sessions/gone")).status_code == 404
        # The session starts over (an anonymous slot may still share the prefix, which is
        # fine: it reports what was really reused).
        u2 = (await post(client, turn_body(second_turn(), prompt_cache_key="gone")))["usage"]
        assert cached(u2) <= u1["prompt_tokens"] + u1["completion_tokens"]
        too_long = await client.delete("/v1/sessions/" + "k" * 257)
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "invalid_value"


# --- token-id replay of the session's own assistant turns ----------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
# Compact JSON: the server re-renders a call with spaces, so without replay the text differs.
COMPACT_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


def tool_history(call: dict[str, Any]) -> list[dict[str, Any]]:
    return first_turn() + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}]


@pytest.mark.parametrize("edit, replayed", [(False, True), (True, False)], ids=["unchanged", "edited"])
async def test_assistant_tool_call_turn_is_replayed_as_generated_ids(tmp_path, edit, replayed):
    async with live_server(tmp_path, script=[COMPACT_CALL, "It is 21 degrees."]) as srv, \
            srv.client() as client:
        first = await post(client, turn_body(first_turn(), tools=TOOLS, prompt_cache_key="t"))
        call = first["choices"][0]["message"]["tool_calls"][0]
        u1 = first["usage"]
        if edit:
            call = dict(call, function={"name": "get_weather", "arguments": '{"city": "Rome"}'})
        second = await post(client, turn_body(tool_history(call), tools=TOOLS, prompt_cache_key="t"))
    full = u1["prompt_tokens"] + u1["completion_tokens"]
    if replayed:
        # The call's JSON is re-rendered with spaces, yet the prompt holds the generated ids.
        assert cached(second["usage"]) == full
    else:
        assert cached(second["usage"]) < full


async def test_delete_forgets_the_remembered_turns(tmp_path):
    async with live_server(tmp_path, script=[COMPACT_CALL, "It is 21 degrees."]) as srv, \
            srv.client() as client:
        first = await post(client, turn_body(first_turn(), tools=TOOLS, prompt_cache_key="t"))
        call = first["choices"][0]["message"]["tool_calls"][0]
        u1 = first["usage"]
        assert (await client.delete("/v1/sessions/t")).status_code == 204
        second = await post(client, turn_body(tool_history(call), tools=TOOLS, prompt_cache_key="t"))
    # Rendered from text again: the re-rendered call differs from the generated one.
    assert cached(second["usage"]) < u1["prompt_tokens"] + u1["completion_tokens"]
