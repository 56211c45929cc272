"""Fixtures for the worker process tests: the built workers, spawned and reaped per test, and
script files for the fake worker. The process helpers themselves are testkit.worker_process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from testkit.worker_process import NotInstalled, Worker, model_path, worker_dir

def _installed(locate: Callable[[], Path]) -> Path:
    """``locate()``, or the test fails (never skips) saying what is missing and how to install it."""
    try:
        return locate()
    except NotInstalled as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    return _installed(worker_dir)


@pytest.fixture(scope="session")
def model() -> Path:
    return _installed(model_path)


@pytest.fixture
def spawn(bin_dir: Path):
    """spawn(name, *flags, cancel=True, ready=True) -> Worker; every worker is reaped at teardown."""
    workers: list[Worker] = []

    def _spawn(name: str, *flags: str, cancel: bool = True, ready: bool = True, env: dict[str, str] | None = None) -> Worker:
        w = Worker([str(bin_dir / name), *flags], cancel=cancel, env=env)
        workers.append(w)
        if ready:
            w.wait_ready()
        return w

    yield _spawn
    for w in workers:
        if w.proc.poll() is None:
            w.kill()
        w.close()
        assert w.proc.returncode is not None


@pytest.fixture
def fake(spawn):
    """spawn_fake(*flags, **kw): a trioserve-fake-worker."""

    def _fake(*flags: str, **kw: Any) -> Worker:
        return spawn("trioserve-fake-worker", *flags, **kw)

    return _fake


@pytest.fixture
def script_file(tmp_path: Path):
    def _write(strings: list[str]) -> str:
        p = tmp_path / f"script{len(list(tmp_path.iterdir()))}.json"
        p.write_text(json.dumps(strings), encoding="utf-8")
        return str(p)

    return _write
