"""Several `trioserve serve` processes on the fake worker, for the tests that put a real router
in front of them (test_nginx_replicas.py, test_vllm_router_replicas.py) and for
bench/router_bench.py; and the routers' configurations as docs/deployment.md gives them (read
from the document, addresses and ports substituted), so the documented ones are the tested ones.

Each replica names itself with ``--instance-id`` so the ``x-trioserve-instance`` response
header says which one answered. The fake worker decodes 5 ms a token from a 2000-token script
that short requests cut with ``max_tokens``; a stream of ``LONG`` tokens lasts ~10 s.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
from testkit import REPO, free_port

LONG = 2000  # tokens of the scripted reply: 10 s at 5 ms a token
DOC = REPO / "docs" / "deployment.md"


@contextmanager
def replica(tmp: Path, name: str, port: int, worker_bin: str,
            extra_env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`trioserve serve` on the fake worker ``worker_bin`` at ``port``, answering as ``name``
    (``extra_env``: more settings); stopped with SIGTERM (then SIGKILL after 15 s) when the
    block ends, unless already dead."""
    script = tmp / "script.json"
    script.write_text(json.dumps(["z" * LONG]))
    env = dict(os.environ, TRIOSERVE_ENGINE="fake", TRIOSERVE_WORKER_BIN=worker_bin,
               TRIOSERVE_FAKE_SCRIPT=str(script), TRIOSERVE_WORKER_ARGS="--token-delay-ms 5",
               TRIOSERVE_PORT=str(port), TRIOSERVE_INSTANCE_ID=name,
               TRIOSERVE_LOG_LEVEL="warning", **(extra_env or {}))
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trioserve.cli", "serve"], env=env,
                                stdout=log, stderr=log)
    try:
        yield proc
    finally:
        stop(proc)


def start_replicas(stack: Any, tmp: Path, worker_bin: str, count: int = 3,
                   extra_env: dict[str, str] | None = None) -> tuple[dict[str, int], dict[str, subprocess.Popen]]:
    """``count`` replicas named ``replica-K`` on free ports, healthy on return; ``stack`` (an
    ``ExitStack``) stops them. Returns their ports and processes by name."""
    ports = {f"replica-{k}": free_port() for k in range(count)}
    procs = {name: stack.enter_context(replica(tmp, name, port, worker_bin, extra_env))
             for name, port in ports.items()}
    for name, port in ports.items():
        wait_healthy(f"http://127.0.0.1:{port}", procs[name])
    return ports, procs


def stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGTERM, then SIGKILL if ``proc`` is still there after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until ``url``/health answers 200; fails if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{url} did not become ready"
        time.sleep(0.05)


def running(port: int) -> float:
    """The replica's ``trioserve_running_generations`` gauge."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.search(r"^trioserve_running_generations (\S+)$", text, re.M)
    assert found, "no trioserve_running_generations in /metrics"
    return float(found.group(1))


def chat_turn(client: httpx.Client, header: str, key: str | None, turn: int) -> str:
    """One short turn (3 tokens) of session ``key``, sent in ``header`` (no header when
    ``key`` is None); the instance that answered."""
    body = {"model": "fake", "max_tokens": 3,
            "messages": [{"role": "user", "content": f"turn {turn} of {key}"}]}
    resp = client.post("/v1/chat/completions", json=body, headers={header: key} if key else {})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-trioserve-instance"]


def check_sessions_stay(chat: Callable[[str, int], str], sessions: int, turns: int) -> dict[str, str]:
    """Every turn of each session is answered by one replica, and the keys spread over all
    three; returns each session's replica."""
    home: dict[str, str] = {}
    for turn in range(turns):
        for s in range(sessions):
            key = f"session-{s}"
            instance = chat(key, turn)
            assert home.setdefault(key, instance) == instance, (key, turn)
    assert len(set(home.values())) == 3, f"{sessions} keys hashed to fewer than 3 replicas"
    return home


def check_abandoned_stream_frees_its_replica(client: httpx.Client, ports: dict[str, int],
                                             header: str) -> None:
    """A client that abandons a stream through the router frees the replica's slot: its
    running gauge is back to 0 within 2 s (the stream had ~10 s of tokens left)."""
    body = {"model": "fake", "max_tokens": LONG, "stream": True,
            "messages": [{"role": "user", "content": "a long answer"}]}
    with client.stream("POST", "/v1/chat/completions", json=body,
                       headers={header: "stream-1"}) as resp:
        assert resp.status_code == 200
        port = ports[resp.headers["x-trioserve-instance"]]
        chunks = resp.iter_bytes()  # kept: dropping the iterator would close the response
        next(chunks)  # the stream started
        assert running(port) == 1
    left = time.monotonic()
    while running(port) != 0:
        assert time.monotonic() - left < 2.0, "the replica kept generating for a gone client"
        time.sleep(0.02)


def check_a_dead_replicas_sessions_move(procs: dict[str, subprocess.Popen], home: dict[str, str],
                                        chat: Callable[[str, int], str], turn: int) -> None:
    """SIGKILL the replica of ``session-0``: the next two turns of every session succeed, only
    the dead replica's sessions move, and each moved session stays where it moved."""
    victim = home["session-0"]
    procs[victim].kill()
    procs[victim].wait()
    moved: dict[str, str] = {}
    for turn_ in (turn, turn + 1):
        for key, before in home.items():
            instance = chat(key, turn_)
            if before == victim:
                assert instance != victim
                assert moved.setdefault(key, instance) == instance, key  # stays moved
            else:
                assert instance == before, key  # untouched by the other's death
    assert moved, "the dead replica held no session"


def documented_nginx_block() -> str:
    """The ```nginx block of docs/deployment.md."""
    found = re.search(r"```nginx\n(.*?)```", DOC.read_text(), re.S)
    assert found, "docs/deployment.md has no nginx block"
    return found.group(1)


def nginx_config(tmp: Path, listen: int, upstreams: list[int]) -> str:
    block = documented_nginx_block()
    servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+;\n", block, re.M)
    assert len(servers) == len(upstreams), "the documented block names three replicas"
    for line, port in zip(servers, upstreams):
        block = block.replace(line, re.sub(r":\d+;", f":{port};", line), 1)
    block, n = re.subn(r"listen \d+;", f"listen 127.0.0.1:{listen};", block)
    assert n == 1
    # Everything nginx writes stays in the test's directory; one process, in the foreground.
    temp = "\n".join(f"    {name}_temp_path {tmp / name};"
                     for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"daemon off;\nmaster_process off;\npid {tmp / 'nginx.pid'};\n"
            f"error_log {tmp / 'error.log'} warn;\nevents {{ worker_connections 256; }}\n"
            f"http {{\n    access_log off;\n{temp}\n{block}}}\n")


def documented_command() -> list[str]:
    """The ```sh block of docs/deployment.md that runs vllm-router, as argv."""
    for block in re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S):
        argv = shlex.split(block.replace("\\\n", " "))
        if argv and argv[0] == "vllm-router":
            return argv
    raise AssertionError("docs/deployment.md has no vllm-router command")


def router_argv(binary: str, listen: int, metrics: int, upstreams: list[int]) -> list[str]:
    """The documented vllm-router command for ``upstreams`` (loopback ports), listening on
    ``listen``, its own metrics on ``metrics``, run as ``binary``."""
    argv = documented_command()
    urls = argv.index("--worker-urls")
    end = next(i for i in range(urls + 1, len(argv)) if argv[i].startswith("--"))
    assert end - urls - 1 == len(upstreams), "the documented command names three replicas"
    argv[urls + 1:end] = [f"http://127.0.0.1:{port}" for port in upstreams]
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(listen)),
                        ("--prometheus-port", str(metrics))):
        argv[argv.index(flag) + 1] = value
    return [binary, *argv[1:]]
