"""Quantized synthetic models, the way users run their models (Q4_K_M, Q4_0, Q8_0), made with
llama.cpp's own quantizer (``llama_model_quantize`` of llama.h, through the pinned
llama-cpp-python), and cached outside the repository.

    python -m testkit.quantize make --arch qwen3 --params 1500000000 --type Q4_K_M [--cache DIR]

prints the path of the quantized GGUF, making it (and the F16 model it comes from,
testkit/synthetic_models.py) only when the cache does not hold it yet. The quantizer runs in a
child process (``python -m testkit.quantize run SRC DST TYPE``): native code stays out of the
process that asks, as everywhere in the tests and benchmarks (docs/install.md). Random
weights: speed only (issue #51).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from testkit.synthetic_models import ARCHS, file_name, make

TYPES = ("Q4_0", "Q4_K_M", "Q8_0", "F16")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trioserve" / "synthetic"
REPO = Path(__file__).resolve().parent.parent


def quantized(arch: str, params: int, qtype: str, cache: Path = DEFAULT_CACHE, *, seed: int = 0) -> Path:
    """The cached ``arch`` model of at least ``params`` parameters, quantized to ``qtype``;
    made (F16 first, then quantized; the F16 file is removed afterwards unless F16 was asked
    for) when missing. Files appear under their final name only when whole (temp + rename)."""
    if qtype not in TYPES:
        raise ValueError(f"type must be one of {', '.join(TYPES)}, not {qtype!r}")
    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / file_name(arch, seed, params, "f16")
    if qtype == "F16":
        return f16 if f16.exists() else make(arch, cache, seed=seed, params=params)
    out = cache / f16.name.replace("-f16.gguf", f"-{qtype.lower()}.gguf")
    if out.exists():
        return out
    src = f16 if f16.exists() else make(arch, cache, seed=seed, params=params)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        run = subprocess.run([sys.executable, "-m", "testkit.quantize", "run", str(src), str(tmp), qtype],
                             cwd=REPO, capture_output=True, text=True, timeout=3600)
        if run.returncode != 0:
            raise RuntimeError(f"quantizing {src.name} to {qtype} failed: {run.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    src.unlink()
    return out


def _run_quantizer(src: str, dst: str, qtype: str) -> int:
    """In the child: llama.h's quantizer over every matrix, with its default choices."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = os.cpu_count() or 1
    return int(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testkit.quantize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="make (or find in the cache) a quantized synthetic model")
    mk.add_argument("--arch", required=True, choices=ARCHS)
    mk.add_argument("--params", type=int, required=True)
    mk.add_argument("--type", default="Q4_K_M", choices=TYPES)
    mk.add_argument("--cache", default=str(DEFAULT_CACHE))
    mk.add_argument("--seed", type=int, default=0)
    run = sub.add_parser("run", help="(internal) quantize SRC into DST in this process")
    run.add_argument("src")
    run.add_argument("dst")
    run.add_argument("type", choices=TYPES)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return _run_quantizer(args.src, args.dst, args.type)
    print(quantized(args.arch, args.params, args.type, Path(args.cache), seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
