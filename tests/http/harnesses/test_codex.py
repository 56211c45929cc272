"""OpenAI's Codex CLI against trioserve's ``/v1/responses`` on the fake worker (spec §20).

The scripted "model" asks for one shell call (``exec_command``: read a file) and one patch
(``apply_patch`` through the shell, which Codex intercepts and applies itself), then answers.

Two tests:

- ``test_codex_cli_completes_a_shell_call_and_an_apply_patch_edit`` installs ``@openai/codex``
  (pinned below) with npm into ``build/npm-codex`` (kept between runs) and runs ``codex exec``
  with a custom provider (``wire_api = "responses"``) whose base URL is the test server. It
  skips, with the reason, only when npm is missing or the package cannot be installed. With
  ``TRIOSERVE_RECORD_CODEX=1`` it rewrites the fixture below from what Codex sent.
- ``test_recorded_codex_requests_replay`` replays the recorded requests
  (``tests/data/codex_requests.json``) without npm: same server, same script, same checks on
  each response, including the session reuse Codex gets through ``prompt_cache_key``.

The fixture keeps the shapes, keys, headers and sizes of what Codex 0.171.0 sends but none of
its prose: every instruction, description and tool-output text is replaced by filler of the
same length (the vendor's text is not ours to copy).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from ..conftest import live_server
from ..npm_clients import npm_client, record_requests

pytestmark = pytest.mark.usefixtures("no_leaks")

CODEX_PACKAGE = "@openai/codex@0.171.0"
REPO = Path(__file__).resolve().parents[3]
NPM_PREFIX = REPO / "build" / "npm-codex"
FIXTURE = REPO / "tests" / "data" / "codex_requests.json"
# Codex's prompt is ~40k bytes: the fake worker's tokens are bytes.
CONTEXT = 65536


def _call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


PATCH = ("apply_patch <<'EOF'\n*** Begin Patch\n*** Update File: hello.txt\n@@\n-hello world\n"
         "+hello trioserve\n*** End Patch\nEOF\n")
SCRIPT = [_call("exec_command", cmd="cat hello.txt"), _call("exec_command", cmd=PATCH),
          "Changed world to trioserve."]
TASK = "Read hello.txt, then change world to trioserve."


def _filler(text: str) -> str:
    """Same length, no prose: the fixture keeps sizes, not the vendor's text."""
    return ("lorem ipsum " * (len(text) // 12 + 1))[: len(text)]


_PROSE_KEYS = {"text", "description", "output", "instructions"}


def redact(value: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str) and key in _PROSE_KEYS and value not in (TASK,):
        return _filler(value)
    return value


_KEPT_HEADERS = ("accept", "content-type", "originator", "session-id", "thread-id",
                 "x-codex-beta-features", "x-codex-turn-metadata", "x-codex-window-id",
                 "x-client-request-id", "user-agent")


def _install_codex() -> Path:
    return npm_client(NPM_PREFIX, [CODEX_PACKAGE], "codex", timeout=600)


def _check_final_state(work: Path) -> None:
    assert (work / "hello.txt").read_text() == "hello trioserve\n"


async def test_codex_cli_completes_a_shell_call_and_an_apply_patch_edit(tmp_path):
    binary = _install_codex()
    home, work = tmp_path / "codex-home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "hello.txt").write_text("hello world\n")
    async with live_server(tmp_path, script=SCRIPT, max_context=CONTEXT) as srv:
        log = record_requests(srv, "responses", _KEPT_HEADERS)
        (home / "config.toml").write_text(
            'model = "fake"\nmodel_provider = "local"\n[model_providers.local]\nname = "local"\n'
            f'base_url = "{srv.url}/v1"\nwire_api = "responses"\nenv_key = "LOCAL_KEY"\n')
        env = {**os.environ, "LOCAL_KEY": "test-key", "CODEX_HOME": str(home), "HOME": str(tmp_path)}
        with trio.fail_after(180):
            proc = await trio.run_process(
                [str(binary), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access",
                 "-C", str(work), TASK],
                env=env, capture_stdout=True, capture_stderr=True, check=False)
    output = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    _check_final_state(work)
    assert "Changed world to trioserve." in proc.stdout.decode()
    assert len(log) == 3, [entry["body"].get("input", [])[-1:] for entry in log]
    if os.environ.get("TRIOSERVE_RECORD_CODEX") == "1":
        FIXTURE.write_text(json.dumps([redact(entry) for entry in log], indent=1, ensure_ascii=False) + "\n")


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(block.split("\ndata: ", 1)[1]) for block in raw.decode().split("\n\n")
            if block.strip() and not block.startswith(":")]  # skip SSE comments (keep-alives)


async def test_recorded_codex_requests_replay(tmp_path):
    recorded = json.loads(FIXTURE.read_text())
    assert len(recorded) == 3
    first = recorded[0]["body"]
    # What Codex sends (docs: ../shared/reference/agent-clients.md), as recorded.
    assert first["stream"] is True and first["store"] is False and first["tool_choice"] == "auto"
    assert first["include"] == ["reasoning.encrypted_content"] and first["prompt_cache_key"]
    assert [t["type"] for t in first["tools"]].count("namespace") == 1
    assert {"web_search", "function"} <= {t["type"] for t in first["tools"]}
    assert [item["role"] for item in first["input"][:2]] == ["developer", "developer"]
    expected_calls = [json.loads(s.split("\n")[1])["arguments"] for s in SCRIPT[:2]]
    async with live_server(tmp_path, script=SCRIPT, max_context=CONTEXT) as srv, \
            srv.client(timeout=60) as client:
        usages = []
        for k, entry in enumerate(recorded):
            headers = dict(entry["headers"], authorization="Bearer test-key")
            resp = await client.post("/v1/responses", json=entry["body"], headers=headers)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-trioserve-ignored-tools"] == "web_search"
            assert "x-trioserve-ignored-fields" not in resp.headers
            events = _events(resp.content)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            final = events[-1]
            assert final["type"] == "response.completed"
            output = final["response"]["output"]
            if k < 2:
                [item] = output
                assert item["type"] == "function_call" and item["name"] == "exec_command"
                assert json.loads(item["arguments"]) == expected_calls[k]
            else:
                assert output[0]["content"][0]["text"] == "Changed world to trioserve."
            usages.append(final["response"]["usage"])
    # Each turn reuses the whole previous turn (prompt + output): one session per conversation.
    for before, after in zip(usages, usages[1:]):
        reusable = before["input_tokens"] + before["output_tokens"]
        assert after["input_tokens_details"]["cached_tokens"] >= 0.9 * reusable


# What Codex puts on its input items when it is configured with ``openai_base_url`` (after its
# WebSocket attempt, answered 426, it falls back to HTTP). The value's shape was not recorded;
# any value is ignored.
PASSTHROUGH = "internal_chat_message_metadata_passthrough"


async def test_codex_first_request_with_harness_metadata_on_its_items_is_served(tmp_path, caplog):
    """Spec §4.1: the recorded first request with Codex's metadata key on every input item was
    ``400 Unsupported parameter: 'input[0].internal_chat_message_metadata_passthrough'``; it is
    served as the same request without the key, and the response names what was ignored."""
    entry = json.loads(FIXTURE.read_text())[0]
    body = copy.deepcopy(entry["body"])
    for item in body["input"]:
        item[PASSTHROUGH] = {"origin": "codex", "turn": 1}
    headers = dict(entry["headers"], authorization="Bearer test-key")
    expected_call = json.loads(SCRIPT[0].split("\n")[1])["arguments"]
    async with live_server(tmp_path, script=SCRIPT[:1] * 2, max_context=CONTEXT) as srv, \
            srv.client(timeout=60) as client:
        with caplog.at_level(logging.DEBUG, logger="trioserve.responses"):
            resp = await client.post("/v1/responses", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-trioserve-ignored-fields"] == ", ".join(
            f"input[{i}].{PASSTHROUGH}" for i in range(len(body["input"])))
        assert resp.headers["x-trioserve-ignored-tools"] == "web_search"
        final = _events(resp.content)[-1]
        assert final["type"] == "response.completed"
        [item] = final["response"]["output"]
        assert item["type"] == "function_call" and json.loads(item["arguments"]) == expected_call
        logged = [r.getMessage() for r in caplog.records
                  if r.name == "trioserve.responses" and r.levelno == logging.DEBUG]
        assert any(f"input[0].{PASSTHROUGH}" in line for line in logged), logged
        # The key never reached the model: the prompt has the size of the request without it
        # (the fake engine's tokens are bytes).
        plain = await client.post("/v1/responses", json=entry["body"], headers=headers)
        assert plain.status_code == 200, plain.text
        usage = _events(plain.content)[-1]["response"]["usage"]
        assert final["response"]["usage"]["input_tokens"] == usage["input_tokens"]
        # A top-level parameter the server does not know is still refused, naming it.
        refused = await client.post("/v1/responses", json={**body, "internal_metadata": {}},
                                    headers=headers)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported_parameter", "internal_metadata")
