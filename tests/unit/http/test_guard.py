"""The guard decisions and the stats record as pure logic (the HTTP behaviour is in
tests/http/connections/test_guard.py and test_observability.py)."""

import pytest

from trioserve.config import Settings
from trioserve.http.guard import (
    RequestGuard,
    check_startup,
    host_name,
    is_json_media_type,
    is_loopback_address,
    json_bytes,
    parse_allowed_hosts,
)
from trioserve.core.stats import GenerationTimer
from trioserve.worker.protocol import Done


@pytest.mark.parametrize("header,name", [
    ("localhost", "localhost"), ("LocalHost:8000", "localhost"), ("[::1]", "[::1]"),
    ("[::1]:80", "[::1]"), ("127.0.0.1:1", "127.0.0.1"), ("api.example.com", "api.example.com"),
    ("a b", None), ("localhost:port", None), ("[::1", None), ("[nothex]:1", None), ("", None),
    ("localhost:", None), ("localhost:1234567", None), ("h:1:2", None), ("x@y", None),
    ("é.example", None), ("a" * 64 + ".example", None), ("a." * 127 + "bc", None),
])
def test_host_name(header, name):
    assert host_name(header) == name


def test_allowed_hosts_parsing():
    assert parse_allowed_hosts("") == frozenset()
    assert parse_allowed_hosts(" A.example:80 , [::1] ,") == {"a.example", "[::1]"}
    assert parse_allowed_hosts("x, *") is None
    with pytest.raises(ValueError, match="TRIOSERVE_ALLOWED_HOSTS"):
        parse_allowed_hosts("good, not good")


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True),
                                           ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                           ("::", False), ("10.0.0.1", False), ("example.com", False)])
def test_loopback_addresses(host, loopback):
    assert is_loopback_address(host) is loopback


def test_startup_checks():
    check_startup(Settings(host="127.0.0.1"))
    check_startup(Settings(host="0.0.0.0", api_key="k"))
    check_startup(Settings(host="0.0.0.0", allow_no_auth=True))
    with pytest.raises(ValueError, match="without an API key"):
        check_startup(Settings(host="0.0.0.0"))
    with pytest.raises(ValueError, match="MAX_CONNECTIONS"):
        check_startup(Settings(max_connections=0))
    with pytest.raises(ValueError, match="ALLOWED_HOSTS"):
        check_startup(Settings(allowed_hosts="bad host"))


def test_default_host_allow_list_follows_the_bind_address():
    assert RequestGuard.from_settings(Settings(host="127.0.0.1")).allowed_hosts == {"localhost", "127.0.0.1", "[::1]"}
    assert RequestGuard.from_settings(Settings(host="0.0.0.0", api_key="k")).allowed_hosts is None
    assert RequestGuard.from_settings(Settings(host="127.0.0.1", allowed_hosts="*")).allowed_hosts is None
    guard = RequestGuard.from_settings(Settings(host="0.0.0.0", api_key="k"))
    assert guard.check_host(["anything.example:1"]) is None
    assert guard.check_host(["bad host"]).code == "invalid_host"
    assert guard.check_host([]).code == "invalid_host"
    assert guard.check_host(["a", "a"]).code == "invalid_host"


def check(guard, **kw):
    args = dict(method="POST", path="/v1/chat/completions", authorization=None,
                content_type="application/json", local_address="127.0.0.1", route_matched=True)
    error = guard.check(**{**args, **kw})
    return error.code if error else None


def test_key_and_content_type_checks():
    keyed = RequestGuard.from_settings(Settings(api_key="k3y"))
    assert check(keyed) == "invalid_api_key"
    assert check(keyed, authorization="Bearer k3y") is None
    assert check(keyed, authorization="BEARER  k3y ") is None
    assert check(keyed, authorization="Bearer k3") == "invalid_api_key"
    assert check(keyed, authorization="Token k3y") == "invalid_api_key"
    assert check(keyed, path="/health", method="GET") is None
    # The key comes first: an unauthenticated client learns nothing about the body rules.
    assert check(keyed, content_type="text/plain") == "invalid_api_key"
    assert check(keyed, authorization="Bearer k3y", content_type="text/plain") == "unsupported_media_type"
    assert check(keyed, authorization="Bearer k3y", content_type=None, route_matched=False) is None

    open_ = RequestGuard.from_settings(Settings())
    assert check(open_, content_type="application/json; charset=utf-8") is None
    assert check(open_, method="GET", content_type=None) is None
    # No key configured: connections that arrived off loopback are refused (bare hypercorn
    # bound to a public address), unless the operator allowed it.
    assert check(open_, local_address="192.168.1.5") == "api_key_required"
    assert check(open_, local_address="::1") is None
    assert check(open_, local_address=None) is None  # a Unix socket
    assert check(open_, local_address="192.168.1.5", path="/health", method="GET") is None
    unguarded = RequestGuard.from_settings(Settings(allow_no_auth=True))
    assert check(unguarded, local_address="192.168.1.5") is None


@pytest.mark.parametrize("value,ok", [("application/json", True), ("Application/JSON ; charset=latin-1", True),
                                      ("application/json-patch+json", False), ("text/json", False),
                                      ("", False), (None, False), ("application/jsonx", False)])
def test_json_media_type(value, ok):
    assert is_json_media_type(value) is ok


def test_json_bytes_survives_lone_surrogates():
    assert json_bytes({"m": "ok é"}) == '{"m":"ok é"}'.encode()
    assert json_bytes({"m": "bad \ud800"}) == b'{"m":"bad \\ud800"}'


def test_generation_stats_from_a_done_record():
    timer = GenerationTimer(admitted=10.0, first_output=10.25)
    record = {"prompt_tokens": 12, "reused_prompt_tokens": 8, "completion_tokens": 5,
              "finish_reason": "length", "cancelled": False}
    done = Done(id=1, finish_reason="length", cancelled=False, stop_string=None, prompt_tokens=12,
                completion_tokens=5, queue_ms=None, ttft_ms=None, raw=record, reused_prompt_tokens=8)
    stats = timer.finish("chatcmpl-1", done, cancel_requested=False)
    assert (stats.prompt_tokens, stats.cached_tokens, stats.completion_tokens) == (12, 8, 5)
    assert stats.ttft_ms == pytest.approx(250.0) and stats.decode_tps > 0
    assert stats.finish_reason == "length" and not stats.cancelled
    line = stats.log_line()
    assert line.startswith("id=chatcmpl-1 prompt=12 cached=8 completion=5 ttft_ms=250.0 decode_tps=")
    assert line.endswith(" finish=length cancelled=false")


def test_generation_stats_without_a_done_record():
    left = GenerationTimer().finish("c", None, cancel_requested=True)
    assert (left.finish_reason, left.cancelled, left.completion_tokens, left.ttft_ms) == ("cancelled", True, None, None)
    assert "completion=- ttft_ms=-" in left.log_line()
    failed = GenerationTimer().finish("c", None, cancel_requested=False)
    assert (failed.finish_reason, failed.cancelled) == ("error", False)
