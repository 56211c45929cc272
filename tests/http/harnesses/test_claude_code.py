"""Claude Code (``@anthropic-ai/claude-code``, npm) against trioserve on the fake engine.

``test_claude_code_completes_a_tool_turn`` installs the CLI into a test-local directory
(``.test-npm/`` at the repository root, git-ignored; reused when present) and runs
``claude -p`` with ``ANTHROPIC_BASE_URL`` = the test server. The scripted model first calls
Claude Code's ``Write`` tool, then answers; the test checks that the file was written by
Claude Code (so it parsed our SSE stream and the ``tool_use`` block) and that the final
answer is printed. It skips, with the reason, only when npm or the package is unavailable.

``test_recorded_claude_code_requests_replay`` runs without npm: it replays the requests
Claude Code sent in such a run (``tests/data/claude_code_requests.json``; the vendor's prompt
texts are replaced by filler of the same length, shapes, keys, headers and sizes are kept) and
checks the answers. ``TRIOSERVE_RECORD_CLAUDE_CODE=1`` rewrites that fixture from a live run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from trioserve.api.messages import adapter as messages_api

from ..conftest import live_server
from ..npm_clients import npm_client

pytestmark = pytest.mark.usefixtures("no_leaks")

PACKAGE = "@anthropic-ai/claude-code@2.1.332"
REPO = Path(__file__).resolve().parents[3]
NPM_DIR = Path(os.environ.get("TRIOSERVE_NPM_DIR", REPO / ".test-npm"))
FIXTURE = REPO / "tests" / "data" / "claude_code_requests.json"
BILLING_PREFIX = "x-anthropic-billing-header:"
# Headers of the recorded requests worth keeping (the rest are transport or per-machine).
KEPT_HEADERS = ("content-type", "accept", "user-agent", "x-claude-code-session-id", "anthropic-beta",
                "anthropic-version", "x-api-key", "x-app")


def claude_binary() -> Path:
    """The ``claude`` executable, installed into NPM_DIR on first use; skips when it cannot be."""
    return npm_client(NPM_DIR, [PACKAGE], "claude", timeout=600)


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Recorder:
    """Records every Messages request body and its headers, in arrival order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.requests: list[dict[str, Any]] = []
        create, count = messages_api.ServingMessages.create, messages_api.ServingMessages.count_tokens
        recorder = self

        async def recording_create(self: Any, body: bytes, **kw: Any) -> Any:
            recorder.add("/v1/messages", body, kw.get("headers"))
            return await create(self, body, **kw)

        async def recording_count(self: Any, body: bytes, **kw: Any) -> Any:
            recorder.add("/v1/messages/count_tokens", body, kw.get("headers"))
            return await count(self, body, **kw)

        monkeypatch.setattr(messages_api.ServingMessages, "create", recording_create)
        monkeypatch.setattr(messages_api.ServingMessages, "count_tokens", recording_count)

    def add(self, path: str, body: bytes, headers: Any) -> None:
        kept = {k.lower(): v for k, v in (headers or {}).items() if k.lower() in KEPT_HEADERS}
        self.requests.append({"path": path, "headers": kept, "body": json.loads(body)})


def _filler(text: str) -> str:
    """Placeholder text of ``text``'s length (keeps sizes, drops the vendor's wording)."""
    if text.startswith(BILLING_PREFIX):
        return text
    pattern = "lorem ipsum dolor sit amet "
    return (pattern * (len(text) // len(pattern) + 1))[:len(text)]


def redact(value: Any, key: str = "") -> Any:
    """Every free text (``text``, ``description``, string ``content``, metadata) replaced by
    filler of the same length; names, ids, schemas' structure and settings kept."""
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str) and key in ("text", "description", "content", "user_id"):
        return _filler(value)
    return value


async def run_claude(binary: Path, srv: Any, work: Path, home: Path, prompt: str,
                     model: str | None = "fake", quiet: bool = True) -> subprocess.CompletedProcess:
    """``claude -p prompt`` against ``srv``; ``model`` None: Claude Code's default names;
    ``quiet`` False: its background calls too (only the base URL and a key set)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "ANTHROPIC_BASE_URL": srv.url, "ANTHROPIC_API_KEY": "test-key"}
    if quiet:
        env.update(CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1",
                   DISABLE_AUTOUPDATER="1")
    chosen = ["--model", model] if model is not None else []
    with trio.fail_after(240):
        return await trio.run_process(
            [str(binary), "-p", prompt, *chosen, "--allowedTools", "Write",
             "--permission-mode", "acceptEdits"],
            env=env, cwd=str(work), capture_stdout=True, capture_stderr=True, check=False)


@pytest.mark.slow
async def test_claude_code_completes_a_tool_turn(tmp_path, monkeypatch):
    binary = claude_binary()
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    target = work / "hello.txt"
    script = [tool_call("Write", {"file_path": str(target), "content": "hello from the fake model\n"}),
              "I wrote hello.txt."]
    recorder = Recorder(monkeypatch)
    # Claude Code's prompt is tens of thousands of bytes: one token each in the fake tokenizer.
    async with live_server(tmp_path, script=script, max_context=400_000) as srv:
        result = await run_claude(binary, srv, work, home, "Create hello.txt")
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert target.read_text() == "hello from the fake model\n"
    assert "I wrote hello.txt." in result.stdout.decode()
    paths = [r["path"] for r in recorder.requests]
    assert paths.count("/v1/messages") == 2, paths
    second = [r for r in recorder.requests if r["path"] == "/v1/messages"][1]["body"]
    blocks = [b for m in second["messages"] if isinstance(m["content"], list) for b in m["content"]]
    # Claude Code sent our tool_use block back with its result.
    assert any(b["type"] == "tool_use" and b["name"] == "Write" for b in blocks)
    assert any(b["type"] == "tool_result" for b in blocks)
    if os.environ.get("TRIOSERVE_RECORD_CLAUDE_CODE") == "1":
        FIXTURE.write_text(json.dumps({"package": PACKAGE, "script": script,
                                       "requests": redact(recorder.requests)}, indent=1) + "\n")


@pytest.mark.slow
async def test_claude_code_default_names_reach_two_models_by_alias(tmp_path, monkeypatch):
    """Nothing configured in Claude Code but the base URL and a key: its main model's default
    name (claude-opus-…) reaches the "coder" model by the 'claude-*' alias and its small
    model's (``--model haiku``: claude-haiku-…) the "small" model by 'claude-*haiku*', which
    is tried first. (This version sends no background call of its own in ``-p`` mode, so the
    small model's name is asked for directly.)"""
    binary = claude_binary()
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    target = work / "hello.txt"
    coder = [tool_call("Write", {"file_path": str(target), "content": "hello from the coder\n"}),
             "I wrote hello.txt."]
    (tmp_path / "coder.json").write_text(json.dumps(coder))
    (tmp_path / "small.json").write_text(json.dumps(["The small model answers."]))
    config = tmp_path / "models.toml"
    config.write_text("""
[[models]]
id = "coder"
engine = "fake"
[models.settings]
fake_script = "coder.json"

[[models]]
id = "small"
engine = "fake"
[models.settings]
fake_script = "small.json"
""")
    served: list[tuple[str, str]] = []  # (model sent, model that served it)
    create = messages_api.ServingMessages.create

    async def noting_create(self: Any, body: bytes, **kw: Any) -> Any:
        served.append((json.loads(body)["model"], self.core.model_id))
        return await create(self, body, **kw)

    monkeypatch.setattr(messages_api.ServingMessages, "create", noting_create)
    async with live_server(tmp_path, models_config=str(config), max_context=400_000,
                           model_alias="claude-*haiku*=small\nclaude-*=coder") as srv:
        main = await run_claude(binary, srv, work, home, "Create hello.txt", model=None,
                                quiet=False)
        small = await run_claude(binary, srv, work, home, "Say something", model="haiku",
                                 quiet=False)
    assert main.returncode == 0, main.stderr.decode()[-2000:]
    assert target.read_text() == "hello from the coder\n"
    assert "I wrote hello.txt." in main.stdout.decode()
    assert small.returncode == 0, small.stderr.decode()[-2000:]
    assert "The small model answers." in small.stdout.decode()
    print("\nrequests (sent, served by):", served)
    assert [by for _, by in served] == ["coder", "coder", "small"], served
    assert served[0][0].startswith("claude-") and "haiku" not in served[0][0]
    assert "haiku" in served[2][0]


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            name, data = block.split("\n", 1)
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_recorded_claude_code_requests_replay(tmp_path):
    """The recorded requests (second one carrying the first answer's tool_use and its result)
    are served with the stream Claude Code consumed: message_start … message_stop, a tool_use
    block for Write, then text."""
    recorded = json.loads(FIXTURE.read_text())
    requests = [r for r in recorded["requests"] if r["path"] == "/v1/messages"]
    assert recorded["package"] == PACKAGE and len(requests) == 2
    async with live_server(tmp_path, script=recorded["script"], max_context=400_000) as srv, \
            srv.client() as client:
        answers = []
        for req in requests:
            resp = await client.post(req["path"] + "?beta=true", json=req["body"], headers=req["headers"])
            assert resp.status_code == 200, resp.text
            events = sse_events(resp.content)
            names = [name for name, _ in events]
            assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
            answers.append(events)
        tool_starts = [d["content_block"] for n, d in answers[0] if n == "content_block_start"]
        assert [b["type"] for b in tool_starts] == ["tool_use"] and tool_starts[0]["name"] == "Write"
        assert answers[0][-2][1]["delta"]["stop_reason"] == "tool_use"
        text = "".join(d["delta"]["text"] for n, d in answers[1] if n == "content_block_delta")
        assert text == "I wrote hello.txt." and answers[1][-2][1]["delta"]["stop_reason"] == "end_turn"
        # Same session and system prompt (the billing line is dropped): the second turn reuses
        # the first up to where Claude Code rewrote its in-conversation system message.
        usage = answers[1][-2][1]["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
        print(f"\nsecond turn: {usage['cache_read_input_tokens']} of {prompt} prompt tokens reused")
        assert usage["cache_read_input_tokens"] > 0.5 * prompt
