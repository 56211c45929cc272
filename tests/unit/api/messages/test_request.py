"""The Anthropic Messages request without processes (api/messages/request.py): validation and
its mapping to the core request, the billing-line rule, session headers, tool choice and
thinking, and errors that name the parameter (in Anthropic's envelope)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve import errors
from trioserve.api.messages.request import parse_messages_request
from trioserve.core.constraints import constraint_for
from trioserve.api.messages.wire import error_envelope
from trioserve.core.request import ForcedTool


BILLING = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=cli;"


def parse(body: dict[str, Any], headers: dict[str, str] | None = None, **kw: Any):
    body = {"model": "m", "max_tokens": 100, **body}
    return parse_messages_request(json.dumps(body).encode(), served_model="m",
                                  max_body_bytes=1 << 20, headers=headers, **kw)


def user(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_claude_code_shaped_request_maps_to_the_core_request():
    req = parse({
        "system": [{"type": "text", "text": BILLING},
                   {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Be terse."}],
        "messages": [
            user("list files"),
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use Bash", "signature": ""},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "denied"}]},
                {"type": "text", "text": "continue"}]},
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            user("go on")],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END", "END", ""], "temperature": 0.5, "top_k": 5, "stream": True,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"}, "context_management": {"edits": []},
        "metadata": {"user_id": "{\"session\": 1}"}, "cache_control": {"type": "ephemeral"},
        "inference_geo": "us", "speed": "fast", "workspace_id": "w", "user_profile_id": "u",
    }, headers={"x-claude-code-session-id": "sess-1", "anthropic-beta": "whatever-2099"})
    core = req.core
    roles = [m.role for m in core.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user", "system", "user"]
    assert core.messages[0].text == "You are an agent.\nBe terse."  # billing line dropped
    assert req.dropped_billing_line
    assistant = core.messages[2]
    assert assistant.reasoning == "use Bash" and assistant.text == "Listing."
    assert assistant.tool_calls[0].name == "Bash" and assistant.tool_calls[0].arguments == {"command": "ls"}
    assert core.messages[3].tool_call_id == "toolu_1" and core.messages[3].text == "a.txt"
    assert core.messages[4].text == "Error: denied"
    assert core.tool_choice == "required" and core.parallel_tool_calls is False
    assert core.tools[0].parameters == {"type": "object"}
    assert core.stops == ("END",) and core.max_tokens == 100
    assert core.sampling.temperature == 0.5 and core.sampling.top_k == 5
    assert core.session is not None and core.session.key == "sess-1"
    assert core.reasoning_effort is None  # the template reads no effort (default arguments)
    assert req.stream and req.thinking == "adaptive"


def test_billing_line_changes_do_not_change_the_core_request():
    a = parse({"system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "S"}],
               "messages": [user()]})
    b = parse({"system": [{"type": "text", "text": BILLING.replace("abc", "def")},
                          {"type": "text", "text": "S"}], "messages": [user()]})
    assert a.core.messages == b.core.messages
    c = parse({"system": BILLING + "\nS", "messages": [user()]})
    assert c.core.messages == a.core.messages


def test_session_header_precedence_generic_headers_first():
    req = parse({"messages": [user()]}, headers={"x-session-id": "generic",
                                                 "x-claude-code-session-id": "cc"})
    assert req.core.session.key == "generic"
    with pytest.raises(errors.APIError) as exc:
        parse({"messages": [user()]}, headers={"x-claude-code-session-id": ""})
    assert exc.value.param == "x-claude-code-session-id"


def test_tool_choice_variants():
    tools = [{"name": "a", "input_schema": {"type": "object"}}]
    assert parse({"messages": [user()], "tools": tools,
                  "tool_choice": {"type": "tool", "name": "a"}}).core.tool_choice == ForcedTool("a")
    assert parse({"messages": [user()], "tools": tools,
                  "tool_choice": {"type": "none"}}).core.tool_choice == "none"
    assert parse({"messages": [user()], "tools": tools}).core.tool_choice == "auto"


def test_thinking_mapping():
    on = parse({"messages": [user()], "thinking": {"type": "enabled", "budget_tokens": 2000},
                "max_tokens": 4000}, reasoning_effort_supported=True, can_reason=True)
    assert on.core.reasoning_effort == "high"
    off = parse({"messages": [user()], "thinking": {"type": "disabled"}},
                reasoning_effort_supported=True, can_reason=True)
    assert off.core.reasoning_effort == "none"
    effort = parse({"messages": [user()], "output_config": {"effort": "low"}},
                   reasoning_effort_supported=True, can_reason=True)
    assert effort.core.reasoning_effort == "low"


@pytest.mark.parametrize("body, param", [
    ({"messages": [user()], "max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [user(), {"role": "assistant", "content": "prefill"}]}, "messages[1]"),
    ({"messages": [user()], "tools": [{"type": "web_search_20250305", "name": "web_search",
                                       "input_schema": {}}]}, "tools[0].type"),
    ({"messages": [user()], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"messages": [user()], "temperature": 1.5}, "temperature"),
    ({"messages": [user()], "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"messages": [user()], "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"messages": [user()], "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking.budget_tokens"),
    ({"messages": [user()], "max_tokens": 5000, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking"),
    ({"messages": [user()], "mcp_servers": [{}]}, "mcp_servers"),
    ({"messages": [user()], "diagnostics": {"previous_message_id": "msg_1"}}, "diagnostics"),
    ({"messages": [user()], "speed": "warp"}, "speed"),
    ({"messages": [user()], "frobnicate": 1}, "frobnicate"),
    ({"model": "other", "messages": [user()]}, "model"),
])
def test_bad_requests_name_the_parameter(body, param):
    with pytest.raises(errors.APIError) as exc:
        parse(body)
    assert exc.value.param == param, exc.value
    envelope = error_envelope(exc.value)
    assert envelope["type"] == "error" and envelope["error"]["type"] in (
        "invalid_request_error", "not_found_error")
    assert param in envelope["error"]["message"]


def test_core_errors_name_messages_fields():
    """The core's constraint errors carry this API's paths: a tool's ``input_schema``, the
    ``output_config.format`` schema."""
    bad = {"type": "object", "properties": {"n": {"type": "number", "maximum": 3}}}
    req = parse({"messages": [user()], "tool_choice": {"type": "any"}, "tools": [
        {"name": "ok", "input_schema": {"type": "object"}}, {"name": "f", "input_schema": bad}]})
    with pytest.raises(errors.APIError) as info:
        constraint_for(req.core)
    assert info.value.param == "tools[1].input_schema.properties.n.maximum"
    req = parse({"messages": [user()], "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "integer", "minimum": 0}}}})
    with pytest.raises(errors.APIError) as info:
        constraint_for(req.core)
    assert info.value.param == "output_config.format.schema.minimum"
    assert "'output_config.format.schema.minimum'" in info.value.message
