"""concurrency: concurrent requests are all served (§14.1; 4 ≤ the default queue depth of 16)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance._support import expected_output, check_completion, check_stream, chat_body, http_client, json_of, post_chat, stream_chat

pytestmark = pytest.mark.concurrency

N = 4


@pytest.mark.spec("§14.1")
def test_concurrent_streams_all_done(cfg, record_property):
    """4 concurrent streams all complete with a valid sequence and [DONE]."""
    def one(i):
        with http_client(cfg, timeout=120) as c:
            st = stream_chat(c, chat_body(cfg, f"Say hello number {i}.", max_tokens=16, stream_options={"include_usage": True}), max_seconds=180)
        check_stream(st, cfg, include_usage=True, identity=False, usage_nulls=False)
        if cfg.scripted:
            want = {expected_output(s, max_tokens=16) for s in cfg.script}
            assert (st.content, st.finish_reasons[0]) in want, f"not a (cut) script string: {st.content!r}"
        return st

    t0 = time.monotonic()
    with ThreadPoolExecutor(N) as ex:
        results = list(ex.map(one, range(N)))
    record_property("note", f"{N} streams in {time.monotonic() - t0:.2f}s")
    assert all(st.done for st in results)


@pytest.mark.spec("§14.1")
def test_concurrent_nonstream_all_ok(cfg, record_property):
    """4 concurrent non-streamed requests all get 200 completions."""
    def one(i):
        with http_client(cfg, timeout=120) as c:
            r = post_chat(c, chat_body(cfg, f"Say hello number {i}.", max_tokens=16))
            data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        return check_completion(data, cfg)

    t0 = time.monotonic()
    with ThreadPoolExecutor(N) as ex:
        list(ex.map(one, range(N)))
    record_property("note", f"{N} requests in {time.monotonic() - t0:.2f}s")
