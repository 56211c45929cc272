"""Prints the CMAKE_ARGS with which pip builds llama.cpp (the llama-cpp-python sdist) for trioserve.

The README's commands run ``CMAKE_ARGS="$(python3 scripts/llama_cmake_args.py)" pip install ...``.
The build is always the portable one (docs/install.md): CPU kernels in run-time-selected modules
(``GGML_BACKEND_DL``, ``GGML_CPU_ALL_VARIANTS``, no ``-march=native``), so the worker picks and
verifies its kernels at start. Of ggml's x86 variants it builds only those this machine can use:

* its best variant (the one ggml's own score picks here),
* the next one down (the worker's fallback when the best one's extra buffer types fault; on an
  AMX CPU this is the same kernels without AMX),
* ``haswell`` (AVX2, what most machines run: the exactness tests force it, so a machine with
  AVX-512 still checks the kernels an AVX2 machine runs) when the CPU has AVX2,
* ``x64`` (the portable baseline).

Four variants instead of fourteen (cmake/ggml_cpu_variants.cmake does the filtering), and
neither llama-cpp-python's multimodal library nor llama.cpp's ``common`` library (trioserve
uses neither: the worker links libllama, and tests use llama-cpp-python's text API). A build
meant for other machines (a wheel or an image) builds every variant with ``--all`` or
``TRIOSERVE_CPU_VARIANTS=all``; ``TRIOSERVE_CPU_VARIANTS=zen4,x64`` names them. Off x86, or
without /proc/cpuinfo, every variant is built.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from pathlib import Path

#: Always on (docs/install.md): run-time-selected kernels, never -march=native.
PORTABLE = ["-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DGGML_NATIVE=OFF"]

HOOK = Path(__file__).resolve().parent.parent / "cmake" / "ggml_cpu_variants.cmake"

#: ggml's x86 variants and the features each is compiled for (ggml/src/CMakeLists.txt).
X86_VARIANTS: dict[str, tuple[str, ...]] = {
    "x64": (),
    "sse42": ("SSE42",),
    "sandybridge": ("SSE42", "AVX"),
    "ivybridge": ("SSE42", "AVX", "F16C"),
    "piledriver": ("SSE42", "AVX", "F16C", "FMA"),
    "haswell": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"),
    "skylakex": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512"),
    "cannonlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI"),
    "cascadelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI"),
    "icelake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI"),
    "cooperlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16"),
    "zen4": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
             "AVX512_BF16"),
    "alderlake": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX_VNNI"),
    "sapphirerapids": ("SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2", "AVX512", "AVX512_VBMI",
                       "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"),
}

#: A feature -> the /proc/cpuinfo flags it needs, and its weight in ggml's x86 score
#: (ggml-cpu/arch/x86/cpu-feats.cpp: 1 + the sum of the weights; 0 if a flag is missing).
FEATURES: dict[str, tuple[tuple[str, ...], int]] = {
    "FMA": (("fma",), 1),
    "F16C": (("f16c",), 1 << 1),
    "SSE42": (("sse4_2",), 1 << 2),
    "BMI2": (("bmi2",), 1 << 3),
    "AVX": (("avx",), 1 << 4),
    "AVX2": (("avx2",), 1 << 5),
    "AVX_VNNI": (("avx_vnni",), 1 << 6),
    "AVX512": (("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"), 1 << 7),
    "AVX512_VBMI": (("avx512vbmi",), 1 << 8),
    "AVX512_BF16": (("avx512_bf16",), 1 << 9),
    "AVX512_VNNI": (("avx512_vnni",), 1 << 10),
    "AMX_TILE": (("amx_tile",), 0),
    "AMX_INT8": (("amx_int8",), 1 << 11),
}


def cpu_flags(cpuinfo: Path) -> set[str] | None:
    """The first ``flags`` line of a /proc/cpuinfo text, or None when there is none."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def score(variant: str, flags: set[str]) -> int:
    """ggml's score of ``variant`` on a CPU with ``flags``: 0 when it cannot run there."""
    total = 1
    for feature in X86_VARIANTS[variant]:
        needed, weight = FEATURES[feature]
        if not all(f in flags for f in needed):
            return 0
        total += weight
    return total


def variants_for(flags: set[str]) -> list[str]:
    """The variants to build for a CPU with ``flags``: best, next one down, haswell, x64."""
    runnable = sorted((v for v in X86_VARIANTS if score(v, flags) > 0), key=lambda v: -score(v, flags))
    keep = runnable[:2]
    if "haswell" in runnable:
        keep.append("haswell")
    keep.append("x64")
    return list(dict.fromkeys(keep))


def chosen_variants(requested: str | None, cpuinfo: Path) -> list[str] | None:
    """The variants to build, or None for every variant ggml has."""
    if requested:
        if requested.strip() == "all":
            return None
        names = [v.strip() for v in requested.split(",") if v.strip()]
        unknown = [v for v in names if v not in X86_VARIANTS]
        if unknown:
            raise SystemExit(f"llama_cmake_args: unknown CPU variant(s) {', '.join(unknown)}; "
                             f"ggml's x86 variants: {', '.join(X86_VARIANTS)}")
        return names
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = cpu_flags(cpuinfo)
    return variants_for(flags) if flags else None


def cmake_args(variants: list[str] | None) -> list[str]:
    """The portable build, without llama-cpp-python's multimodal library (LLAVA_BUILD: trioserve
    never uses it, and with it goes llama.cpp's `common` library), with ``variants`` (None: all)."""
    return [*PORTABLE, "-DLLAVA_BUILD=OFF", f"-DCMAKE_PROJECT_INCLUDE={HOOK}",
            f"-DTRIOSERVE_GGML_CPU_VARIANTS={','.join(variants) if variants is not None else 'all'}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every CPU variant (a wheel or image for other machines)")
    parser.add_argument("--variants", help="comma-separated variants to build (default: chosen for this CPU)")
    parser.add_argument("--cpuinfo", type=Path, default=Path("/proc/cpuinfo"), help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true", help="print the variants, one a line, instead of the args")
    args = parser.parse_args(argv)
    requested = "all" if args.all else (args.variants or os.environ.get("TRIOSERVE_CPU_VARIANTS"))
    variants = chosen_variants(requested, args.cpuinfo)
    if args.list:
        print("\n".join(variants if variants is not None else ["all"]))
    else:
        print(shlex.join(cmake_args(variants)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
