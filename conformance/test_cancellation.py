"""cancellation: a client that goes away frees the server for the next request (§14.2).

Timing is reported, not tightly asserted: the bound is generous (BOUND seconds) so that the check
holds on slow CI machines; the measured time is printed in the summary's note column.
"""

from __future__ import annotations

import time

import httpx
import pytest

from conformance._support import check_completion, chat_body, http_client, json_of, post_chat

pytestmark = pytest.mark.cancellation

BOUND = 30.0
LONG = "Write a very long story about a dragon who learns to paint. Make it at least 2000 words."


def _next_request_time(cfg) -> float:
    t0 = time.monotonic()
    with http_client(cfg, timeout=BOUND) as c:
        r = post_chat(c, chat_body(cfg, "Say hello.", max_tokens=4, temperature=0))
        data = json_of(r)
    dt = time.monotonic() - t0
    assert r.status_code == 200, f"HTTP {r.status_code} after a disconnect: {data!r}"
    check_completion(data, cfg)
    return dt


@pytest.mark.spec("§14.2")
def test_stream_disconnect_frees_server(cfg, record_property):
    """Open a long stream, read one content chunk, close the socket: the next request completes within 30 s."""
    body = chat_body(cfg, LONG, max_tokens=1500, temperature=0.7, stream=True)
    with http_client(cfg) as c:
        with c.stream("POST", "/chat/completions", json=body) as r:
            assert r.status_code == 200, f"HTTP {r.status_code}: {r.read()[:300]!r}"
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line and '"role"' not in line:
                    break
    # leaving both blocks closed the response and the connection mid-stream
    dt = _next_request_time(cfg)
    record_property("note", f"next request done {dt:.2f}s after disconnect")
    assert dt < BOUND, f"next request took {dt:.1f}s after a stream disconnect"


@pytest.mark.spec("§14.2")
def test_nonstream_disconnect_frees_server(cfg, record_property):
    """A non-streamed long request abandoned after 1 s (client timeout): the next request completes within 30 s."""
    with http_client(cfg, timeout=1.0) as c:
        try:
            r = post_chat(c, chat_body(cfg, LONG, max_tokens=1500, temperature=0.7))
            finished = f"finished in <1 s (HTTP {r.status_code})"
        except httpx.TimeoutException:
            finished = "abandoned after 1 s"
    dt = _next_request_time(cfg)
    record_property("note", f"{finished}; next request done {dt:.2f}s later")
    assert dt < BOUND, f"next request took {dt:.1f}s after an abandoned request"
