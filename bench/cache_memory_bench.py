"""Cache memory benchmark: the server's RSS after many refused requests with huge schemas.

Issue 47 (round 5, item 4): 320 requests, each a different JSON schema with a 3.6 MB
``description``, all answered 400 (the fake worker cannot enforce grammars), raised the
server's RSS from 121 to 997 MB: the compiled-grammar cache kept them. This sends the same
requests to a server child process (``python -m trioserve.cli serve`` on the fake worker)
and prints its RSS (``/proc/<pid>/status`` ``VmRSS``) before and after, the statuses, and
``trioserve_grammar_cache_bytes``. The last line is one JSON object. Never asserts.

    .venv/bin/python -m bench.cache_memory_bench [--requests 320] [--description-mb 3.6]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.lib.servers import ServerProcess
from trioserve.machine import installed_worker


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def body(i: int, description: str) -> bytes:
    schema = {"type": "object", "description": description,
              "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}
    return json.dumps({"model": "fake", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}],
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": f"s{i}", "schema": schema}}}).encode()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    description = "d" * int(args.description_mb * 1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.trioserve(Path(tmp), engine="fake", worker_bin=installed_worker("fake"),
                                         max_body_bytes=8 << 20)
        try:
            await server.wait_ready(60)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as client:
                await client.post("/v1/chat/completions", json={
                    "model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
                before = rss_mb(server.pid)
                statuses: collections.Counter[int] = collections.Counter()
                for i in range(args.requests):
                    resp = await client.post("/v1/chat/completions", content=body(i, description),
                                             headers={"content-type": "application/json"})
                    statuses[resp.status_code] += 1
                after = rss_mb(server.pid)
                scrape = (await client.get("/metrics")).text
                cache = next((float(row.split()[1]) for row in scrape.splitlines()
                              if row.startswith("trioserve_grammar_cache_bytes ")), float("nan"))
        finally:
            server.stop()
    return {"requests": args.requests, "description_mb": args.description_mb,
            "statuses": dict(statuses), "rss_before_mb": round(before, 1),
            "rss_after_mb": round(after, 1), "rss_growth_mb": round(after - before, 1),
            "grammar_cache_bytes": cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--description-mb", type=float, default=3.6)
    result = trio.run(run, parser.parse_args())
    print(f"{result['requests']} requests, {result['description_mb']} MB descriptions: "
          f"statuses {result['statuses']}; RSS {result['rss_before_mb']} -> "
          f"{result['rss_after_mb']} MB (+{result['rss_growth_mb']}); grammar cache "
          f"{result['grammar_cache_bytes']:.0f} bytes")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
