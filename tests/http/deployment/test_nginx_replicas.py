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
from functools import partial

import httpx
import pytest

from ..conftest import fake_worker_path
from testkit.replicas import (
    start_replicas,
    check_a_dead_replicas_sessions_move, check_abandoned_stream_frees_its_replica, check_sessions_stay,
    chat_turn, free_port, nginx_config,
)

def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None)


NGINX = nginx_binary()
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (Debian: apt-get install nginx)")

SESSIONS = 30
TURNS = 5


def chat(client: httpx.Client, key: str | None, turn: int) -> str:
    return chat_turn(client, "x-session-affinity", key, turn)


def test_sessions_stay_on_one_replica_through_nginx_and_survive_a_dead_replica(tmp_path):
    listen = free_port()
    with ExitStack() as stack:
        ports, procs = start_replicas(stack, tmp_path, fake_worker_path())
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
        home = check_sessions_stay(partial(chat, client), SESSIONS, TURNS)

        # Requests without a key spread (nginx: round robin for an empty hash key).
        assert len({chat(client, None, k) for k in range(9)}) >= 2

        check_abandoned_stream_frees_its_replica(client, ports, "x-session-affinity")
        check_a_dead_replicas_sessions_move(procs, home, partial(chat, client), TURNS)
