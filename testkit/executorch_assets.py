"""The committed tiny ExecuTorch model (tests/data/executorch, made by
scripts/executorch/export_tiny_pte.py) and how tests find the ExecuTorch worker.

The worker comes from the `executorch` extra (the trioserve-executorch distribution) or the dev
CMake tree, built where the `executorch` wheel is installed. Tests that need it skip
when it is missing, unless ``TRIOSERVE_REQUIRE_EXECUTORCH=1`` (set by .ci/run), which turns the
skip into a failure so CI cannot pass without testing the engine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from testkit import REPO, TEST_DATA

DATA = TEST_DATA / "executorch"
PTE = DATA / "tiny.pte"
TOKENIZER = DATA / "tokenizer.json"
# The same weights exported twice: plain attention, and --use_sdpa_with_kv_cache (the program
# calls llama::update_cache / llama::custom_sdpa, trioserve's own kernels: cpp/engines/executorch/llama_custom_ops.h).
# Both must reproduce expected.json (the Python runtime's ids for the plain program: the wheel's
# Python runtime has no llama:: kernels, so it cannot run the fused one).
PROGRAMS = {"tiny": PTE, "tiny_sdpa": DATA / "tiny_sdpa.pte"}
WORKER_NAME = "trioserve-executorch-worker"


def expected() -> dict[str, Any]:
    """Greedy ids recorded with ExecuTorch's Python runtime for the committed tiny.pte."""
    return json.loads((DATA / "expected.json").read_text())


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("TRIOSERVE_WORKER_DIR")
    if env:
        out.append(Path(env) / WORKER_NAME)
    try:
        dist = importlib.metadata.distribution("trioserve")
        out += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == WORKER_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    # The trioserve-executorch distribution (the `executorch` extra) installs it in its package.
    spec = importlib.util.find_spec("trioserve_executorch")
    if spec is not None and spec.submodule_search_locations:
        out += [Path(d) / "bin" / WORKER_NAME for d in spec.submodule_search_locations]
    out.append(REPO / "build" / "dev" / WORKER_NAME)
    return out


def executorch_worker() -> Path:
    """The built worker, or skip (fail under TRIOSERVE_REQUIRE_EXECUTORCH=1)."""
    for c in _candidates():
        if c.is_file():
            return c
    message = ("trioserve-executorch-worker is not installed (pip install '.[executorch]', or build "
               "build/dev with the executorch wheel installed: see docs/executorch.md)")
    if os.environ.get("TRIOSERVE_REQUIRE_EXECUTORCH") == "1":
        pytest.fail(message)
    pytest.skip(message)
