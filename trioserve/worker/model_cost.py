"""What a model will cost in memory before it was ever loaded: its weights and a KV-cache estimate.

The memory budget (worker/lifecycle.py) counts each loaded model at what its workers' ready
records report (spec/worker-protocol.md §3: the model file, ``kv_cache_bytes``). Before a
model's first load there is no ready record, so its cost is estimated here from the file: the
weights are the file's size (llama.cpp maps the file; every worker of a model shares the
pages), the KV cache is the llama worker's own fallback estimate (§3 ``kv_cache_bytes``): f16
(or the configured cache type) with every layer at ``n_ctx`` cells, from the GGUF's shape,
times the slots and workers. That is an upper bound for sliding-window models (whose window
layers may hold fewer cells), which is what :class:`~trioserve.worker.lifecycle.CostEstimate`
expects of ``expected``; ``at_least`` is the weights alone.

Only the GGUF header's key/value section is read (the tensor data is not touched), so the
estimate costs a few milliseconds even for large files.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trioserve.worker.model_loader import CostEstimate

__all__ = ["GgufShape", "KV_BYTES_PER_ELEMENT", "estimate_model_cost", "model_weights_bytes",
           "read_gguf_shape"]

# Bytes per cached element of each KV cache type (ggml's block sizes: q8_0 packs 32 values in
# 34 bytes, q4_0 in 18).
KV_BYTES_PER_ELEMENT = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}

# Fixed-size GGUF value types (type id → struct format); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_MAX_KEYS = 1 << 20  # a sane bound: a corrupt count must not loop for ever


@dataclass(frozen=True)
class GgufShape:
    """The numbers of a GGUF that size its KV cache."""

    n_layer: int
    n_ctx_train: int
    n_embd_k_per_layer: int  # key elements per token per layer (heads_kv × key length)
    n_embd_v_per_layer: int

    def kv_bytes(self, n_ctx: int, bytes_per_element: float = 2.0) -> int:
        """KV bytes of ``n_ctx`` cells in every layer (one slot's worth at ``n_ctx``)."""
        per_token = self.n_layer * (self.n_embd_k_per_layer + self.n_embd_v_per_layer)
        return int(per_token * n_ctx * bytes_per_element)


def model_weights_bytes(path: str | Path) -> int:
    """The weights' size: the file's, or for a folder (a split GGUF, an ExecuTorch program)
    the sum of its files'."""
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size


def read_gguf_shape(path: str | Path) -> GgufShape:
    """Read a GGUF's KV-sizing metadata (``<arch>.block_count``, ``context_length``,
    ``embedding_length``, ``attention.head_count[_kv]``, ``attention.key_length`` /
    ``value_length``). The file is mapped, not read: only the header's pages are touched.

    Raises:
        ValueError: not a GGUF, or the metadata lacks what sizes the cache.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        reader = _Reader(data)
        if reader.bytes(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = reader.scalar("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        reader.scalar("<Q")  # tensor count
        count = reader.scalar("<Q")
        if count > _MAX_KEYS:
            raise ValueError(f"{path}: implausible metadata count {count}")
        meta: dict[str, Any] = {}
        for _ in range(count):
            key = reader.string()
            meta[key] = reader.value(reader.scalar("<I"), keep=_wanted(key))
    return _shape(meta, path)


def _wanted(key: str) -> bool:
    return key == "general.architecture" or not key.startswith(("tokenizer.", "general."))


def _shape(meta: dict[str, Any], path: str | Path) -> GgufShape:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: no general.architecture")

    def number(name: str, default: int | None = None) -> int:
        value = meta.get(f"{arch}.{name}", default)
        if isinstance(value, list):  # per-layer values (some architectures): the largest
            value = max(value, default=default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{path}: no {arch}.{name}")
        return value

    n_head = number("attention.head_count")
    n_head_kv = number("attention.head_count_kv", n_head)
    head_dim = number("embedding_length") // max(1, n_head)
    return GgufShape(n_layer=number("block_count"), n_ctx_train=number("context_length"),
                     n_embd_k_per_layer=n_head_kv * number("attention.key_length", head_dim),
                     n_embd_v_per_layer=n_head_kv * number("attention.value_length", head_dim))


def estimate_model_cost(path: str | Path, *, n_ctx: int, slots: int, workers: int,
                        kv_cache_type: str = "f16", kv_budget_bytes: int | None = None) -> CostEstimate:
    """A llama model's :class:`CostEstimate`: its weights (``at_least``) plus, in
    ``expected``, each worker's KV cache for ``slots`` slots of ``n_ctx`` cells (0: the
    training context, capped by ``kv_budget_bytes`` per worker as the worker caps it).
    A file whose metadata cannot be read is estimated at its weights alone.

    Raises:
        OSError: the file cannot be read.
    """
    weights = model_weights_bytes(path)
    try:
        shape = read_gguf_shape(path)
    except ValueError:
        return CostEstimate(weights, weights)
    per_element = KV_BYTES_PER_ELEMENT.get(kv_cache_type or "f16", 2.0)
    kv = shape.kv_bytes(n_ctx or shape.n_ctx_train, per_element) * max(1, slots)
    if n_ctx == 0 and kv_budget_bytes is not None:
        kv = min(kv, kv_budget_bytes)
    return CostEstimate(weights + kv * max(1, workers), weights)


class _Reader:
    """A cursor over the mapped file (struct.unpack_from: no copy, no system call per value)."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.at = 0

    def bytes(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise ValueError("truncated GGUF metadata")
        self.at += n
        return self.data[self.at - n:self.at]

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise ValueError("truncated GGUF metadata")
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += size
        return value

    def string(self, keep: bool = True) -> str:
        length = self.scalar("<Q")
        if not keep:
            self.skip(length)
            return ""
        return self.bytes(length).decode("utf-8", "replace")

    def skip(self, n: int) -> None:
        if self.at + n > len(self.data):
            raise ValueError("truncated GGUF metadata")
        self.at += n

    def value(self, kind: int, *, keep: bool) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string(keep)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, length = self.scalar("<I"), self.scalar("<Q")
        if item_kind in _SCALARS and not keep:  # fixed-size items (token scores): one skip
            self.skip(length * struct.calcsize(_SCALARS[item_kind]))
            return None
        if item_kind == _STRING and not keep:  # the vocabulary: a tight loop over lengths
            at, end, unpack = self.at, len(self.data) - 8, _U64.unpack_from
            for _ in range(length):
                if at > end:
                    raise ValueError("truncated GGUF metadata")
                at += 8 + unpack(self.data, at)[0]
            self.at = at
            return None
        items = [self.value(item_kind, keep=keep) for _ in range(length)]
        return items if keep else None
