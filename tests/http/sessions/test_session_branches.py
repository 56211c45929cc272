"""Sessions as trees over real HTTP on the fake worker (spec §12 "Branches", "Divergence
report"): a sub-agent's request under its parent's session key runs in a branch of its own,
started from the shared prefix, and the main conversation's next turn still finds its state;
the bound on branches evicts the least recently used; a prompt that stops matching its
session is reported in usage, the access log and /metrics.

The fake tokenizer is one token per UTF-8 byte, so prompt sizes are plain character counts.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from ..conftest import live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

REPLY = "Done: I looked at it."
SYSTEM = "You are a coding agent. Follow the rules below.\n" + "Rule: keep answers short.\n" * 40
TOOLS_ANTHROPIC = [{"name": name, "description": f"The {name} tool. " * 6,
                    "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}}}
                   for name in ("Bash", "Read", "Edit", "Agent")]
TOOLS_OPENAI = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}}
                for t in TOOLS_ANTHROPIC]
MAIN_TASK = "Refactor the parser module and explain what you changed. " * 4
SUB_TASK = "Search the repository for every caller of parse() and list them."


def messages_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 64,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli"},
                       {"type": "text", "text": SYSTEM}],
            "tools": TOOLS_ANTHROPIC, "messages": messages}


async def claude(client, messages: list[dict[str, Any]], session: str = "cc-1",
                 **headers: str) -> dict[str, Any]:
    resp = await client.post("/v1/messages", json=messages_body(messages),
                             headers={"x-claude-code-session-id": session, **headers})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def prompt_of(usage: dict[str, Any]) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"]


async def claude_main_sub_main(client, **sub_headers: str) -> tuple[dict, dict, dict]:
    main1 = [{"role": "user", "content": MAIN_TASK}]
    u1 = await claude(client, main1)
    us = await claude(client, [{"role": "user", "content": SUB_TASK}], **sub_headers)
    main2 = main1 + [{"role": "assistant", "content": REPLY},
                     {"role": "user", "content": "Good. Now add a test for it."}]
    u2 = await claude(client, main2)
    return u1, us, u2


async def test_claude_code_sub_agent_does_not_evict_the_main_conversation(tmp_path, capsys):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        u1, us, u2 = await claude_main_sub_main(client)
        metrics = (await client.get("/metrics")).text
    with capsys.disabled():
        print(f"\nmain 1 prompt {prompt_of(u1)}; sub-agent cached {us['cache_read_input_tokens']} "
              f"of {prompt_of(us)}; main 2 cached {u2['cache_read_input_tokens']} of {prompt_of(u2)}")
    assert u2["cache_read_input_tokens"] >= 0.95 * prompt_of(u1)
    # The sub-agent's first request started from the shared system-and-tools prefix.
    assert us["cache_read_input_tokens"] >= len(SYSTEM)
    assert us["trioserve_divergence"]["message_index"] == 1
    assert us["trioserve_divergence"]["change"] == "text"
    assert us["trioserve_divergence"]["new_branch"] is True
    assert "trioserve_divergence" not in u2 and "trioserve_divergence" not in u1
    assert re.search(r"^trioserve_session_branches_total 1\.0$", metrics, re.M)
    assert re.search(r'^trioserve_prompt_divergences_total\{change="text"\} 1\.0$', metrics, re.M)


async def test_with_one_branch_the_sub_agent_overwrites_the_main_conversation(tmp_path):
    # The control for the test above: branching off, the old behaviour is back.
    async with live_server(tmp_path, script=[REPLY], session_branches=1) as srv, srv.client() as client:
        u1, _, u2 = await claude_main_sub_main(client)
    assert u2["cache_read_input_tokens"] < 0.95 * prompt_of(u1)


async def test_agent_ids_name_the_branches(tmp_path):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        main1 = [{"role": "user", "content": MAIN_TASK}]
        await claude(client, main1, **{"x-claude-code-agent-id": "main"})
        us = await claude(client, [{"role": "user", "content": SUB_TASK}],
                          **{"x-claude-code-agent-id": "agent-2"})
        bad = await client.post("/v1/messages", json=messages_body(main1),
                                headers={"x-claude-code-session-id": "cc-1", "x-claude-code-agent-id": ""})
    assert us["trioserve_divergence"]["branch"] == "main" and us["trioserve_divergence"]["new_branch"]
    assert bad.status_code == 400 and "x-claude-code-agent-id" in bad.text


def chat_history(task: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


async def chat(client, messages: list[dict[str, Any]], key: str = "conv-1") -> dict[str, Any]:
    body = {"model": "fake", "messages": messages, "tools": TOOLS_OPENAI, "prompt_cache_key": key}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


async def test_prompt_cache_key_on_chat_and_responses_keeps_the_main_branch(tmp_path):
    async with live_server(tmp_path, script=[REPLY]) as srv, srv.client() as client:
        u1 = await chat(client, chat_history(MAIN_TASK))
        us = await chat(client, chat_history(SUB_TASK))
        u2 = await chat(client, chat_history(MAIN_TASK) + [
            {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Next."}])
        # Responses: the same shape under its own key.
        def responses_body(task: str, more: list[dict[str, Any]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
            return {"model": "fake", "instructions": SYSTEM, "prompt_cache_key": "resp-1", "store": False,
                    "input": [{"role": "user", "content": task}, *more]}
        r1 = (await client.post("/v1/responses", json=responses_body(MAIN_TASK))).json()["usage"]
        rs = (await client.post("/v1/responses", json=responses_body(SUB_TASK))).json()["usage"]
        r2 = (await client.post("/v1/responses", json=responses_body(MAIN_TASK, [
            {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Next."}]))).json()["usage"]
    assert u2["prompt_tokens_details"]["cached_tokens"] >= 0.95 * u1["prompt_tokens"]
    assert us["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM)
    assert us["trioserve_divergence"]["new_branch"] is True
    assert r2["input_tokens_details"]["cached_tokens"] >= 0.95 * r1["input_tokens"]
    assert rs["input_tokens_details"]["cached_tokens"] >= len(SYSTEM)
    assert rs["trioserve_divergence"]["message_index"] == 1


async def test_the_branch_bound_evicts_the_least_recently_used(tmp_path):
    async with live_server(tmp_path, script=[REPLY], session_branches=2, slots=6) as srv, \
            srv.client() as client:
        main = chat_history(MAIN_TASK)
        await chat(client, main)
        sub_a = chat_history("Sub-agent A: read the docs.")
        await chat(client, sub_a)
        await chat(client, chat_history(MAIN_TASK) + [  # main used last
            {"role": "assistant", "content": REPLY}, {"role": "user", "content": "Next."}])
        sub_b = await chat(client, chat_history("Sub-agent B: run the tests."))  # evicts A
        # A comes back with its next turn: its branch is gone, a new one opens.
        again = await chat(client, sub_a + [{"role": "assistant", "content": REPLY},
                                             {"role": "user", "content": "Go on."}])
        metrics = (await client.get("/metrics")).text
        gone = await client.delete("/v1/sessions/conv-1")
        twice = await client.delete("/v1/sessions/conv-1")
    assert sub_b["trioserve_divergence"]["new_branch"] is True
    assert again["trioserve_divergence"]["new_branch"] is True
    evictions = re.search(r"^trioserve_session_branch_evictions_total (\S+)$", metrics, re.M)
    assert evictions is not None and float(evictions.group(1)) == 2.0  # A, then one for A again
    assert (gone.status_code, twice.status_code) == (204, 404)


async def test_an_edited_earlier_message_is_named_in_usage_log_and_metrics(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with live_server(tmp_path, script=[REPLY], log_level="info") as srv, srv.client() as client:
        history = chat_history(MAIN_TASK) + [{"role": "assistant", "content": REPLY},
                                             {"role": "user", "content": "Second question."}]
        first = await chat(client, history)
        edited = [dict(m) for m in history]
        edited[1]["content"] = MAIN_TASK.replace("parser", "lexer", 1)
        u = await chat(client, edited + [{"role": "assistant", "content": REPLY},
                                         {"role": "user", "content": "Third."}])
        dated = [dict(m) for m in history]
        dated[0]["content"] = SYSTEM.replace("Rule: keep answers short.", "Today is 2026-12-06.", 1)
        ud = await chat(client, dated, key="conv-2")
        ud = await chat(client, [dict(dated[0], content=SYSTEM.replace(
            "Rule: keep answers short.", "Today is 2026-12-07.", 1)), *dated[1:]], key="conv-2")
        metrics = (await client.get("/metrics")).text
    report = u["trioserve_divergence"]
    assert (report["message_index"], report["change"]) == (1, "text")
    assert report["token_offset"] == u["prompt_tokens_details"]["cached_tokens"]
    # Reuse stopped inside message 1 (its edit is near its start), long before the first
    # request's end.
    assert len(SYSTEM) < report["token_offset"] < first["prompt_tokens"] - len(MAIN_TASK) + 20
    assert (ud["trioserve_divergence"]["change"], ud["trioserve_divergence"]["line"]) == ("system_line", 1)
    assert any("divergence=msg1:text@" in r.getMessage() for r in caplog.records)
    assert re.search(r'^trioserve_prompt_divergences_total\{change="system_line"\} 1\.0$', metrics, re.M)


@pytest.mark.slow
async def test_claude_code_sub_agent_on_the_embedded_model(tmp_path, capsys):
    """The same check on SmolLM2 through llama.cpp (the worker's real state copy)."""
    from .test_sessions_real_model import llama_worker

    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(), threads=2,
                           max_context=4096) as srv, srv.client(timeout=300) as client:
        u1, us, u2 = await claude_main_sub_main(client)
    with capsys.disabled():
        print(f"\nmain 1 prompt {prompt_of(u1)}; sub-agent cached {us['cache_read_input_tokens']} "
              f"of {prompt_of(us)}; main 2 cached {u2['cache_read_input_tokens']} of {prompt_of(u2)}")
    assert u2["cache_read_input_tokens"] >= 0.95 * prompt_of(u1)
    assert us["cache_read_input_tokens"] > 0.5 * prompt_of(us)
