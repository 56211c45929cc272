"""The report of fields inside conversation items that the server ignores (api/ignored_fields.py,
spec §4.1): which keys are noted, how a path is written in a header, and the bounds on what is
kept and sent whatever the client sends."""

from __future__ import annotations

import logging

import pytest

from trioserve.api.ignored_fields import (
    HEADER_BUDGET,
    IGNORED_FIELDS_HEADER,
    MAX_KEPT,
    IgnoredFields,
    response_headers,
)


def noted(obj: dict, known: frozenset[str] = frozenset({"role", "content"}),
          where: str = "input[0]") -> IgnoredFields:
    ignored = IgnoredFields()
    ignored.note(obj, known, where)
    return ignored


def test_only_unknown_keys_are_noted_in_body_order():
    ignored = noted({"zeta": 1, "role": "user", "alpha": None, "content": "hi"})
    assert ignored.paths == ["input[0].zeta", "input[0].alpha"] and ignored.total == 2
    assert not noted({"role": "user", "content": "hi"})


@pytest.mark.parametrize("key, path", [
    ("internal_chat_message_metadata_passthrough",
     "input[0].internal_chat_message_metadata_passthrough"),
    ("x-y_Z9", "input[0].x-y_Z9"),
    ("with space", 'input[0]["with space"]'),
    ("a,b", 'input[0]["a\\u002cb"]'),  # the header is a comma-separated list
    ("a.b", 'input[0]["a.b"]'),  # a dot would read as a nested key
    ("line\r\nx-injected: 1", 'input[0]["line\\r\\nx-injected: 1"]'),
    ("café", 'input[0]["caf\\u00e9"]'),
    ("\ud800", 'input[0]["\\ud800"]'),  # a lone surrogate (JSON's "\ud800" escape)
    ("", 'input[0][""]'),
    ("k" * 65, 'input[0]["' + "k" * 64 + '"]'),  # long keys are cut to 64 characters
])
def test_a_path_is_printable_ascii_and_names_the_key(key, path):
    ignored = noted({key: 1})
    assert ignored.paths == [path]
    value = ignored.header_value()
    assert value == path
    assert value.isascii() and value.isprintable()


def test_the_header_stays_within_its_budget_and_counts_what_it_left_out():
    ignored = IgnoredFields()
    for i in range(1000):
        ignored.note({"role": "user", "some_harness_field": 1}, {"role"}, f"messages[{i}]")
    assert ignored.total == 1000 and len(ignored.paths) == MAX_KEPT
    value = ignored.header_value()
    assert len(value) <= HEADER_BUDGET
    shown = value.split(", ")
    assert shown[0] == "messages[0].some_harness_field"
    assert shown[-1] == f"(+{1000 - (len(shown) - 1)} more)"
    assert all(entry == f"messages[{i}].some_harness_field" for i, entry in enumerate(shown[:-1]))


def test_long_keys_fill_the_budget_sooner_but_never_overflow_it():
    ignored = IgnoredFields()
    for i in range(40):
        ignored.note({"\u2603" * 64: 1}, (), f"input[{i}].content[0]")  # 6 ASCII characters each
    value = ignored.header_value()
    assert len(value) <= HEADER_BUDGET and value.endswith(" more)") and value.isascii()


def test_response_headers_and_the_debug_line(caplog):
    log = logging.getLogger("trioserve.test_ignored_fields")
    assert response_headers(IgnoredFields(), log, "req-1") == {}
    with caplog.at_level(logging.DEBUG, logger=log.name):
        headers = response_headers(noted({"foo": 1, "bar": 2}), log, "req-2")
    assert headers == {IGNORED_FIELDS_HEADER: "input[0].foo, input[0].bar"}
    [record] = caplog.records
    assert record.levelno == logging.DEBUG
    assert "req-2" in record.getMessage() and "input[0].foo, input[0].bar" in record.getMessage()
