"""Prints, and checks, the CPU kernel variant the llama worker runs on this machine (CI).

    python scripts/ci_cpu_variant.py

Starts the installed llama worker once on the embedded model (extra buffer types off, so no
probe) and reads its ready record's ``kernel_path`` (spec/worker-protocol.md §3, §10). Prints
the variant, its instruction-set features and every variant the build holds (the exactness
tests, tests/worker/test_exactness.py, force each of them in turn). Exits 1 when
``TRIOSERVE_REQUIRE_PORTABLE_LLAMA=1`` and the kernels are not run-time selected, or when
``TRIOSERVE_CPU_VARIANT`` names a variant and another one runs.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trioserve.machine import embedded_model_path, installed_worker  # noqa: E402


def main() -> int:
    worker = os.environ.get("TRIOSERVE_WORKER_DIR")
    binary = Path(worker) / "trioserve-llama-worker" if worker else installed_worker("llama")
    argv = [str(binary), "--model", str(embedded_model_path()), "--ctx", "256", "--capacity", "1",
            "--cpu-extra-buffers", "off"]
    # stdin stays open until the ready record is read (EOF tells a worker to exit).
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        ready, _, _ = select.select([proc.stdout], [], [], 300)  # start-up is bounded too
        line = proc.stdout.readline() if ready else b""
        if not ready:
            proc.kill()
        proc.stdin.close()
        err = proc.stderr.read().decode()
        proc.wait(60)
    if not line:
        print(f"the llama worker did not start (status {proc.returncode}):\n{err[-2000:]}")
        return 1
    kp = json.loads(line)["kernel_path"]
    variant = kp.get("cpu_variant")
    how = "forced" if kp.get("cpu_variant_forced") else "selected at run time" if variant else "linked"
    print(f"CPU kernels: {variant or 'linked backend'} ({how}); features: {' '.join(kp['cpu_features'])}")
    print(f"CPU variants in the build: {', '.join(kp.get('cpu_variants_present') or []) or 'none (linked)'}")
    if os.environ.get("TRIOSERVE_REQUIRE_PORTABLE_LLAMA") == "1" and kp.get("cpu_backend") != "runtime-selected":
        print("error: the installed llama.cpp is not the portable build (CPU kernels not run-time selected)")
        return 1
    forced = os.environ.get("TRIOSERVE_CPU_VARIANT")
    if forced and variant != forced:
        print(f"error: TRIOSERVE_CPU_VARIANT={forced} but the worker runs {variant}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
