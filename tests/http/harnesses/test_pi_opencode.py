"""pi and opencode against trioserve's ``/v1/chat/completions``.

Each client gets the configuration docs/clients.md documents and one task; the scripted fake
"model" answers with one ``write`` tool call, then a sentence. The client must run the tool
(the file appears with the scripted content), send the tool result back, and print the final
sentence; its second request must reuse the first turn's tokens (the session). opencode's
configuration is read from docs/clients.md itself (only ``baseURL`` changes), so what is
documented is what runs; pi's is written here verbatim but for the port and the window (the
fake worker's tokens are bytes: pi's 4,096-token reply margin needs a larger window there).

Two tests per client, and one on the real model:

- ``test_<client>_completes_a_tool_using_turn`` runs the real client (pi 1.6.0 with its own
  Node 22 from npm; opencode 1.18.33). The clients are big (~350 MB each with their
  dependencies), so the test does NOT install them by default: it uses what is under
  ``build/npm-pi`` / ``build/npm-opencode`` and skips, saying how to install, when they are not
  there. ``TRIOSERVE_INSTALL_AGENT_CLIENTS=1`` makes it install them with npm (the commands
  are in the skip reason and in docs/clients.md). ``TRIOSERVE_RECORD_AGENT_CLIENTS=1`` rewrites
  the fixtures below from what the client sent.
- ``test_recorded_<client>_requests_replay`` replays the recorded requests
  (``tests/data/{pi,opencode}_requests.json``) without npm: same server, same script, same
  checks on each response. This is what CI runs.
- ``test_opencode_answers_on_the_embedded_model`` (slow; skips like the live tests): the
  documented opencode configuration against the real SmolLM2 at trioserve's default context
  (its 8,192-token training context): every request answered 200, no compaction, the answer
  printed, exit 0. The 135M model seldom emits a usable tool call, so the tool-using turn itself
  is the fake worker's test.

The fixtures keep the shapes, keys, headers and sizes of what the clients send but none of
their prose: system prompts and tool descriptions are replaced by filler of the same length.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from trioserve.api.chat import adapter as chat_api

from ..conftest import live_server
from ..npm_clients import npm_client, record_requests
from ..sessions.test_sessions_real_model import llama_worker

pytestmark = pytest.mark.usefixtures("no_leaks")

REPO = Path(__file__).resolve().parents[3]
DATA = REPO / "tests" / "data"
CLIENTS_DOC = REPO / "docs" / "clients.md"
MODEL = "SmolLM2-135M-Instruct"  # the documented model id (docs/clients.md)
# The fake worker's tokens are bytes. pi (~6k bytes of prompt, 4,096 tokens kept for the
# reply) needs more than the documented 8,192 there; the documented opencode configuration
# (~5.5k bytes) runs in the embedded model's own window.
PI_CONTEXT = 65536
OPENCODE_CONTEXT = 8192
TASK = "Write out.txt."
FINAL = "Done: wrote out.txt."
CONTENT = "written by the tool\n"


def _call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@dataclass(frozen=True)
class Client:
    name: str
    packages: tuple[str, ...]  # npm install arguments
    binary: str                # under node_modules/.bin
    path_argument: str         # the write tool's argument naming the file
    context: int               # the fake server's window

    @property
    def prefix(self) -> Path:
        return REPO / "build" / f"npm-{self.name}"

    @property
    def fixture(self) -> Path:
        return DATA / f"{self.name}_requests.json"

    def script(self, target: Path) -> list[str]:
        return [_call("write", **{self.path_argument: str(target), "content": CONTENT}), FINAL]


PI = Client("pi", ("node@22.23.3", "@earendil-works/pi-coding-agent@1.6.0"), "pi", "path",
            PI_CONTEXT)
OPENCODE = Client("opencode", ("opencode-ai@1.18.33",), "opencode", "filePath", OPENCODE_CONTEXT)


def documented_opencode_config(base_url: str) -> dict[str, Any]:
    """The configuration docs/clients.md gives for opencode (the first JSON block of its
    "## opencode" section), with ``baseURL`` pointed at ``base_url``; nothing else changes."""
    section = CLIENTS_DOC.read_text().split("\n## opencode\n", 1)[1].split("\n## ", 1)[0]
    config = json.loads(section.split("```json\n", 1)[1].split("\n```", 1)[0])
    config["provider"]["trioserve"]["options"]["baseURL"] = f"{base_url}/v1"
    return config


def _opencode_argv(binary: Path, task: str) -> list[str]:
    # --title: no title-generation request (one more generation, in an order that is not fixed).
    return [str(binary), "run", "--title", "test", "--model", f"trioserve/{MODEL}", task]


def _client_env(home: Path, work: Path, binary: Path) -> dict[str, str]:
    """A clean home for the client; ``work`` is the project directory."""
    home.mkdir()
    work.mkdir()
    return {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            # opencode takes its project directory from $PWD, not from the process's cwd
            "PWD": str(work),
            # pi runs on the Node its prefix installed (it needs >= 22.19)
            "PATH": f"{binary.parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def _install(client: Client) -> Path:
    binary = client.prefix / "node_modules" / ".bin" / client.binary
    if binary.exists():
        return binary
    command = f"npm install --prefix {client.prefix.relative_to(REPO)} " + " ".join(client.packages)
    if os.environ.get("TRIOSERVE_INSTALL_AGENT_CLIENTS") != "1":
        pytest.skip(f"{client.name} is not installed (~350 MB with its dependencies; "
                    f"test_recorded_{client.name}_requests_replay covers its requests): run "
                    f"`{command}` or set TRIOSERVE_INSTALL_AGENT_CLIENTS=1")
    return npm_client(client.prefix, client.packages, client.binary)


_KEPT_HEADERS = ("content-type", "user-agent", "session_id", "x-client-request-id",
                 "x-session-affinity", "x-session-id")


def _filler(text: str) -> str:
    """Same length, no prose: the fixture keeps sizes, not the vendor's text."""
    return ("lorem ipsum " * (len(text) // 12 + 1))[: len(text)]


def redact(body: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The vendor's prose (system prompt, tool descriptions) replaced by filler; the task,
    the tool call and its result kept; the test's temporary directory replaced by /work."""
    out = json.loads(json.dumps(body).replace(str(workdir), "/work"))
    for message in out.get("messages", []):
        if message.get("role") == "system" and isinstance(message.get("content"), str):
            message["content"] = _filler(message["content"])
        elif message.get("role") == "system" and isinstance(message.get("content"), list):
            for part in message["content"]:
                if isinstance(part.get("text"), str):
                    part["text"] = _filler(part["text"])

    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (_filler(v) if k == "description" and isinstance(v, str) else scrub(v))
                    for k, v in value.items()}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    if "tools" in out:
        out["tools"] = scrub(out["tools"])
    return out


def _sse(raw: bytes) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Text, tool calls (name, arguments) and usage of a streamed chat completion."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    for block in raw.decode().split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        event = json.loads(block[6:])
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                fn = tc.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
    return "".join(text), [calls[k] for k in sorted(calls)], usage


def _check_session_reuse(usages: list[dict[str, Any]]) -> None:
    before, after = usages
    reusable = before["prompt_tokens"] + before["completion_tokens"]
    assert after["prompt_tokens_details"]["cached_tokens"] >= 0.9 * reusable, usages


async def _run_client(client: Client, binary: Path, tmp_path: Path) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    env = _client_env(home, work, binary)
    target = work / "out.txt"
    async with live_server(tmp_path, script=client.script(target), max_context=client.context,
                           model_id=MODEL) as srv:
        log = record_requests(srv, "chat", _KEPT_HEADERS)
        if client is PI:  # docs/clients.md "pi", verbatim but for the port and the window
            (home / ".pi" / "agent").mkdir(parents=True)
            (home / ".pi" / "agent" / "models.json").write_text(json.dumps({"providers": {"trioserve": {
                "baseUrl": f"{srv.url}/v1", "api": "openai-completions", "apiKey": "unused",
                "compat": {"sendSessionAffinityHeaders": True},
                "models": [{"id": MODEL, "name": "SmolLM2 135M (trioserve)", "reasoning": False,
                            "contextWindow": PI_CONTEXT, "maxTokens": 1024}]}}}))
            argv = [str(binary), "-p", "--provider", "trioserve", "--model", MODEL, TASK]
        else:  # docs/clients.md "opencode", read from the docs, only the port changed
            (work / "opencode.json").write_text(json.dumps(documented_opencode_config(srv.url)))
            argv = _opencode_argv(binary, TASK)
        with trio.fail_after(300):
            proc = await trio.run_process(argv, cwd=str(work), env=env, capture_stdout=True,
                                          capture_stderr=True, check=False)
    output = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert target.read_text() == CONTENT, output[-3000:]
    assert FINAL in proc.stdout.decode(errors="replace"), output[-3000:]
    assert len(log) == 2, [entry["body"].get("messages", [])[-1:] for entry in log]
    # The second request carries the tool's result.
    assert any(m.get("role") == "tool" for m in log[1]["body"]["messages"])
    if os.environ.get("TRIOSERVE_RECORD_AGENT_CLIENTS") == "1":
        client.fixture.write_text(json.dumps([{"headers": e["headers"], "body": redact(e["body"], work)}
                                              for e in log], indent=1, ensure_ascii=False) + "\n")


async def _replay(client: Client, tmp_path: Path) -> list[dict[str, Any]]:
    recorded = json.loads(client.fixture.read_text())
    assert len(recorded) == 2
    target = Path("/work/out.txt")  # what redact() made of the recording's directory
    usages = []
    async with live_server(tmp_path, script=client.script(target), max_context=client.context,
                           model_id=MODEL) as srv, srv.client(timeout=60) as client_http:
        for k, entry in enumerate(recorded):
            resp = await client_http.post("/v1/chat/completions", json=entry["body"],
                                          headers=entry["headers"])
            assert resp.status_code == 200, resp.text
            text, calls, usage = _sse(resp.content)
            if k == 0:
                assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
                    ("write", {client.path_argument: str(target), "content": CONTENT})], (text, calls)
            else:
                assert (text, calls) == (FINAL, [])
            usages.append(usage)
    _check_session_reuse(usages)
    return recorded


# The install (or the skip) happens in sync fixtures: a skip raised inside the trio run loses
# its reason in the report.
@pytest.fixture
def pi_binary() -> Path:
    return _install(PI)


@pytest.fixture
def opencode_binary() -> Path:
    return _install(OPENCODE)


async def test_pi_completes_a_tool_using_turn(pi_binary, tmp_path):
    await _run_client(PI, pi_binary, tmp_path)


async def test_opencode_completes_a_tool_using_turn(opencode_binary, tmp_path):
    await _run_client(OPENCODE, opencode_binary, tmp_path)


def _chat_statuses(metrics: str) -> dict[str, float]:
    """HTTP status -> count of ``/v1/chat/completions`` requests, from ``GET /metrics``."""
    statuses: dict[str, float] = {}
    prefix = 'trioserve_http_requests_total{route="/v1/chat/completions",status="'
    for line in metrics.splitlines():
        if line.startswith(prefix):
            status, count = line[len(prefix):].split('"} ')
            statuses[status] = float(count)
    return statuses


def _stop_on_trouble(srv: Any, agent_prompt: str, stop: trio.CancelScope, trouble: list[str]) -> None:
    """Wrap the live server's chat adapter so that the first request that is refused (an
    APIError, e.g. ``context_length_exceeded``) or that is not the build agent's turn (a
    compaction carries the compaction agent's prompt) is noted in ``trouble`` and cancels
    ``stop``: a configuration that sends opencode into its compaction loop fails the test at
    once instead of at the deadline."""
    serving = srv.quart_app.services.default.chat
    original = serving.create

    async def create(body: bytes, **kwargs: Any) -> Any:
        messages = json.loads(body).get("messages") or [{}]
        system = messages[0].get("content") if messages[0].get("role") == "system" else None
        if not (isinstance(system, str) and system.startswith(agent_prompt)):
            trouble.append(f"not the build agent's turn: {str(system)[:200]!r}")
            stop.cancel()
        try:
            return await original(body, **kwargs)
        except Exception as exc:
            trouble.append(f"refused: {exc!r}")
            stop.cancel()
            raise

    serving.create = create


@pytest.mark.slow
async def test_opencode_answers_on_the_embedded_model(opencode_binary, tmp_path):
    """The documented opencode configuration against the real embedded model, trioserve's
    default context (the model's 8,192-token training context): opencode's prompt fits, every
    request it sends is answered 200 (no ``context_length_exceeded``), none is a compaction
    (each is the documented build agent's turn), it prints the model's answer and exits 0."""
    home, work = tmp_path / "home", tmp_path / "work"
    env = _client_env(home, work, opencode_binary)
    (work / "hello.txt").write_text("Hello from trioserve.\n")
    trouble: list[str] = []
    proc = None
    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(),
                           threads=2) as srv, srv.client(timeout=30) as http:
        models = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["context_length"]) for m in models] == [(MODEL, 8192)]
        config = documented_opencode_config(srv.url)
        (work / "opencode.json").write_text(json.dumps(config))
        log = record_requests(srv, "chat", _KEPT_HEADERS)
        stop = trio.CancelScope()
        _stop_on_trouble(srv, config["agent"]["build"]["prompt"], stop, trouble)
        # A deadline so that a hang fails instead of blocking CI; not a speed check.
        with trio.fail_after(1800), stop:
            proc = await trio.run_process(
                _opencode_argv(opencode_binary, "Read hello.txt and tell me what it says."),
                cwd=str(work), env=env, capture_stdout=True, capture_stderr=True, check=False)
        statuses = _chat_statuses((await http.get("/metrics")).text)
    assert not trouble and proc is not None, (trouble, statuses)
    stdout = proc.stdout.decode(errors="replace")
    output = stdout + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert log, output[-3000:]
    # Every request opencode sent was answered 200: no 400 context_length_exceeded.
    assert statuses == {"200": float(len(log))}, (statuses, output[-3000:])
    assert "context_length_exceeded" not in output and "maximum context length" not in output
    limit = config["provider"]["trioserve"]["models"][MODEL]["limit"]
    assert all(entry["body"]["max_tokens"] == limit["output"] for entry in log)
    # The model's answer is printed (what it says is up to a 135M model).
    assert stdout.strip(), output[-3000:]


async def test_recorded_pi_requests_replay(tmp_path):
    recorded = await _replay(PI, tmp_path)
    first = recorded[0]
    # What pi sends with the documented configuration: streamed, usage asked for, the write
    # tool among its tools, its session id in the affinity header (the session key).
    body = first["body"]
    assert body["stream"] is True and body["model"] == MODEL
    assert "write" in {t["function"]["name"] for t in body["tools"]}
    assert first["headers"]["x-session-affinity"]
    assert recorded[1]["headers"]["x-session-affinity"] == first["headers"]["x-session-affinity"]


async def test_recorded_opencode_requests_replay(tmp_path):
    recorded = await _replay(OPENCODE, tmp_path)
    first = recorded[0]
    body = first["body"]
    assert body["stream"] is True and body["model"] == MODEL and body["tool_choice"] == "auto"
    # The documented configuration's tools: the denied ones are left out of the request.
    assert {t["function"]["name"] for t in body["tools"]} == {"edit", "read", "write"}
    # opencode 1.18 sends its session id as x-session-affinity (the session key) by itself.
    assert recorded[1]["headers"]["x-session-affinity"] == first["headers"]["x-session-affinity"]


async def test_opencode_small_model_is_a_second_served_model(opencode_binary, tmp_path, monkeypatch):
    """opencode with ``model`` and ``small_model`` naming two models of one server: its turns
    (a tool call, then the answer) reach the first, its session-title request the second; each
    request is answered by the model it named (docs/models.md)."""
    home, work = tmp_path / "home", tmp_path / "work"
    env = _client_env(home, work, opencode_binary)
    target = work / "out.txt"
    (tmp_path / "main.json").write_text(json.dumps(OPENCODE.script(target)))
    (tmp_path / "small.json").write_text(json.dumps(["Writing out.txt"]))
    models = tmp_path / "models.toml"
    models.write_text(f"""
[[models]]
id = "main"
engine = "fake"
context = {OPENCODE_CONTEXT}
[models.settings]
fake_script = "main.json"

[[models]]
id = "small"
engine = "fake"
context = {OPENCODE_CONTEXT}
[models.settings]
fake_script = "small.json"
""")
    served: list[tuple[str, str]] = []  # (model named, model that answered)
    create = chat_api.ServingChat.create

    async def noting_create(self: Any, body: bytes, **kwargs: Any) -> Any:
        served.append((json.loads(body)["model"], self.core.model_id))
        return await create(self, body, **kwargs)

    monkeypatch.setattr(chat_api.ServingChat, "create", noting_create)
    async with live_server(tmp_path, models_config=str(models)) as srv:
        config = documented_opencode_config(srv.url)
        provider = config["provider"]["trioserve"]
        described = provider["models"].pop(MODEL)
        provider["models"] = {"main": described, "small": dict(described, name="small")}
        config.update(model="trioserve/main", small_model="trioserve/small")
        (work / "opencode.json").write_text(json.dumps(config))
        with trio.fail_after(300):  # no --title: opencode asks its small model for one
            proc = await trio.run_process(
                [str(opencode_binary), "run", "--model", "trioserve/main", TASK], cwd=str(work),
                env=env, capture_stdout=True, capture_stderr=True, check=False)
    output = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    assert target.read_text() == CONTENT, output[-3000:]
    assert all(named == answered for named, answered in served), served
    assert [answered for _, answered in served].count("main") == 2, served
    assert "small" in [answered for _, answered in served], served
