"""The kernel path the llama worker chooses on this machine, for every other program that runs a
llama.cpp model beside it in tests and benchmarks (llama-cpp-python in testkit.native_child's
child, llama-server in bench/): one rule, the worker's (cpp/engines/llama/kernel_path.h), asked
of the worker itself with ``--kernel-path-only``.
"""

from __future__ import annotations

import functools
import json
import subprocess
from typing import Any

from testkit.native_child import how_it_ended
from testkit.worker_process import worker_dir


@functools.cache
def kernel_path(model: str, threads: int = 2) -> dict[str, Any]:
    """The ``kernel_path`` fields of the worker's ready record for ``model`` (CPU variant, extra
    buffer types kept and dropped, probes), from ``trioserve-llama-worker --kernel-path-only``;
    cached per process. The probes run, so the first call per model costs a model load or two."""
    exe = worker_dir("trioserve-llama-worker") / "trioserve-llama-worker"
    out = subprocess.run([str(exe), "--model", model, "--threads", str(threads), "--kernel-path-only"],
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"{exe} --kernel-path-only {how_it_ended(out.returncode)}: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def forced_variant(path: dict[str, Any]) -> str:
    """The CPU variant to load elsewhere for this kernel path ("" = a linked CPU backend)."""
    return path.get("cpu_variant", "") if path.get("cpu_backend") == "runtime-selected" else ""


def llama_server_args(path: dict[str, Any]) -> list[str]:
    """llama-server's arguments for the same extra-buffer choice: a natively built llama-server
    has one set of kernels and one switch for all its extra buffer types (``--no-repack``), so
    any type the worker dropped (a failed probe: AMX on some Xeons) turns them all off there."""
    return ["--no-repack"] if path["extra_buffer_types_dropped"] else []
