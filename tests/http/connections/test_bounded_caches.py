"""Every cache is bounded in bytes and filled only by accepted work (spec §17.4), over real sockets.

The finding: 320 requests, each a different JSON schema with a 3.6 MB ``description``, all
refused (the fake worker cannot enforce grammars), raised the server's RSS from 121 to 997 MB:
the compiled-grammar LRU kept 256 entries keyed by the whole schema, filled before the check
that refused them. Now the cache is keyed by a digest, bounded in bytes
(``limits.GRAMMAR_CACHE_BYTES``) and filled once the worker took the grammar; its bytes are
``trioserve_grammar_cache_bytes``. The RSS itself is measured by bench/cache_memory_bench.py,
never asserted here.

Each test ends with the same server answering a fresh request.
"""

from __future__ import annotations

import re

import pytest

from trioserve import limits
from trioserve.core import constraints as structured
from trioserve.core.replay import ReplayStore, ReplayTurn
from trioserve.model.schema_subset import Normalizer, SchemaUnsupported

from ..conftest import chat_body, live_server

pytestmark = pytest.mark.usefixtures("no_leaks")


def schema_body(i: int, description: str = "") -> dict:
    schema = {"type": "object", "description": description,
              "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}
    return chat_body(max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})


def gauge(scrape: str, name: str) -> float:
    rows = [row for row in scrape.splitlines() if row.startswith(name + " ")]
    assert len(rows) == 1, (name, rows)
    return float(rows[0].split()[1])


async def test_refused_requests_leave_no_grammar(tmp_path):
    # The fake worker does not enforce grammars: every constrained request is a 400 after its
    # schema compiled. Large descriptions, each schema different: nothing is kept.
    description = "d" * (1 << 20)
    async with live_server(tmp_path, script=["{}"], max_body_bytes=8 << 20) as srv, \
            srv.client(timeout=60) as client:
        grammars = srv.quart_app.services.default.core.grammars
        for i in range(24):
            resp = await client.post("/v1/chat/completions", json=schema_body(i, description))
            assert resp.status_code == 400, resp.text[:300]
            assert resp.json()["error"]["code"] == "unsupported_parameter"
        assert len(grammars) == 0 and grammars.nbytes == 0
        scrape = (await client.get("/metrics")).text
        assert gauge(scrape, "trioserve_grammar_cache_bytes") == 0
        assert gauge(scrape, "trioserve_replay_cache_bytes") == 0
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text


async def test_accepted_grammars_are_kept_within_the_byte_bound(tmp_path):
    # A worker that takes grammars: accepted requests fill the cache, never past its bound
    # (made small here so that a few dozen schemas reach it).
    async with live_server(tmp_path, script=['{"a": 1}'] * 64, worker_args="--grammar-unenforced",
                           max_body_bytes=8 << 20) as srv, srv.client(timeout=60) as client:
        grammars = srv.quart_app.services.default.core.grammars
        assert grammars.max_bytes == limits.GRAMMAR_CACHE_BYTES
        resp = await client.post("/v1/chat/completions", json=schema_body(0, "d" * (1 << 20)))
        assert resp.status_code == 200, resp.text[:300]
        # One entry: its grammar and description, not the 1 MiB schema it came from.
        assert len(grammars) == 1 and 0 < grammars.nbytes < 16 * 1024
        one = grammars.nbytes
        grammars.max_bytes = 8 * one
        for i in range(1, 40):
            resp = await client.post("/v1/chat/completions", json=schema_body(i))
            assert resp.status_code == 200, resp.text[:300]
            assert grammars.nbytes <= grammars.max_bytes
        assert 4 <= len(grammars) <= 8
        scrape = (await client.get("/metrics")).text
        assert gauge(scrape, "trioserve_grammar_cache_bytes") == grammars.nbytes
        # The most recent schema again: served from the cache, nothing added.
        count, size = len(grammars), grammars.nbytes
        resp = await client.post("/v1/chat/completions", json=schema_body(39))
        assert resp.status_code == 200 and (len(grammars), grammars.nbytes) == (count, size)
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text


def test_the_grammar_cache_drops_least_recently_used_entries_past_its_bound():
    cache = structured.GrammarCache(max_bytes=4000)
    made = [structured.Constraint(grammar="g" * 500, param="p", what=f"w{i}", key=bytes([i]) * 32)
            for i in range(10)]
    for constraint in made[:3]:
        cache.put(constraint)
    assert len(cache) == 3 and cache.nbytes <= 4000
    cache.get(made[0].key)  # used: it outlives made[1]
    for constraint in made[3:]:
        cache.put(constraint)
        assert cache.nbytes <= cache.max_bytes
    assert cache.get(made[1].key) is None
    assert cache.get(made[9].key) == ("g" * 500, "w9")
    huge = structured.Constraint(grammar="g" * 5000, param="p", what="w", key=b"h" * 32)
    cache.put(huge)  # larger than the bound alone: not kept, nothing dropped for it
    assert cache.get(huge.key) is None and cache.get(made[9].key) is not None
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_the_replay_store_is_bounded_in_bytes():
    store = ReplayStore(max_bytes=200_000)
    turn = ReplayTurn(signature=("x" * 10_000, ()), ids=tuple(range(1000, 2000)))
    for i in range(40):
        store.record(f"session-{i}", [{"role": "user", "content": "hi"}], turn)
        assert store.nbytes <= store.max_bytes
    assert 0 < store.nbytes <= 200_000
    kept = [i for i in range(40) if store.plan(f"session-{i}", [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 10_000}])]
    assert kept and kept == list(range(40 - len(kept), 40))  # the most recent ones
    for i in range(40):
        store.forget(f"session-{i}")
    assert store.nbytes == 0
    # A turn larger than the bound alone is not kept.
    big = ReplayTurn(signature=("y" * 300_000, ()), ids=(1,))
    store.record("big", [{"role": "user", "content": "hi"}], big)
    assert store.nbytes == 0


def test_a_pattern_too_long_for_the_regex_cache_is_refused_before_it_is_compiled():
    # re keeps its last 512 compiled patterns whoever sent them: a pattern is bounded before
    # re.compile sees it (a 140 KB one held 1.1 MB there).
    re.purge()
    long = {"type": "string", "pattern": "(ab|cd)" * 20_000}
    with pytest.raises(SchemaUnsupported) as info:
        Normalizer().add(long)
    assert info.value.path == "pattern" and str(limits.MAX_PATTERN_CHARS) in info.value.reason
    assert not any(key[1] == long["pattern"] for key in re._cache)  # never compiled
    assert Normalizer().add({"type": "string", "pattern": "(ab|cd)" * 500}) is not None
