"""Three `trioserve serve` replicas (fake engine) behind nginx, configured with the block
docs/deployment.md gives (read from the document, ports substituted), so the documented
configuration is the tested one:

- 30 sessions x 5 turns: every turn of a session is answered by one replica;
- requests without a session key spread over the replicas;
- SIGKILL one replica: the next request of every session succeeds, only the dead replica's
  sessions move, and a moved session stays on its new replica;
- a client that disconnects mid-stream through nginx frees the replica's slot (its running
  gauge back to 0 within 2 s, while the stream had seconds of tokens left).

Skipped, with the reason, where nginx is not installed (Debian: `apt-get install nginx`;
.ci/run installs it when it can).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import ExitStack

import httpx
import pytest

from .conftest import fake_worker_path
from .replicas import LONG, free_port, nginx_config, replica, running, wait_healthy

def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


NGINX = nginx_binary()
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (Debian: apt-get install nginx)")

SESSIONS = 30
TURNS = 5


def chat(client: httpx.Client, key: str | None, turn: int) -> str:
    """One short turn (3 tokens); the instance that answered."""
    headers = {"x-session-affinity": key} if key else {}
    body = {"model": "fake", "max_tokens": 3,
            "messages": [{"role": "user", "content": f"turn {turn} of {key}"}]}
    resp = client.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-trioserve-instance"]


def test_sessions_stay_on_one_replica_through_nginx_and_survive_a_dead_replica(tmp_path):
    ports = {f"replica-{k}": free_port() for k in range(3)}
    listen = free_port()
    with ExitStack() as stack:
        procs = {name: stack.enter_context(replica(tmp_path, name, port, fake_worker_path()))
                 for name, port in ports.items()}
        for name, port in ports.items():
            wait_healthy(f"http://127.0.0.1:{port}", procs[name])
        conf = tmp_path / "nginx.conf"
        conf.write_text(nginx_config(tmp_path, listen, list(ports.values())))
        nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(conf)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stack.callback(lambda: (nginx.poll() is None and nginx.terminate(), nginx.wait(10)))
        client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30))
        deadline = time.monotonic() + 15
        while True:  # nginx is up once it answers (the replicas already are)
            try:
                client.get("/health")
                break
            except httpx.TransportError:
                assert nginx.poll() is None, nginx.stderr.read()
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)

        # Every turn of a session on one replica.
        home: dict[str, str] = {}
        for turn in range(TURNS):
            for s in range(SESSIONS):
                key = f"session-{s}"
                instance = chat(client, key, turn)
                assert home.setdefault(key, instance) == instance, (key, turn)
        assert len(set(home.values())) == 3, "30 keys hashed to fewer than 3 replicas"

        # Requests without a key spread (nginx: round robin for an empty hash key).
        assert len({chat(client, None, k) for k in range(9)}) >= 2

        # A client abandoning a stream through nginx frees the replica's slot.
        key = "stream-1"
        body = {"model": "fake", "max_tokens": LONG, "stream": True,
                "messages": [{"role": "user", "content": "a long answer"}]}
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"x-session-affinity": key}) as resp:
            # (nginx consumes trioserve's X-Accel-Buffering: it is addressed to nginx.)
            port = ports[resp.headers["x-trioserve-instance"]]
            chunks = resp.iter_bytes()  # kept: dropping the iterator would close the response
            next(chunks)  # the stream started
            assert running(port) == 1
        left = time.monotonic()
        while running(port) != 0:  # LONG tokens at 5 ms: ~10 s if nothing cancelled it
            assert time.monotonic() - left < 2.0, "the replica kept generating for a gone client"
            time.sleep(0.02)

        # SIGKILL one replica: the next request of every session succeeds, only its sessions move.
        victim = home["session-0"]
        procs[victim].kill()
        procs[victim].wait()
        moved: dict[str, str] = {}
        for turn in (TURNS, TURNS + 1):
            for s in range(SESSIONS):
                key = f"session-{s}"
                instance = chat(client, key, turn)
                if home[key] == victim:
                    assert instance != victim
                    assert moved.setdefault(key, instance) == instance, key  # stays moved
                else:
                    assert instance == home[key], key  # untouched by the other's death
        assert moved, "the dead replica held no session"
