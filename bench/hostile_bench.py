"""Hostile-request benchmark (issue 18): what a costly request costs its sender and everyone else.

On the real model (llama worker), with a bystander stream running meanwhile:

* ``empty_messages``: a request of N empty user messages (a prompt made almost only of
  template-level special tokens) — the time until its answer (a ``400
  context_length_exceeded`` when it cannot fit) and the bystander's longest gap between two
  tokens while it is handled.
* ``shapes``: the same N empty turns written as other request shapes: list content parts,
  a ``name`` on every message, Responses ``input`` items, Anthropic Messages content blocks.
* ``control``: a small ordinary request, for the bystander's gaps when nothing hostile runs
  (the noise floor of "longest gap": the machine's, not a request's).
* ``enum``: a ``json_schema`` answer ``{"type": "string", "enum": [N values]}`` — the time
  until its answer (served, or a 400 naming the limit) and the bystander's longest gap.

* ``overflow during prefill``: a prompt longer than the context sent while another request's
  ~2,000-token prompt is being prefilled (issue 21: the 400 must not wait for that prefill) —
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
}


def enum_request(n: int) -> dict[str, Any]:
    schema = {"type": "string", "enum": [f"value number {i}" for i in range(n)]}
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Pick one."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}}


async def measure(client: httpx.AsyncClient, request: dict[str, Any],
                  route: str = "/v1/chat/completions") -> dict[str, Any]:
    """Run ``request`` while a bystander streams; the answer's time and the bystander's gaps."""
    body = json.dumps(request).encode()
    request_bytes = (f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() +
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
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
        status, answer = await raw_post(str(client.base_url), request_bytes)
        result["answer_ms"] = (time.perf_counter() - t0) * 1000
        result["status"] = status
        error = json.loads(answer).get("error", {}) if status != 200 else {}
        # OpenAI's envelope has a code; Anthropic's a type.
        result["code"] = (error.get("code") or error.get("type")) if status != 200 else None
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
    worker_bin = os.path.join(worker_dir, "trioserve-llama-worker") if worker_dir else ""
    settings: dict[str, Any] = dict(engine="llama", threads=args.threads, max_body_bytes=8 << 20)
    if worker_bin:
        settings["worker_bin"] = worker_bin
    if args.in_process:
        async with running_server(**settings) as srv:
            return await measure_all(srv.url, args)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.trioserve(Path(tmp), **settings)
        try:
            await server.wait_ready()
            return await measure_all(f"http://127.0.0.1:{server.port}", args)
        finally:
            server.stop()


async def measure_all(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        rows["control"] = await measure(client, control_request())
        for n in args.messages:
            rows[f"empty_messages {n}"] = await measure(client, empty_messages(n))
        for name in args.shapes:
            route, request = SHAPES[name](args.shape_messages)
            rows[f"{name} {args.shape_messages}"] = await measure(client, request, route)
        for n in args.enum:
            rows[f"enum {n}"] = await measure(client, enum_request(n))
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
    parser.add_argument("--in-process", action="store_true",
                        help="run the server in this process (shares the client's event loop)")
    args = parser.parse_args()
    rows = trio.run(run, args)
    print(f"{'case':<28} {'status':>6} {'code':<28} {'answer ms':>10} {'bystander max gap ms':>21} {'median':>7}")
    for name, r in rows.items():
        print(f"{name:<28} {r['status']:>6} {str(r['code']):<28} {r['answer_ms']:>10.0f} "
              f"{r['bystander_max_gap_ms']:>21.0f} {r['bystander_median_gap_ms']:>7.0f}")
    print("(overflow during prefill: the 'bystander max gap' column is the prefilling request's TTFT)")
    print(json.dumps({"machine": machine(), "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
