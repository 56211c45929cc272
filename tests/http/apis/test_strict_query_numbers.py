"""Numbers in query strings are ASCII digits or a structured 400, over real sockets (spec §20.5).

``str.isdigit()`` is true for ``²`` (which ``int()`` refuses: it was a 500 with a traceback),
for ``٣`` and ``５`` (which ``int()`` read as 3 and 5) and ``int()`` takes ``" 5"``, ``"1_0"``
and digit strings past Python's conversion limit. ``GET /v1/responses/{id}/input_items?limit=``
now takes ASCII digits only (strict_json.ascii_digits); so do JSON Pointer indexes in a
schema's ``$ref``, the Host port check and the spin-count setting.
After each refusal the same server answers the same query with a plain ``limit``.
"""

from __future__ import annotations

import pytest

from trioserve.config import _spin_count
from trioserve.http.guard import host_name
from trioserve.strict_json import ascii_digits

from ..conftest import live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

REFUSED = ["%C2%B2", "%D9%A3", "%EF%BC%95", "+5", "%205", "5%20", "1_0", "-1", "0", "101",
           "1" * 5000, "", "5.0", "0x5", "%FF"]


@pytest.mark.parametrize("text,value", [
    ("0", 0), ("5", 5), ("100", 100), ("007", 7),
    ("²", None), ("٣", None), ("５", None), (" 5", None), ("5 ", None), ("1_0", None),
    ("+5", None), ("-5", None), ("", None), ("1234", None), ("1" * 5000, None),
])
def test_ascii_digits_takes_ascii_digits_only(text, value):
    assert ascii_digits(text, max_digits=3) == value


async def test_input_items_limit_is_ascii_digits_or_a_400(tmp_path):
    async with live_server(tmp_path, script=["Stored."]) as srv, srv.client() as client:
        created = await client.post("/v1/responses", json={"model": "fake", "input": [
            {"role": "user", "content": f"item {i}"} for i in range(6)]})
        assert created.status_code == 200, created.text
        path = f"/v1/responses/{created.json()['id']}/input_items"
        for text in REFUSED:
            resp = await client.get(f"{path}?limit={text}")
            assert resp.status_code == 400, (text, resp.status_code, resp.text)
            error = resp.json()["error"]
            assert error["param"] == "limit" and error["code"] == "invalid_value", (text, error)
            assert len(error["message"]) < 300  # a 5,000-digit value is not echoed whole
        # The same server answers the ASCII spelling: 3 items, then 5.
        three = await client.get(f"{path}?limit=3")
        assert three.status_code == 200 and len(three.json()["data"]) == 3
        assert three.json()["has_more"] is True
        five = await client.get(f"{path}?limit=5&order=asc")
        assert five.status_code == 200 and len(five.json()["data"]) == 5


@pytest.mark.parametrize("digit", ["²", "٠", "０"])
async def test_a_json_pointer_index_in_other_digits_does_not_resolve(tmp_path, digit):
    # A $ref into a list by index: "²" was a 500 (int() refused what isdigit() passed), "٠"
    # and "０" resolved as index 0. JSON Pointer indexes are ASCII digits (RFC 6901).
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": [{"type": "string"}]},
        "b": {"$ref": f"#/properties/a/items/{digit}"}}}
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    async with live_server(tmp_path, script=["fine"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "invalid_value" and "does not resolve" in error["message"], error
        assert (await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "hi"}]})).status_code == 200


@pytest.mark.parametrize("header", ["localhost:²", "localhost:５", "localhost:٣", "localhost:123456"])
def test_a_host_port_in_other_digits_is_malformed(header):
    # The same check reads TRIOSERVE_ALLOWED_HOSTS, where any Unicode can be typed.
    assert host_name(header) is None
    assert host_name("localhost:8000") == "localhost"


@pytest.mark.parametrize("value", ["²", "５", "1_0"])
def test_a_spin_count_in_other_digits_is_refused(value):
    with pytest.raises(ValueError):
        _spin_count(value)
    assert _spin_count("100") == "100"
