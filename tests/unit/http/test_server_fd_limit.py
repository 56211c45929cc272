"""RLIMIT_NOFILE against the connection cap at startup: raise the soft limit when
the hard one allows, else serve fewer connections and say so."""

from __future__ import annotations

import logging
import resource

import pytest

from trioserve.http import server
from trioserve.http.server import FDS_RESERVED, fit_fd_limit, plan_fd_limit

INF = resource.RLIM_INFINITY


@pytest.mark.parametrize("soft,hard,cap,expected", [
    (1024, 4096, 256, (1024, 256)),  # enough already: unchanged
    (INF, INF, 256, (INF, 256)),
    (100, 4096, 256, (256 + FDS_RESERVED, 256)),  # raised as far as needed
    (100, INF, 256, (256 + FDS_RESERVED, 256)),
    (100, 200, 256, (200, 200 - FDS_RESERVED)),  # hard limit too low: fewer connections
    (100, 100, 256, (100, 100 - FDS_RESERVED)),
    (50, 50, 256, (50, 1)),  # never below one connection
])
def test_plan(soft, hard, cap, expected):
    assert plan_fd_limit(soft, hard, cap) == expected


class FakeLimits:
    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.limits = (soft, hard)
        self.refuse = refuse

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        if self.refuse:
            raise ValueError("not allowed")
        self.limits = limits


def install(monkeypatch, fake: FakeLimits) -> None:
    monkeypatch.setattr(server.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(server.resource, "setrlimit", fake.setrlimit)


def test_raises_the_soft_limit(monkeypatch, caplog):
    fake = FakeLimits(100, 4096)
    install(monkeypatch, fake)
    with caplog.at_level(logging.INFO, "trioserve.http.server"):
        assert fit_fd_limit(256) == 256
    assert fake.limits == (256 + FDS_RESERVED, 4096)
    assert "raised the open-file limit" in caplog.text


def test_lowers_the_cap_and_says_so(monkeypatch, caplog):
    fake = FakeLimits(100, 100)
    install(monkeypatch, fake)
    with caplog.at_level(logging.WARNING, "trioserve.http.server"):
        assert fit_fd_limit(256) == 100 - FDS_RESERVED
    assert f"serving at most {100 - FDS_RESERVED} at once" in caplog.text


def test_a_refused_raise_lowers_the_cap(monkeypatch, caplog):
    install(monkeypatch, FakeLimits(100, 4096, refuse=True))
    with caplog.at_level(logging.WARNING, "trioserve.http.server"):
        assert fit_fd_limit(256) == 100 - FDS_RESERVED
    assert "could not raise" in caplog.text
