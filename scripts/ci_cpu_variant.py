"""Prints, and checks, the CPU kernels the llama worker runs on this machine (CI).

    python scripts/ci_cpu_variant.py [--configure-check]

Asks the installed llama worker for its kernel path on the embedded model
(``--kernel-path-only``: the probes of cpp/engines/llama/kernel_path.h run, nothing is served)
and prints the CPU variant, its instruction-set features, the extra buffer types kept and
dropped (with why), and every variant the build holds (the exactness tests,
tests/worker_process/test_exactness.py, force each of them in turn). Exits 1 when
``TRIOSERVE_REQUIRE_PORTABLE_LLAMA=1`` and the kernels are not run-time selected or the build
does not hold the variants scripts/llama_cmake_args.py chose for this CPU, or when
``TRIOSERVE_CPU_VARIANT`` names a variant and another one runs.

``--configure-check`` also configures (never compiles) the llama-cpp-python sdist's llama.cpp
twice, with this machine's arguments and with ``--all`` (the switch for wheels and images), and
checks the CPU variants each would build: this machine's choice, and every x86 variant.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import llama_cmake_args  # noqa: E402
from trioserve.machine import embedded_model_path, installed_worker  # noqa: E402

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the pin of pyproject.toml


def kernel_report() -> int:
    worker = os.environ.get("TRIOSERVE_WORKER_DIR")
    binary = Path(worker) / "trioserve-llama-worker" if worker else installed_worker("llama")
    out = subprocess.run([str(binary), "--model", str(embedded_model_path()), "--threads", "2", "--kernel-path-only"],
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        print(f"the llama worker could not choose its kernel path (status {out.returncode}):\n{out.stderr[-2000:]}")
        return 1
    kp = json.loads(out.stdout)
    variant = kp.get("cpu_variant")
    how = "forced" if kp.get("cpu_variant_forced") else "selected at run time" if variant else "linked"
    present = kp.get("cpu_variants_present") or []
    print(f"CPU kernels: {variant or 'linked backend'} ({how}); features: {' '.join(kp['cpu_features'])}")
    print(f"CPU variants in the build: {', '.join(present) or 'none (linked)'}")
    print(f"extra buffer types offered: {', '.join(kp['extra_buffer_types']) or 'none'}; "
          f"kept: {', '.join(kp['extra_buffer_types_kept']) or 'none'}")
    for name, why in kp["extra_buffer_types_dropped"].items():
        print(f"  {name} dropped: {why}")
    for probe in kp["probes"]:
        print(f"  probe of {probe['variant'] or 'the linked backend'}: {probe['result']} ({probe['ms']} ms)")
    if os.environ.get("TRIOSERVE_REQUIRE_PORTABLE_LLAMA") == "1":
        if kp.get("cpu_backend") != "runtime-selected":
            print("error: the installed llama.cpp is not the portable build (CPU kernels not run-time selected)")
            return 1
        chosen = llama_cmake_args.chosen_variants(os.environ.get("TRIOSERVE_CPU_VARIANTS"), Path("/proc/cpuinfo"))
        if chosen is not None and sorted(chosen) != sorted(present):
            print(f"error: the build holds {present}, not the variants chosen for this CPU: {chosen}")
            return 1
    forced = os.environ.get("TRIOSERVE_CPU_VARIANT")
    if forced and variant != forced:
        print(f"error: TRIOSERVE_CPU_VARIANT={forced} but the worker runs {variant}")
        return 1
    return 0


def configured_variants(source: Path, args: list[str], build: Path) -> list[str]:
    """The ggml-cpu-<variant> modules a configure of ``source`` with ``args`` would build."""
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *args], check=True,
                   capture_output=True, timeout=600)
    targets = subprocess.run(["ninja", "-C", str(build), "-t", "targets", "all"], check=True, capture_output=True,
                             text=True, timeout=120).stdout
    return sorted(set(re.findall(r"^ggml-cpu-([a-z0-9_]+): phony", targets, re.M)))  # not the -feats ones


def configure_check() -> int:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print("configure check: x86-64 only; skipped")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, LLAMA_CPP_PYTHON], check=True, timeout=600)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(p for p in Path(tmp).iterdir() if p.is_dir())
        mine = llama_cmake_args.chosen_variants(None, Path("/proc/cpuinfo"))
        here = configured_variants(source, llama_cmake_args.cmake_args(mine), Path(tmp) / "here")
        every = configured_variants(source, llama_cmake_args.cmake_args(None), Path(tmp) / "all")
    print(f"configure check: this machine's install builds {', '.join(here)}")
    print(f"configure check: --all builds {len(every)}: {', '.join(every)}")
    ok = True
    if mine is not None and here != sorted(mine):
        print(f"error: expected {sorted(mine)}")
        ok = False
    if every != sorted(llama_cmake_args.X86_VARIANTS):
        print(f"error: --all should build every x86 variant: {sorted(llama_cmake_args.X86_VARIANTS)}")
        ok = False
    return 0 if ok else 1


def main() -> int:
    rc = kernel_report()
    if "--configure-check" in sys.argv[1:]:
        rc = configure_check() or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
