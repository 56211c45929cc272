"""Helpers shared by the tests (tests/) and the benchmarks (bench/): where the repository and its
test data are, worker processes spoken to over JSONL, the replica fleet behind a router, the
test chat templates, llama.cpp's grammar engine as a checker, and JSON key scanning.

Importable from the repository root (pytest puts it on the path through ``pythonpath`` in
pyproject.toml; ``python -m bench`` runs from the root). It is not part of the trioserve
package and is never shipped.
"""

from __future__ import annotations

import socket
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST_DATA = REPO / "tests" / "data"


def free_port() -> int:
    """A loopback TCP port that is free now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
