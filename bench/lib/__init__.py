"""The benchmark library: what the sections share (servers as child processes or in process, the
raw-socket streaming client, worker processes, statistics, machine facts, markdown sections).

Sections (``bench/*_bench.py``) import this package and testkit/ only, never each other nor the
runner (``bench/runner.py``) or the report writer (``bench/report.py``). Nothing here asserts on
time: benchmarks print tables.
"""

from __future__ import annotations

from testkit import REPO

__all__ = ["REPO"]
