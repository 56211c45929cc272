"""Three `trioserve serve` replicas (fake engine) behind vllm-router (PyPI), started with the
command docs/deployment.md gives (read from the document, addresses and ports substituted), so
the documented command is the tested one:

- 30 sessions x 5 turns keyed on `x-session-id` (consistent hashing): every turn of a session
  is answered by one replica, and the sessions spread over all three;
- requests without a key spread (legacy completions, which the router hashes on their body);
- a client that disconnects mid-stream through the router frees the replica's slot (its running
  gauge back to 0 within 2 s, while the stream had seconds of tokens left);
- SIGKILL one replica: the next request of every session succeeds, only the dead replica's
  sessions move, and a moved session stays on its new replica.

Skipped, with the reason, where the `vllm-router` executable is missing (`pip install
vllm-router`; the test extra installs it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import httpx
import pytest

from ..conftest import fake_worker_path
from testkit.replicas import (
    start_replicas,
    check_a_dead_replicas_sessions_move, check_abandoned_stream_frees_its_replica, check_sessions_stay,
    chat_turn, free_port, router_argv, stop,
)

def router_binary() -> str | None:
    """The launcher next to this interpreter (a venv's bin/, even when not on PATH), else PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


ROUTER = router_binary()
pytestmark = pytest.mark.skipif(
    ROUTER is None, reason="vllm-router is not installed (pip install vllm-router)")

SESSIONS = 30
TURNS = 5


def chat(client: httpx.Client, key: str | None, turn: int) -> str:
    return chat_turn(client, "x-session-id", key, turn)


def start_router(stack: ExitStack, tmp_path: Path, ports: dict[str, int]) -> httpx.Client:
    """vllm-router in front of ``ports`` (the documented command); a client of it, once it
    serves."""
    listen, metrics = free_port(), free_port()
    log = stack.enter_context(open(tmp_path / "router.log", "wb"))
    router = subprocess.Popen(router_argv(ROUTER, listen, metrics, list(ports.values())), stdout=log, stderr=log)
    stack.callback(stop, router, 10)
    client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=30))
    deadline = time.monotonic() + 30
    while True:  # the router serves once it has seen every replica healthy
        try:
            if client.get("/health").status_code == 200:
                return client
        except httpx.TransportError:
            pass
        assert router.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "vllm-router did not start"
        time.sleep(0.1)


def test_sessions_stay_on_one_replica_through_vllm_router_and_survive_a_dead_replica(tmp_path):
    with ExitStack() as stack:
        ports, procs = start_replicas(stack, tmp_path, fake_worker_path())
        client = start_router(stack, tmp_path, ports)

        # Every turn of a session on one replica.
        home = check_sessions_stay(partial(chat, client), SESSIONS, TURNS)

        # Requests without a key spread: legacy completions are hashed on their body.
        spread = set()
        for k in range(9):
            resp = client.post("/v1/completions",
                               json={"model": "fake", "prompt": f"question {k}", "max_tokens": 3})
            assert resp.status_code == 200, resp.text
            spread.add(resp.headers["x-trioserve-instance"])
        assert len(spread) >= 2, spread

        check_abandoned_stream_frees_its_replica(client, ports, "x-session-id")
        check_a_dead_replicas_sessions_move(procs, home, partial(chat, client), TURNS)


def test_a_dead_replicas_session_is_warm_on_the_other_replica_through_a_shared_state_dir(tmp_path):
    """Three replicas behind vllm-router share one state directory (spec/worker-protocol.md §6.4,
    docs/deployment.md). A session's replica writes its state after the turn; SIGKILL that
    replica: the session's next turn, routed to the other replica, starts from the stored state
    and prefills only the new turn (the fake tokenizer is one token a byte)."""
    state = tmp_path / "state"
    with ExitStack() as stack:
        ports, procs = start_replicas(stack, tmp_path, fake_worker_path(),
                                      extra_env={"TRIOSERVE_STATE_DIR": str(state)})
        client = start_router(stack, tmp_path, ports)
        history = [{"role": "system", "content": "You are a careful coding agent. " * 60},
                   {"role": "user", "content": "List the files."}]

        def turn() -> tuple[str, dict]:
            resp = client.post("/v1/chat/completions", headers={"x-session-id": "agent-1"},
                               json={"model": "fake", "max_tokens": 3, "messages": history})
            assert resp.status_code == 200, resp.text
            return resp.headers["x-trioserve-instance"], resp.json()["usage"]

        home, first = turn()
        deadline = time.monotonic() + 20
        while not list(state.glob("*.tss")):  # written off the step path, after the turn
            assert time.monotonic() < deadline, "no state file was written"
            time.sleep(0.05)
        procs[home].kill()
        procs[home].wait()
        history += [{"role": "assistant", "content": "a.py b.py"}, {"role": "user", "content": "And the tests?"}]
        other, second = turn()
        assert other != home
        cached = second["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * first["prompt_tokens"], (first, second)
