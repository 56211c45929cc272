"""Fixtures for the conformance suite: the target server comes from OPENAI_BASE_URL / OPENAI_MODEL.

If the server does not answer ``GET {base}/models`` within 5 s, every test is skipped with a message
saying so (the run still exits cleanly).
"""

from __future__ import annotations

import pytest
import httpx

from conformance import AREAS
from conformance._support import Config, http_client

_CFG: Config | None = None
_UNREACHABLE: str | None = None


def _probe(cfg: Config) -> str | None:
    try:
        r = httpx.get(f"{cfg.base_url}/models", timeout=5.0, headers={"Authorization": f"Bearer {cfg.api_key}"})
    except httpx.HTTPError as e:
        return f"server unreachable at {cfg.base_url} ({type(e).__name__}: {e}); set OPENAI_BASE_URL"
    if cfg.model is None:
        try:
            cfg.model = r.json()["data"][0]["id"]
        except Exception:
            return f"GET {cfg.base_url}/models gave HTTP {r.status_code} and no model id; set OPENAI_MODEL"
    return None


def pytest_configure(config: pytest.Config) -> None:
    global _CFG, _UNREACHABLE
    _CFG = Config.from_env()
    _UNREACHABLE = _probe(_CFG)


def pytest_report_header(config: pytest.Config) -> list[str]:
    assert _CFG is not None
    mode = "scripted (exact checks)" if _CFG.scripted else "real model (shape checks)"
    lines = [f"conformance target: {_CFG.base_url} model={_CFG.model!r} mode={mode}"]
    if _UNREACHABLE:
        lines.append(f"conformance: SKIPPING ALL — {_UNREACHABLE}")
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(a) for a in AREAS):
            raise pytest.UsageError(f"{item.nodeid} has no area marker")
    if _UNREACHABLE:
        skip = pytest.mark.skip(reason=_UNREACHABLE)
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cfg() -> Config:
    assert _CFG is not None
    return _CFG


@pytest.fixture(scope="session")
def client(cfg: Config):
    with http_client(cfg) as c:
        yield c


@pytest.fixture(scope="session")
def root(cfg: Config):
    """A client for the server root (``/health``, unknown routes)."""
    with httpx.Client(base_url=cfg.root_url, timeout=httpx.Timeout(cfg.timeout, connect=5.0)) as c:
        yield c


@pytest.fixture(scope="session")
def sdk(cfg: Config):
    from openai import OpenAI

    c = OpenAI(base_url=cfg.base_url, api_key=cfg.api_key, timeout=cfg.timeout, max_retries=0)
    yield c
    c.close()


@pytest.fixture
def scripted(cfg: Config) -> Config:
    """Skip unless the server is trioserve's fake engine running conformance/script.json."""
    if not cfg.scripted:
        pytest.skip("exact check needs a scripted server (CONFORMANCE_SCRIPTED=1)")
    return cfg


@pytest.fixture
def real(cfg: Config) -> Config:
    """Skip when the server is scripted (the check needs a model that samples)."""
    if cfg.scripted:
        pytest.skip("needs a sampling model; the scripted engine ignores sampling")
    return cfg
