"""Observability over real sockets (spec §17): request ids, the access log, per-generation
stats lines, /metrics in Prometheus text format, and a /health that reveals nothing
private."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from trioserve.worker.supervisor import public_reason

from ..conftest import chat_body, live_server, parse_sse
from ..rawhttp import build_request, exchange

pytestmark = pytest.mark.usefixtures("no_leaks")

REQ_ID = re.compile(r"req-[0-9a-f]{24}")
CHAT_ID = re.compile(r"chatcmpl-[0-9a-f]{24}")


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trioserve.access"]


def stats_lines(caplog) -> list[dict[str, str]]:
    return [dict(field.split("=", 1) for field in r.getMessage().split())
            for r in caplog.records if r.name == "trioserve.core.stats"]


# -- request ids ---------------------------------------------------------------------

async def test_request_id_is_the_completion_id_on_chat_and_generated_elsewhere(tmp_path):
    async with live_server(tmp_path, script=["abc"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert CHAT_ID.fullmatch(resp.headers["x-request-id"])
        assert resp.headers["x-request-id"] == resp.json()["id"]

        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        ids = {e["id"] for e in parse_sse(resp.content) if isinstance(e, dict)}
        assert ids == {resp.headers["x-request-id"]}

        # An error of the chat route carries the id its completion would have had.
        resp = await client.post("/v1/chat/completions", json={"model": "fake"})
        assert resp.status_code == 400 and CHAT_ID.fullmatch(resp.headers["x-request-id"])

        seen = set()
        for path in ("/health", "/v1/models", "/metrics", "/nope"):
            rid = (await client.get(path)).headers["x-request-id"]
            assert REQ_ID.fullmatch(rid) and rid not in seen
            seen.add(rid)


async def test_client_request_id_is_logged_never_echoed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with live_server(tmp_path, script=["abc"]) as srv, srv.client() as client:
        resp = await client.get("/health", headers={"x-request-id": "trace-42.a:b"})
        assert REQ_ID.fullmatch(resp.headers["x-request-id"])
        await client.get("/health", headers={"x-request-id": "spaces are not sane"})
        await client.get("/health", headers={"x-request-id": "x" * 129})
    lines = access_lines(caplog)
    assert len(lines) == 3
    assert lines[0].endswith(" client_id=trace-42.a:b")
    assert "client_id" not in lines[1] and "client_id" not in lines[2]


# -- access log ----------------------------------------------------------------------

async def test_one_access_line_per_request(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with live_server(tmp_path, script=["hello"]) as srv, srv.client() as client:
        chat = await client.post("/v1/chat/completions", json=chat_body())
        missing = await client.get("/nope")
        raw = await exchange(srv.port, build_request("GET", "/v1/mod%0a%22els", headers=[
            ("Host", "127.0.0.1"), ("Connection", "close")]))
        assert raw.status == 404
    lines = access_lines(caplog)
    assert len(lines) == 3
    pattern = re.compile(r'127\.0\.0\.1:\d+ "(\S+) (\S+)" (\d{3}) [\d.]+ms (\d+)B id=(\S+)')
    method, path, status, size, rid = pattern.fullmatch(lines[0]).groups()
    assert (method, path, status, int(size), rid) == (
        "POST", "/v1/chat/completions", "200", len(chat.content), chat.headers["x-request-id"])
    method, path, status, size, rid = pattern.fullmatch(lines[1]).groups()
    assert (method, path, status, int(size), rid) == (
        "GET", "/nope", "404", len(missing.content), missing.headers["x-request-id"])
    # A path with a newline and a quote stays on one line, escaped.
    assert "\n" not in lines[2] and '/v1/mod\\n\\"els' in lines[2]


# -- per-generation stats ------------------------------------------------------------------

async def test_one_stats_line_per_generation(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.core.stats")
    async with live_server(tmp_path, script=["hello world", "streamed"]) as srv, srv.client() as client:
        first = await client.post("/v1/chat/completions", json=chat_body())
        second = await client.post("/v1/chat/completions", json=chat_body(stream=True,
                                   stream_options={"include_usage": True}))
        records = [r for r in srv.pool.history if r["type"] == "done"]
    usage = [first.json()["usage"], parse_sse(second.content)[-2]["usage"]]
    ids = [first.headers["x-request-id"], second.headers["x-request-id"]]
    lines = stats_lines(caplog)
    assert len(lines) == 2
    for line, use, rid, record in zip(lines, usage, ids, records):
        assert line["id"] == rid
        assert int(line["prompt"]) == use["prompt_tokens"]
        assert int(line["completion"]) == use["completion_tokens"]
        assert int(line["cached"]) == record["reused_prompt_tokens"]
        assert float(line["ttft_ms"]) >= 0
        assert float(line["decode_tps"]) > 0
        assert (line["finish"], line["cancelled"]) == ("stop", "false")


async def test_a_client_that_leaves_gives_a_cancelled_stats_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.core.stats")
    async with live_server(tmp_path, script=["z" * 3000, "next"], worker_args="--token-delay-ms 2") as srv:
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        body = build_request("POST", "/v1/chat/completions", headers=[
            ("Host", "127.0.0.1"), ("Content-Type", "application/json")],
            body=b'{"model":"fake","stream":true,"messages":[{"role":"user","content":"hi"}]}')
        await stream.send_all(body)
        data = b""
        with trio.fail_after(10):
            while b'"content":"z' not in data:
                data += await stream.receive_some(65536)
        await stream.aclose()
        with trio.fail_after(10):
            while not stats_lines(caplog):
                await trio.sleep(0.01)
        async with srv.client() as client:  # still serving
            assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
    first = stats_lines(caplog)[0]
    assert (first["finish"], first["cancelled"]) == ("cancelled", "true")
    assert CHAT_ID.fullmatch(first["id"])


async def test_no_per_token_logging_at_info(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    async with live_server(tmp_path, script=["t" * 500]) as srv, srv.client() as client:
        caplog.clear()
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert len(parse_sse(resp.content)) > 3
    names = sorted(r.name for r in caplog.records if r.name.startswith("trioserve")
                   and r.name not in ("trioserve.worker.supervisor", "trioserve.http.server",
                                      "trioserve.models"))  # workers' and models' lifecycles
    assert names == ["trioserve.access", "trioserve.core.stats"]


# -- /metrics -------------------------------------------------------------------------

async def scrape(client) -> dict[tuple[str, tuple], float]:
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_requests_generations_and_tokens(tmp_path):
    async with live_server(tmp_path, script=["one two", "three"]) as srv, srv.client() as client:
        usages = []
        for body in (chat_body(), chat_body(stream=True, stream_options={"include_usage": True}), chat_body()):
            resp = await client.post("/v1/chat/completions", json=body)
            usages.append(resp.json()["usage"] if not body.get("stream") else parse_sse(resp.content)[-2]["usage"])
        assert (await client.post("/v1/chat/completions", json={"model": "fake"})).status_code == 400
        await client.get("/health")
        await client.get("/some/random/path")
        m = await scrape(client)
    route = "/v1/chat/completions"
    assert value(m, "trioserve_http_requests_total", route=route, status="200") == 3
    assert value(m, "trioserve_http_requests_total", route=route, status="400") == 1
    assert value(m, "trioserve_http_requests_total", route="/health", status="200") == 1
    assert value(m, "trioserve_http_requests_total", route="other", status="404") == 1
    assert value(m, "trioserve_http_requests_in_flight") == 1  # the scrape itself
    assert value(m, "trioserve_queue_depth") == 0 and value(m, "trioserve_running_generations") == 0
    assert value(m, "trioserve_worker_ready") == 1 and value(m, "trioserve_worker_restarts_total") == 0
    assert value(m, "trioserve_time_to_first_token_seconds_count") == 3
    assert value(m, "trioserve_decode_tokens_per_second_count") == 3
    assert value(m, "trioserve_generations_total", finish_reason="stop") == 3
    assert value(m, "trioserve_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert value(m, "trioserve_completion_tokens_total") == sum(u["completion_tokens"] for u in usages)


@pytest.mark.parametrize("slots", [1, 2])
async def test_metrics_read_queue_and_running_at_scrape_time(tmp_path, slots):
    async with live_server(tmp_path, script=["s" * 5000], worker_args="--token-delay-ms 5",
                           slots=slots) as srv, srv.client() as client:
        async def long_request() -> None:
            async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as resp:
                async for _ in resp.aiter_bytes():
                    pass

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(long_request)
            with trio.fail_after(10):
                while srv.pool.queued < 3 - slots:
                    await trio.sleep(0.01)
            m = await scrape(client)
            assert value(m, "trioserve_queue_depth") == 3 - slots
            assert value(m, "trioserve_running_generations") == slots
            assert value(m, "trioserve_http_requests_in_flight") == 4
            nursery.cancel_scope.cancel()


async def test_metrics_count_worker_restarts_and_servers_do_not_share_counts(tmp_path):
    async with live_server(tmp_path, script=["0123456789"], worker_args="--exit-after-tokens 4") as crashy, \
            live_server(tmp_path, script=["x"]) as calm, \
            crashy.client() as c1, calm.client() as c2:
        resp = await c1.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code in (200, 503)
        await crashy.wait_state("ready", timeout=10)
        with trio.fail_after(10):
            while crashy.pool.restarts < 1:
                await trio.sleep(0.01)
        m1, m2 = await scrape(c1), await scrape(c2)
    assert value(m1, "trioserve_worker_restarts_total") == 1
    assert value(m2, "trioserve_worker_restarts_total") == 0
    assert value(m2, "trioserve_http_requests_total", route="/v1/chat/completions", status="200") == 0


# -- /health --------------------------------------------------------------------------

async def test_health_reveals_status_reason_and_counters_only(tmp_path):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        body = (await client.get("/health")).json()
        assert body == {"status": "ready", "model": "fake", "queued": 0, "running": 0, "restarts": 0}
        assert str(srv.pool.worker_pid) not in (await client.get("/health")).text
    async with live_server(tmp_path, wait_ready=False, worker_bin="/bin/false",
                           max_crashes=2, crash_window=60) as srv, srv.client() as client:
        with trio.fail_after(15):
            await srv.pool.fatal.wait()
        resp = await client.get("/health")
        assert resp.status_code == 503
        assert resp.json() == {"status": "unavailable", "reason": "unavailable", "model": "fake",
                               "queued": 0, "running": 0, "restarts": 1}
        assert "exit status" in srv.pool.reason  # the detail stays on the server side


async def test_health_while_loading(tmp_path):
    async with live_server(tmp_path, script=["x"], wait_ready=False,
                           worker_args="--slow-start-ms 1000") as srv, srv.client() as client:
        resp = await client.get("/health")
        assert resp.status_code == 503
        assert (resp.json()["status"], resp.json()["reason"]) == ("loading", "loading")


def test_public_reason_prefers_the_supervisors_own_and_never_uses_details():
    def sup(**kw):
        return SimpleNamespace(**{"state": "loading", "reason": "", "restarts": 0, **kw})

    assert public_reason(sup()) == "loading"
    assert public_reason(sup(reason="restarting in 0.5 s after: worker 1234 died")) == "restarting"
    assert public_reason(sup(restarts=2, reason="worker is starting")) == "restarting"
    assert public_reason(sup(state="unavailable", reason="crash loop: /secret/path")) == "unavailable"
    assert public_reason(sup(state="unavailable", public_reason="restarting")) == "restarting"
    # Anything else the supervisor might put there is not passed through.
    assert public_reason(sup(state="unavailable", public_reason="pid 1234 died")) == "unavailable"
