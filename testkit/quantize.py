"""Quantized synthetic models, the way users run their models (Q4_K_M, Q4_0, Q8_0), made with
llama.cpp's own quantizer (``llama_model_quantize`` of llama.h, through the pinned
llama-cpp-python), and cached outside the repository.

    python -m testkit.quantize make --arch qwen3 --params 1500000000 --type Q4_K_M [--cache DIR]

prints the path of the quantized GGUF, making it (and the F16 model it comes from,
testkit/synthetic_models.py) only when the cache does not hold it yet. The quantizer runs in
the llama-cpp-python child of testkit/native_child.py: native code stays out of the process
that asks, as everywhere in the tests and benchmarks. Random weights: speed only (issue #51).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from testkit.native_child import NativeChild
from testkit.synthetic_models import ARCHS, file_name, make

TYPES = ("Q4_0", "Q4_K_M", "Q8_0", "F16")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trioserve" / "synthetic"


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
    child = NativeChild(src, timeout=3600)
    try:
        code = child.call("quantize", src=str(src), dst=str(tmp), type=qtype)
        if code != 0:
            raise RuntimeError(f"quantizing {src.name} to {qtype} failed (llama_model_quantize returned {code})")
        os.replace(tmp, out)
    finally:
        child.close()
        tmp.unlink(missing_ok=True)
    src.unlink()
    return out


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
    args = ap.parse_args(argv)
    print(quantized(args.arch, args.params, args.type, Path(args.cache), seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
