"""Clients' tokenizer work is bounded and shared (trioserve/tokenize_gate.py), abandoned calls
are cancelled at the worker (runtime), and HTTP/2 resets are a budget (h2_guard.ResetBudget).

On Trio's MockClock with autojump: "waits" and "refused at once" are exact, not wall-clock
guesses.
"""

from __future__ import annotations

import pytest
import trio

from trioserve.http.h2_guard import ResetBudget
from trioserve.worker.runtime import GenerationError
from trioserve.worker.tokenize_gate import GateFull, TokenizeGate, tokenizer_busy
from trioserve.worker.protocol import Ping, Tokenize

from tests.fakes.worker_client import FakeWorkerClient, serving, settle



async def hold(gate: TokenizeGate, client: str, entered: list[str], release: trio.Event,
               task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Take a place for ``client``; note the entry; keep it until ``release``."""
    try:
        async with gate.admit(client):
            entered.append(client)
            task_status.started()
            await release.wait()
    except GateFull:
        entered.append(f"{client}: refused")
        task_status.started()


async def test_places_and_the_per_client_share_refuse_at_once(autojump_clock):
    gate = TokenizeGate(in_flight=1, waiting=3)  # 4 places, 2 per client
    assert gate.per_client == 2
    entered: list[str] = []
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        for client in ("a", "a"):  # one at a time: arrival order is what the test checks
            nursery.start_soon(hold, gate, client, entered, release)
            await settle()
        with pytest.raises(GateFull, match="this client already has 2"):
            async with gate.admit("a"):
                pass
        for client in ("b", "c"):
            nursery.start_soon(hold, gate, client, entered, release)
            await settle()
        with pytest.raises(GateFull, match="4 tokenizer calls"):
            async with gate.admit("d"):
                pass
        assert entered == ["a"]  # one runs, three wait in arrival order
        assert gate.held == 4 and gate.held_by("a") == 2
        release.set()
    assert entered == ["a", "a", "b", "c"]
    assert gate.held == 0 and gate.held_by("a") == 0


async def test_a_waiter_cancelled_leaves_and_frees_its_place(autojump_clock):
    gate = TokenizeGate(in_flight=1, waiting=1)
    release = trio.Event()
    entered: list[str] = []
    scopes: list[trio.CancelScope] = []

    async def waiter() -> None:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            async with gate.admit("b"):
                entered.append("b")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, gate, "a", entered, release)
        await settle()
        nursery.start_soon(waiter)
        await settle()
        assert gate.held == 2
        scopes[0].cancel()  # the client left while waiting
        await settle()
        assert gate.held == 1 and gate.held_by("b") == 0
        nursery.start_soon(hold, gate, "c", entered, release)  # its place is free again
        await settle()
        release.set()
    assert entered == ["a", "c"] and gate.held == 0


async def test_the_refusal_maps_to_a_retryable_server_busy():
    exc = tokenizer_busy(GateFull("16 tokenizer calls are already running or waiting"))
    assert isinstance(exc, GenerationError)
    assert exc.code == "server_busy" and exc.retryable


async def test_an_abandoned_tokenize_is_cancelled_at_the_worker_and_a_ping_is_not(autojump_clock):
    async with serving(FakeWorkerClient(), health_timeout=5) as s:
        with pytest.raises(GenerationError):
            await s.runtime.call(Tokenize(text="ab"), timeout=1)
        with pytest.raises(GenerationError):
            await s.runtime.call(Ping(), timeout=1)
        assert s.fake.cancels == [1]  # the tokenize's id; never the ping's
        with trio.move_on_after(1):  # the caller leaves (a client disconnect)
            await s.runtime.call(Tokenize(text="cd"))
        assert s.fake.cancels == [1, 3]
        # The worker's `cancelled` answers end the ids' bookkeeping; nothing fails.
        s.fake.emit({"type": "error", "id": 1, "code": "cancelled", "message": "x"},
                    {"type": "error", "id": 3, "code": "cancelled", "message": "x"})
        await settle()
        assert s.failure is None


def test_the_reset_budget_allows_a_burst_then_a_rate():
    budget = ResetBudget(burst=10, rate=5.0)
    assert budget.spend(10, now=0.0)
    assert not budget.spend(1, now=0.0)      # the burst is spent
    assert not budget.spend(3, now=0.5)      # 2.5 refilled: not 3
    assert budget.spend(2, now=0.5)
    assert budget.spend(10, now=100.0)       # refills up to the burst, never beyond
    assert not budget.spend(1, now=100.0)
