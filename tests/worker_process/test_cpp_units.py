"""Build and run the C++ unit tests (ctest): UTF-8 assembler, stop matcher, context clamp
and prefill plan, cancel latch/seal, and the worker loop over the fake engine.

They need no llama.cpp, so the build configures with TRIOSERVE_BUILD_LLAMA=OFF.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ctest") is None,
                    reason="cmake/ctest not installed")
def test_ctest_unit_tests_pass(tmp_path):
    build = tmp_path / "build"
    site = sysconfig.get_paths()["purelib"]
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-DTRIOSERVE_BUILD_LLAMA=OFF",
                 "-DTRIOSERVE_BUILD_EXECUTORCH=OFF",  # no worker here: only the unit tests
                 "-DTRIOSERVE_BUILD_TESTS=ON", f"-DCMAKE_PREFIX_PATH={site}"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    for cmd in (configure, ["cmake", "--build", str(build), "-j2"],
                ["ctest", "--test-dir", str(build), "--output-on-failure"]):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert "100% tests passed" in result.stdout
