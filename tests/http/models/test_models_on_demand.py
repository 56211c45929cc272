"""Several models on one server, loaded on demand within a memory budget (spec §14.5), on the
fake engine: a fake model's cost is its KV cache, 4 bytes a token of context per slot (worker
protocol §3), so a budget in bytes decides how many fit.

The lifecycle's rules one by one (LRU order, bounds, races) are tests/unit/worker/
test_lifecycle.py's; here the whole server: routes, admin endpoints, /v1/models, /metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from ..conftest import chat_body, live_server, parse_sse

CTX, SLOTS = 1024, 2
COST = 4 * CTX * SLOTS  # one fake model's KV cache in bytes
ONE_MODEL = COST + COST // 2  # a budget that fits one model, not two


def models_config(tmp_path: Path, models: dict[str, dict[str, Any]]) -> str:
    """A --models-config TOML: each fake model says its own name (its script)."""
    lines: list[str] = []
    for model_id, extra in models.items():
        script = tmp_path / f"{model_id}.json"
        script.write_text(json.dumps([f"{model_id} speaking"]))
        settings = {"fake_script": str(script), **extra.pop("settings", {})}
        lines += ["[[models]]", f'id = "{model_id}"', 'engine = "fake"',
                  f"context = {extra.pop('context', CTX)}", f"slots = {extra.pop('slots', SLOTS)}"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in extra.items()]
        lines += ["[models.settings]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path = tmp_path / "models.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def serve(tmp_path: Path, models: dict[str, dict[str, Any]], **overrides: Any):
    return live_server(tmp_path, wait_ready=False,
                       models_config=models_config(tmp_path, models), **overrides)


async def ask(client: httpx.AsyncClient, model: str, *, stream: bool = False) -> httpx.Response:
    return await client.post("/v1/chat/completions", json=chat_body(model=model, stream=stream))


def text_of(response: httpx.Response) -> str:
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in parse_sse(response.content) if isinstance(e, dict)]
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    return response.json()["choices"][0]["message"]["content"]


async def states(client: httpx.AsyncClient) -> dict[str, str]:
    data = (await client.get("/v1/models")).json()["data"]
    return {entry["id"]: entry["state"] for entry in data}


async def wait_state(client: httpx.AsyncClient, model: str, state: str, timeout: float = 15) -> None:
    with trio.fail_after(timeout):
        while (await states(client))[model] != state:
            await trio.sleep(0.05)


def metric(text: str, name: str, **labels: str) -> float:
    for row in text.splitlines():
        if row.startswith(name + "{") and all(f'{k}="{v}"' in row for k, v in labels.items()):
            return float(row.rsplit(" ", 1)[1])
        if not labels and row.startswith(name + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


async def test_a_model_loads_on_its_first_request_and_models_shows_the_states(tmp_path):
    async with serve(tmp_path, {"alpha": {}, "beta": {}}) as srv, srv.client() as client:
        assert await states(client) == {"alpha": "not_loaded", "beta": "not_loaded"}
        response = await ask(client, "alpha")
        assert response.status_code == 200 and text_of(response) == "alpha speaking"
        assert await states(client) == {"alpha": "loaded", "beta": "not_loaded"}
        entry = (await client.get("/v1/models/alpha")).json()
        assert entry["context_length"] == CTX
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, "trioserve_model_loads_total", model="alpha", reason="demand",
                      outcome="loaded") == 1
        assert metric(scrape, "trioserve_model_memory_bytes", model="alpha") == COST
        assert metric(scrape, "trioserve_model_load_seconds_count", model="alpha") == 1


async def test_two_clients_alternating_under_a_one_model_budget_are_all_answered(tmp_path):
    models = {"alpha": {}, "beta": {}}
    async with serve(tmp_path, models, memory_budget_bytes=ONE_MODEL) as srv, \
            srv.client(timeout=60) as client:
        answers: list[tuple[str, int, str]] = []

        async def alternate(first: str, second: str, stream: bool) -> None:
            for i in range(4):
                model = first if i % 2 == 0 else second
                response = await ask(client, model, stream=stream)
                answers.append((model, response.status_code, text_of(response)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(alternate, "alpha", "beta", False)
            nursery.start_soon(alternate, "beta", "alpha", True)
        assert len(answers) == 8
        assert all(status == 200 and text == f"{model} speaking" for model, status, text in answers), answers
        scrape = (await client.get("/metrics")).text
        unloads = sum(metric(scrape, "trioserve_model_unloads_total", model=m, reason="lru") for m in models)
        assert unloads >= 1
        assert metric(scrape, "trioserve_model_memory_budget_bytes") == ONE_MODEL
        assert sum(metric(scrape, "trioserve_model_memory_bytes", model=m) for m in models) <= ONE_MODEL


async def test_a_pinned_model_is_loaded_at_start_and_never_unloaded(tmp_path):
    models = {"pin": {"pinned": True}, "alpha": {}, "beta": {}}
    async with serve(tmp_path, models, memory_budget_bytes=COST + ONE_MODEL) as srv, \
            srv.client(timeout=60) as client:
        await wait_state(client, "pin", "loaded")
        pool = srv.quart_app.services.host.services("pin").pool
        pid = pool.worker_pid
        for model in ["alpha", "beta", "alpha", "pin", "beta"]:
            response = await ask(client, model)
            assert response.status_code == 200 and text_of(response) == f"{model} speaking"
        assert (await states(client))["pin"] == "loaded" and pool.worker_pid == pid
        refused = await client.post("/v1/models/pin/unload", json={})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_pinned"


async def test_a_model_too_large_for_the_budget_is_refused_clearly(tmp_path):
    models = {"small": {}, "big": {"context": 8 * CTX, "slots": 4}}
    async with serve(tmp_path, models, memory_budget_bytes=ONE_MODEL) as srv, srv.client() as client:
        response = await ask(client, "big")
        assert response.status_code == 507
        error = response.json()["error"]
        assert (error["code"], error["param"], error["type"]) == ("model_too_large", "model", "server_error")
        assert str(ONE_MODEL) in error["message"] and str(4 * 8 * CTX * 4) in error["message"]
        assert (await states(client))["big"] == "not_loaded"
        assert (await ask(client, "small")).status_code == 200  # the others are unaffected


async def test_a_request_waiting_for_a_load_can_be_cancelled(tmp_path):
    models = {"slow": {"settings": {"worker_args": "--slow-start-ms 1500"}}}
    models["other"] = {}
    async with serve(tmp_path, models) as srv, srv.client() as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=chat_body(model="slow"), timeout=0.5)
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, "trioserve_model_requests_waiting", model="slow") == 0
        # The load its client left goes on (spec §14.5) and serves the next request.
        await wait_state(client, "slow", "loaded")
        response = await ask(client, "slow")
        assert response.status_code == 200 and text_of(response) == "slow speaking"
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, "trioserve_model_loads_total", model="slow", outcome="loaded") == 1


async def test_idle_models_unload_after_the_idle_time(tmp_path):
    async with serve(tmp_path, {"alpha": {}, "beta": {}}, model_idle_unload_s=0.5) as srv, \
            srv.client() as client:
        assert (await ask(client, "alpha")).status_code == 200
        await wait_state(client, "alpha", "not_loaded")
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, "trioserve_model_unloads_total", model="alpha", reason="idle") == 1
        assert (await ask(client, "alpha")).status_code == 200  # and loads again


async def test_admin_load_and_unload(tmp_path):
    async with serve(tmp_path, {"alpha": {}, "beta": {}}, api_key="sekrit") as srv, \
            srv.client(headers={"Authorization": "Bearer sekrit"}) as client:
        async with srv.client() as anonymous:
            assert (await anonymous.post("/v1/models/alpha/load", json={})).status_code == 401
        loaded = await client.post("/v1/models/alpha/load", json={})
        assert loaded.status_code == 200
        assert loaded.json() == {"id": "alpha", "object": "model", "state": "loaded"}
        unknown = await client.post("/v1/models/nope/load", json={})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        unloaded = await client.post("/v1/models/alpha/unload", json={})
        assert unloaded.status_code == 200 and unloaded.json()["state"] == "not_loaded"
        assert (await states(client))["alpha"] == "not_loaded"
        assert (await client.post("/v1/models/beta/unload", json={})).json()["state"] == "not_loaded"


async def test_unload_of_a_model_with_a_stream_in_flight_is_409(tmp_path):
    models = {"alpha": {"settings": {"worker_args": "--token-delay-ms 100"}}, "beta": {}}
    async with serve(tmp_path, models) as srv, srv.client() as client:
        body = chat_body(model="alpha", stream=True)
        async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.status_code == 200
            busy = await client.post("/v1/models/alpha/unload", json={})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
            # The stream outlived its lease, holding the model itself: it is counted.
            assert "has 1 request(s) in flight and 0 waiting" in busy.json()["error"]["message"]
            await stream.aread()
        assert (await client.post("/v1/models/alpha/unload", json={})).status_code == 200


async def test_a_failed_load_is_a_clear_500_backed_off_and_touches_no_other_model(tmp_path):
    models = {"broken": {"settings": {"worker_args": "--no-such-flag", "restart": False}},
              "alpha": {}}
    async with serve(tmp_path, models) as srv, srv.client() as client:
        assert (await ask(client, "alpha")).status_code == 200
        response = await ask(client, "broken")
        # Not to be retried blindly: no Retry-After, and the SDKs' x-should-retry says no.
        assert response.status_code == 500 and "Retry-After" not in response.headers
        assert response.headers["x-should-retry"] == "false"
        error = response.json()["error"]
        assert error["code"] == "model_load_failed" and "broken" in error["message"]
        assert (await states(client)) == {"broken": "failed", "alpha": "loaded"}
        again = await ask(client, "broken")  # backed off: the same answer, no new load
        assert again.status_code == 500 and again.json()["error"] == error
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, "trioserve_model_loads_total", model="broken", reason="demand",
                      outcome="failed") == 1
        assert (await ask(client, "alpha")).status_code == 200


async def test_a_model_that_cannot_load_never_evicts_a_working_one(tmp_path):
    # Under a one-model budget, every request for a model whose workers cannot start used to
    # unload the idle working model first. Its first failure may cost one unload (nothing said
    # it would fail); from then on it loads only into free memory.
    models = {"alpha": {}, "broken": {"settings": {"worker_args": "--no-such-flag", "restart": False}}}
    async with serve(tmp_path, models, memory_budget_bytes=ONE_MODEL) as srv, \
            srv.client(timeout=60) as client:
        assert (await ask(client, "alpha")).status_code == 200
        first = await ask(client, "broken")
        assert first.status_code == 500 and first.json()["error"]["code"] == "model_load_failed"
        assert (await ask(client, "alpha")).status_code == 200  # loaded again
        for _ in range(3):  # backed off (worker/lifecycle.py): no load, so no eviction either
            again = await ask(client, "broken")
            assert again.status_code == 500 and again.json()["error"]["code"] == "model_load_failed"
            assert await states(client) == {"alpha": "loaded", "broken": "failed"}
        # An admin load tries despite the backoff, but only into free memory.
        refused = await client.post("/v1/models/broken/load", json={})
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        error = refused.json()["error"]
        assert error["code"] == "model_load_failed", error
        assert "only into free memory" in error["message"] and "'alpha'" in error["message"]
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, "trioserve_model_unloads_total", model="alpha", reason="lru") == 1
        assert metric(scrape, "trioserve_model_loads_total", model="broken", reason="admin",
                      outcome="no_room") == 1
        assert metric(scrape, "trioserve_model_loads_total", model="broken", reason="demand",
                      outcome="failed") == 1
        # Free memory (alpha unloaded by the admin): broken is tried again, alpha untouched after.
        assert (await client.post("/v1/models/alpha/unload", json={})).status_code == 200
        retried = await client.post("/v1/models/broken/load", json={})
        assert retried.json()["error"]["code"] == "model_load_failed"
        assert "only into free memory" not in retried.json()["error"]["message"]
        response = await ask(client, "alpha")
        assert response.status_code == 200 and text_of(response) == "alpha speaking"


async def test_health_stays_ready_while_a_model_loads_on_demand_but_not_for_a_pinned_one(tmp_path):
    slow = {"settings": {"worker_args": "--slow-start-ms 1500"}}
    async with serve(tmp_path, {"slow": dict(slow), "alpha": {}}) as srv, srv.client() as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, client, "slow")
            await wait_state(client, "slow", "loading")
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ready"
            entries = {m["model"]: m for m in health.json()["models"]}
            assert entries["slow"]["state"] == "loading" and entries["alpha"] == {
                "model": "alpha", "state": "not_loaded"}
    async with serve(tmp_path, {"slow": {**slow, "pinned": True}, "alpha": {}}) as srv, \
            srv.client() as client:
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        await wait_state(client, "slow", "loaded")
        assert (await client.get("/health")).status_code == 200


async def test_a_pinned_model_whose_workers_gave_up_stays_down_until_an_admin_load(tmp_path):
    broken = {"worker_args": "--no-such-flag", "restart": False}
    models = {"pin": {"pinned": True, "settings": broken}, "alpha": {}}
    async with serve(tmp_path, models) as srv, srv.client() as client:
        host = srv.quart_app.services.host
        with trio.fail_after(15):
            while not host.fatal:  # every pinned model gave up: `trioserve serve` would exit
                await trio.sleep(0.05)
        down = await ask(client, "pin")  # answered by its pool, as a one-model server's
        assert down.status_code == 503 and down.json()["error"]["code"] == "worker_unavailable"
        assert (await ask(client, "alpha")).status_code == 200
        reload = await client.post("/v1/models/pin/load", json={})  # a new load, which fails too
        assert reload.status_code == 500 and reload.json()["error"]["code"] == "model_load_failed"
