"""Suite-wide guard: no native model runtime ends up loaded in the test process.

tests/unit/test_native_child.py scans the sources; this checks the process itself at the end of
the run, so an indirect load (a helper that imports llama_cpp, a library that dlopens libggml)
is caught too. Such code belongs in a worker or in testkit.native_child's child process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

NATIVE_RUNTIME = re.compile(r"/lib(llama|ggml[\w-]*|executorch[\w-]*|torch[\w-]*)\.so")


def native_runtimes_loaded() -> list[str]:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    return sorted({m.group(0) for m in NATIVE_RUNTIME.finditer(maps.read_text())})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    loaded = native_runtimes_loaded()
    if loaded:
        session.config.get_terminal_writer().line(
            f"FAILED: native model runtimes were loaded into the test process: {', '.join(loaded)} "
            "(run them in a worker or testkit.native_child)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
