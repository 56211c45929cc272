"""npm-installed agent clients (Codex, Claude Code, pi, opencode) for the tests that run them.

Each client is installed under its own prefix on first use and kept there for later runs.
A test that needs one skips, saying why, when npm is missing or the install fails: the
recorded-request replays beside each live test cover the request shapes without npm.
``record_requests`` keeps what a live client sent, for those recordings and their checks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest


def npm_client(prefix: Path, packages: Sequence[str], binary: str, *, timeout: float = 900) -> Path:
    """The executable ``binary`` of ``packages`` installed under ``prefix`` (``npm install
    --prefix``), installing them first when it is not there yet. Skips the calling test when
    npm is missing, fails, takes longer than ``timeout`` seconds or installs no ``binary``."""
    path = prefix / "node_modules" / ".bin" / binary
    if path.exists():
        return path
    wanted = " ".join(packages)
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: {wanted} cannot be installed")
    prefix.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel", "error",
                        "--prefix", str(prefix), *packages],
                       check=True, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {wanted} took longer than {timeout:.0f} s")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"npm could not install {wanted}: {exc.stderr.decode(errors='replace')[-500:]}")
    if not path.exists():
        pytest.skip(f"npm installed {wanted} but not {path}")
    return path


def record_requests(srv: Any, adapter: str, kept_headers: Sequence[str]) -> list[dict[str, Any]]:
    """Wrap the live server's API adapter ``adapter`` (a field of the default model's :class:`ModelServices`: ``chat``, ``responses``, ``messages``; its ``create``) so that every request's
    JSON body and its ``kept_headers`` are appended, in arrival order, to the returned list."""
    serving = getattr(srv.quart_app.services.default, adapter)
    original = serving.create
    log: list[dict[str, Any]] = []

    async def create(body: bytes, **kwargs: Any) -> Any:
        headers = {k.lower(): v for k, v in (kwargs.get("headers") or {}).items()}
        log.append({"headers": {k: headers[k] for k in kept_headers if k in headers},
                    "body": json.loads(body)})
        return await original(body, **kwargs)

    serving.create = create
    return log
