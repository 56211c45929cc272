"""Hostile-request benchmark: what a costly request costs its sender and everyone else.

On the real model (llama worker), with a bystander stream running meanwhile:

* ``empty_messages``: a request of N empty user messages (a prompt made almost only of
  template-level special tokens) — the time until its answer (a ``400
  context_length_exceeded`` when it cannot fit) and the bystander's longest gap between two
  tokens while it is handled.
* ``shapes``: the same N empty turns written as other request shapes: list content parts,
  a ``name`` on every message, Responses ``input`` items, Anthropic Messages content blocks.
  Also the shapes that used to skip the early refusal (``chat_template_kwargs``, runs of
  system messages or developer items, Messages' ``thinking: disabled`` and system blocks,
  Responses' ``reasoning: {}``), and N objects outside the items (one message of N parts,
  N/2 tools): each is refused by the turn bound, the bound on items or the bound on objects
  before any per-message work.
* ``stored call ids``: 540 ``store: true`` responses each carrying a 4 MiB ``call_id``: time
  per request and the server's RSS growth (the store counts every string it keeps).
* ``control``: a small ordinary request, for the bystander's gaps when nothing hostile runs
  (the noise floor of "longest gap": the machine's, not a request's).
* ``enum``: a ``json_schema`` answer ``{"type": "string", "enum": [N values]}`` — the time
  until its answer (served, or a 400 naming the limit) and the bystander's longest gap.

* ``count_tokens 110000 x6``: six concurrent ``/v1/messages/count_tokens`` of 110,000 empty
  messages (3.4 MB each) — the time until the last is answered, and the bystander's longest
  gap meanwhile (the worker tokenizes on its call thread: cpp/call_worker.h).
* ``tokenize 4 MiB spaces``: one ``/tokenize`` of 4.1 MB of spaces, the same two columns.
* ``rapid reset``: h2c connections each opening 400 streams with a chat body and resetting
  them at once, for ``--reset-seconds`` (trioserve/h2_guard.py closes each such connection);
  ``answer`` is from the end of the attack until a normal chat request is answered (the
  recovery), the bystander's gaps are during the attack; ``code`` counts the connections the
  server closed of those opened.

* ``overflow during prefill``: a prompt longer than the context sent while another request's
  ~2,000-token prompt is being prefilled (the 400 must not wait for that prefill) —
  the time until its 400, and the prefilling request's TTFT (the 400 came first when it is
  the larger).

The bystander's median gap (its decode step with company) is printed for comparison. Prints a
table; the last line is one JSON object. Never asserts on time.

The server runs as a child process (``python -m trioserve.cli serve``) and each hostile request
is encoded before its clock starts and sent on a raw socket, so neither the client's JSON
encoding, its HTTP library nor its share of an event loop is counted as the server's
(``--in-process`` keeps the older in-process server).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.lib.client import sse_events
from bench.lib.machine import machine
from bench.lib.servers import ServerProcess, running_server
from bench.lib.stats import percentile


MODEL = "SmolLM2-135M-Instruct"


def empty_messages(n: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ""}] * n}


def control_request() -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Say hi."}]}


# The other shapes of N empty turns: (route, body).
SHAPES: dict[str, Any] = {
    "list_content": lambda n: ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}] * n}),
    "named": lambda n: ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "name": "a", "content": ""}] * n}),
    "responses_input": lambda n: ("/v1/responses", {
        "model": MODEL, "max_output_tokens": 4, "input": [{"role": "user", "content": ""}] * n}),
    "messages_blocks": lambda n: ("/v1/messages", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}] * n}),
    # Shapes that used to skip the early refusal: template fields (now: given only when they
    # can change the render), turns the floor does not count (now: the bound on items).
    "template_kwargs_empty": lambda n: ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ""}] * n,
        "chat_template_kwargs": {}}),
    "template_kwargs": lambda n: ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": ""}] * n,
        "chat_template_kwargs": {"enable_thinking": False}}),
    "system_messages": lambda n: ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4,
        "messages": [{"role": "system", "content": ""}] * n + [{"role": "user", "content": "hi"}]}),
    "messages_thinking_disabled": lambda n: ("/v1/messages", {
        "model": MODEL, "max_tokens": 4, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": ""}] * n}),
    "messages_system_blocks": lambda n: ("/v1/messages", {
        "model": MODEL, "max_tokens": 4, "system": [{"type": "text", "text": ""}] * n,
        "messages": [{"role": "user", "content": "hi"}]}),
    "responses_reasoning_empty": lambda n: ("/v1/responses", {
        "model": MODEL, "max_output_tokens": 4, "reasoning": {},
        "input": [{"role": "user", "content": ""}] * n}),
    "responses_developer_items": lambda n: ("/v1/responses", {
        "model": MODEL, "max_output_tokens": 4, "input": [{"role": "developer", "content": ""}] * n}),
    # N objects elsewhere than in conversation items (the bound on objects).
    "parts_in_one_message": lambda n: ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * n}]}),
    "tools": lambda n: ("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n // 2)]}),
}


def enum_request(n: int) -> dict[str, Any]:
    schema = {"type": "string", "enum": [f"value number {i}" for i in range(n)]}
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Pick one."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}}


def post_bytes(route: str, body: bytes) -> bytes:
    """A prepared HTTP/1.1 POST (``Connection: close``) of a JSON body."""
    return (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() +
            b"Content-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def error_code(status: int, answer: bytes) -> str | None:
    if status == 200:
        return None
    error = json.loads(answer).get("error", {})
    return error.get("code") or error.get("type")  # OpenAI's envelope has a code; Anthropic's a type


async def measure(client: httpx.AsyncClient, request: dict[str, Any],
                  route: str = "/v1/chat/completions") -> dict[str, Any]:
    """Run ``request`` while a bystander streams; the answer's time and the bystander's gaps."""
    request_bytes = post_bytes(route, json.dumps(request).encode())

    async def send() -> tuple[int, str | None]:
        status, answer = await raw_post(str(client.base_url), request_bytes)
        return status, error_code(status, answer)

    return await measure_action(client, send)


async def concurrent_posts(client: httpx.AsyncClient, route: str, body: bytes,
                           count: int) -> tuple[int, str | None]:
    """``count`` identical POSTs at once; the worst status and its code."""
    request_bytes = post_bytes(route, body)
    answers: list[tuple[int, bytes]] = []

    async def one() -> None:
        answers.append(await raw_post(str(client.base_url), request_bytes))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    status, answer = max(answers, key=lambda a: a[0])
    return status, error_code(status, answer)


async def rapid_reset_attack(client: httpx.AsyncClient, seconds: float,
                             streams: int = 400) -> tuple[int, str | None, float]:
    """h2c connections opening ``streams`` streams with a chat body and resetting each at
    once, one after another for ``seconds``; then one normal chat request. Returns (its
    status, "closed/opened" connections, ms from the attack's end to its answer)."""
    import h2.config
    import h2.connection
    import h2.errors

    host, port = str(client.base_url).split("//", 1)[1].rstrip("/").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "max_tokens": 4, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}"),
               (":path", "/v1/chat/completions"), ("content-type", "application/json"),
               ("content-length", str(len(body)))]
    opened = closed = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        stream = await trio.open_tcp_stream(host, int(port))
        opened += 1
        async with stream:
            try:
                for i in range(streams):
                    sid = conn.get_next_available_stream_id()
                    conn.send_headers(sid, headers)
                    conn.send_data(sid, body, end_stream=True)
                    conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                    if i % 50 == 49:
                        await stream.send_all(conn.data_to_send())
                with trio.move_on_after(5):
                    while await stream.receive_some(65536):
                        pass
                    closed += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                closed += 1
            except Exception:  # h2 refusing to go on: the server ended it
                closed += 1
    t0 = time.perf_counter()
    status, answer = await raw_post(str(client.base_url), post_bytes(
        "/v1/chat/completions", json.dumps(control_request()).encode()))
    return status, f"{closed}/{opened} closed", (time.perf_counter() - t0) * 1000


async def measure_action(client: httpx.AsyncClient, action: Any) -> dict[str, Any]:
    """Run ``action()`` (→ status, code[, answer ms]) while a bystander streams; the answer's
    time (the action's own third value when it gives one) and the bystander's gaps."""
    gaps: list[float] = []
    started = trio.Event()
    result: dict[str, Any] = {}

    async def bystander() -> None:
        last = None
        req = {"model": MODEL, "max_tokens": 400, "stream": True, "temperature": 0,
               "messages": [{"role": "user", "content": "Tell a long story about the sea."}]}
        async for _ in sse_events(client, req):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if len(gaps) == 3:
                started.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bystander)
        await started.wait()
        t0 = time.perf_counter()
        outcome = await action()
        result["answer_ms"] = outcome[2] if len(outcome) > 2 else (time.perf_counter() - t0) * 1000
        result["status"], result["code"] = outcome[0], outcome[1]
        during = len(gaps)
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    result["bystander_max_gap_ms"] = max(gaps[2:during + 1], default=float("nan")) * 1000
    result["bystander_median_gap_ms"] = percentile(gaps, 50) * 1000
    return result


async def overflow_during_prefill(client: httpx.AsyncClient) -> dict[str, Any]:
    """A too-long prompt sent while a ~2,000-token prompt is prefilling: (its answer time,
    status, code; the prefilling request's TTFT in the bystander columns' place)."""
    long_prompt = " ".join(f"word{i % 97}" for i in range(1000))  # ~2,000 tokens
    too_long = "overflow " * 12_000  # > 8,192 tokens
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": too_long}]}).encode()
    request_bytes = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    result: dict[str, Any] = {}

    async def prefilling() -> None:
        t0 = time.perf_counter()
        req = {"model": MODEL, "max_tokens": 1, "stream": True, "temperature": 0,
               "messages": [{"role": "user", "content": long_prompt}]}
        async for _ in sse_events(client, req):
            result.setdefault("prefill_ttft_ms", (time.perf_counter() - t0) * 1000)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prefilling)
        await trio.sleep(0.5)  # the long prompt is in the worker's step by now
        t0 = time.perf_counter()
        status, answer = await raw_post(str(client.base_url), request_bytes)
        result["answer_ms"] = (time.perf_counter() - t0) * 1000
        result["status"] = status
        result["code"] = json.loads(answer).get("error", {}).get("code") if status != 200 else None
    result["bystander_max_gap_ms"] = result.get("prefill_ttft_ms", float("nan"))
    result["bystander_median_gap_ms"] = float("nan")
    return result


def rss_mib(pid: int) -> float:
    """A process's resident set size in MiB (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def stored_call_ids(client: httpx.AsyncClient, pid: int | None, count: int,
                          call_id_mib: int) -> dict[str, Any]:
    """``count`` stored responses (``store: true``), each carrying a ``call_id`` of
    ``call_id_mib`` MiB: the server's RSS before and after (loosely: the allocator keeps
    freed memory) and the time per request. The store's own bound is asserted in the tests."""
    call_id = "c" * (call_id_mib << 20)
    body = json.dumps({"model": MODEL, "max_output_tokens": 1, "store": True, "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}).encode()
    request_bytes = (b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    before = rss_mib(pid) if pid else float("nan")
    statuses: dict[int, int] = {}
    t0 = time.perf_counter()
    for _ in range(count):
        status, _ = await raw_post(str(client.base_url), request_bytes)
        statuses[status] = statuses.get(status, 0) + 1
    elapsed = time.perf_counter() - t0
    after = rss_mib(pid) if pid else float("nan")
    return {"status": max(statuses, key=statuses.get), "code": f"{count} x {call_id_mib} MiB",
            "answer_ms": elapsed * 1000 / count, "bystander_max_gap_ms": after - before,
            "bystander_median_gap_ms": after, "statuses": statuses,
            "rss_before_mib": before, "rss_after_mib": after}


async def raw_post(base_url: str, request_bytes: bytes) -> tuple[int, bytes]:
    """Send a prepared HTTP/1.1 request (``Connection: close``) on a raw socket and read the
    whole answer: ``(status, body)``. A raw socket, so that the client library's own cost of
    uploading megabytes is not counted as the server's."""
    host, port = base_url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request_bytes)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def run(args: argparse.Namespace) -> dict[str, Any]:
    worker_dir = os.environ.get("TRIOSERVE_WORKER_DIR")
    engine = "fake" if args.fake else "llama"
    worker_bin = os.path.join(worker_dir, f"trioserve-{engine}-worker") if worker_dir else ""
    settings: dict[str, Any] = dict(engine=engine, threads=args.threads, max_body_bytes=8 << 20)
    if args.fake:  # the fake worker "generates" a token every few ms: a steady bystander
        settings.update(max_context=8192, worker_args="--token-delay-ms 5")
    if worker_bin:
        settings["worker_bin"] = worker_bin
    if args.in_process:
        async with running_server(**settings) as srv:
            return await measure_all(srv.url, args, os.getpid())
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.trioserve(Path(tmp), **settings)
        try:
            await server.wait_ready()
            return await measure_all(f"http://127.0.0.1:{server.port}", args, server.pid)
        finally:
            server.stop()


async def measure_all(url: str, args: argparse.Namespace, pid: int | None = None) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        rows["control"] = await measure(client, control_request())
        if args.store_responses:
            rows["stored call ids"] = await stored_call_ids(client, pid, args.store_responses,
                                                            args.call_id_mib)
        for n in args.messages:
            rows[f"empty_messages {n}"] = await measure(client, empty_messages(n))
        for name in args.shapes:
            route, request = SHAPES[name](args.shape_messages)
            rows[f"{name} {args.shape_messages}"] = await measure(client, request, route)
        for n in args.enum:
            rows[f"enum {n}"] = await measure(client, enum_request(n))
        if args.count_tokens:
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}] * 110_000}).encode()
            rows["count_tokens 110000 x6"] = await measure_action(
                client, lambda: concurrent_posts(client, "/v1/messages/count_tokens", body, 6))
            spaces = json.dumps({"content": " " * (4_100_000)}).encode()
            rows["tokenize 4 MiB spaces"] = await measure_action(
                client, lambda: concurrent_posts(client, "/tokenize", spaces, 1))
        if args.reset_seconds > 0:
            rows["rapid reset"] = await measure_action(
                client, lambda: rapid_reset_attack(client, args.reset_seconds))
        if args.overflow:
            rows["overflow during prefill"] = await overflow_during_prefill(client)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--messages", type=int, nargs="*", default=[5000, 20000, 110000])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--shape-messages", type=int, default=20000)
    parser.add_argument("--enum", type=int, nargs="*", default=[64, 256, 1024, 20000])
    parser.add_argument("--no-overflow", dest="overflow", action="store_false",
                        help="skip the overflow-during-prefill row")
    parser.add_argument("--store-responses", type=int, default=540,
                        help="stored responses carrying a huge call_id (0: skip the row)")
    parser.add_argument("--call-id-mib", type=int, default=4)
    parser.add_argument("--no-count-tokens", dest="count_tokens", action="store_false",
                        help="skip the count_tokens and /tokenize rows")
    parser.add_argument("--reset-seconds", type=float, default=5.0,
                        help="how long the rapid-reset row attacks (0: skip it)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the server in this process (shares the client's event loop)")
    parser.add_argument("--fake", action="store_true",
                        help="the fake worker instead of the real model (the control plane's "
                             "share only: refusals, the store)")
    args = parser.parse_args()
    if args.fake:
        global MODEL
        MODEL = "fake"
    rows = trio.run(run, args)
    print(f"{'case':<28} {'status':>6} {'code':<28} {'answer ms':>10} {'bystander max gap ms':>21} {'median':>7}")
    for name, r in rows.items():
        print(f"{name:<28} {r['status']:>6} {str(r['code']):<28} {r['answer_ms']:>10.0f} "
              f"{r['bystander_max_gap_ms']:>21.0f} {r['bystander_median_gap_ms']:>7.0f}")
    print("(overflow during prefill: the 'bystander max gap' column is the prefilling request's TTFT;"
          " stored call ids: 'answer ms' per request, then the server's RSS growth and RSS in MiB)")
    print(json.dumps({"machine": machine(), "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
