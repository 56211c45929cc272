"""What a model will cost in memory before it was ever loaded: its weights and a KV-cache estimate.

The memory budget (worker/lifecycle.py) counts each loaded model at what its workers' ready
records report (spec/worker-protocol.md §3: the model file, ``kv_cache_bytes``,
``recurrent_state_bytes``, ``attention_matrix_bytes``). Before a model's first load there is no
ready record, so its cost is estimated here from the file: the weights are the file's size
(llama.cpp maps the file; every worker of a model shares the pages), the KV cache is the llama
worker's own fallback estimate (§3 ``kv_cache_bytes``): f16 (or the configured cache type) with
every attention layer at ``n_ctx`` cells, from the GGUF's shape, plus a hybrid model's
recurrent state, times the slots and workers, plus without flash attention each worker's
attention matrix. That is an upper bound for sliding-window models (whose window layers may
hold fewer cells), which is what :class:`~trioserve.worker.lifecycle.CostEstimate` expects of
``expected``; ``at_least`` is the weights alone.

Only the GGUF header's key/value section is read (the tensor data is not touched), so the
estimate costs a few milliseconds even for large files.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trioserve.config import Settings
from trioserve.machine import physical_memory_bytes
from trioserve.worker.model_loader import CostEstimate

__all__ = ["AUTO_FLASH_ATTN_OFF_MAX_BYTES", "AUTO_FLASH_ATTN_OFF_MIN_MODEL_BYTES", "GgufShape", "KV_BYTES_PER_ELEMENT",
           "GgufInfo", "attention_matrix_bytes", "estimate_model_cost", "estimate_settings_cost",
           "flash_attention_off", "model_weights_bytes", "read_gguf_info", "read_gguf_shape"]

# The workers' slot count when --slots is 0 (the worker's own default).
_DEFAULT_SLOTS = 4
# The fake engine's KV: 4 bytes a token (spec/worker-protocol.md §3), and its default context.
_FAKE_KV_BYTES_PER_TOKEN = 4
_FAKE_DEFAULT_CONTEXT = 4096

# --flash-attn auto runs a CPU worker without flash attention for a model file of at least
# the first size, every layer attending over the whole context, whose attention matrix is at
# most the second (kAutoFlashAttnOffMinModelBytes,
# kAutoFlashAttnOffMaxBytes: cpp/kv_cache_type.h).
AUTO_FLASH_ATTN_OFF_MIN_MODEL_BYTES = 512 << 20
AUTO_FLASH_ATTN_OFF_MAX_BYTES = 1 << 30
# The llama worker's micro-batch (tokens a graph computes at once: min(--batch-tokens, 512)).
_MICRO_BATCH = 512

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
    """The numbers of a GGUF that size its KV cache and, in a hybrid model, its recurrent state."""

    n_layer: int
    n_ctx_train: int
    n_embd_k_per_layer: int  # key elements per token per layer (heads_kv × key length)
    n_embd_v_per_layer: int
    n_kv_layer: int | None = None  # layers with a KV cache; None: all (a hybrid has fewer)
    recurrent_bytes: int = 0  # one sequence's recurrent state, all recurrent layers (f32)
    n_head: int = 0  # query heads (the attention matrix without flash attention)
    sliding_window: int = 0  # cells a sliding-window layer sees (0: none)

    @property
    def full_attention_only(self) -> bool:
        """Every layer attends over the whole context: no recurrent and no window layers."""
        return self.n_kv_layer is None and self.sliding_window == 0

    def kv_bytes(self, n_ctx: int, bytes_per_element: float = 2.0) -> int:
        """KV bytes of ``n_ctx`` cells in every attention layer (one slot's worth at ``n_ctx``)."""
        layers = self.n_layer if self.n_kv_layer is None else self.n_kv_layer
        per_token = layers * (self.n_embd_k_per_layer + self.n_embd_v_per_layer)
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
    return _shape(_read_metadata(path, _wanted), path)


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF's header says about serving it, before any worker loaded it."""

    architecture: str | None  # general.architecture
    context_length: int | None  # <arch>.context_length: the training context
    chat_template: str | None  # tokenizer.chat_template (None: the file carries none)


def read_gguf_info(path: str | Path) -> GgufInfo:
    """Read ``path``'s :class:`GgufInfo` from its header (mapped as :func:`read_gguf_shape`
    maps it; the vocabulary is skipped, not decoded).

    Raises:
        ValueError: not a GGUF (or a truncated or corrupt header).
        OSError: the file cannot be read.
    """
    meta = _read_metadata(path, lambda key: key in (
        "general.architecture", "tokenizer.chat_template") or key.endswith(".context_length"))
    arch = meta.get("general.architecture")
    arch = arch if isinstance(arch, str) and arch else None
    context = meta.get(f"{arch}.context_length") if arch else None
    template = meta.get("tokenizer.chat_template")
    return GgufInfo(architecture=arch,
                    context_length=context if isinstance(context, int) and context > 0 else None,
                    chat_template=template if isinstance(template, str) and template else None)


def _read_metadata(path: str | Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The header's key/value pairs whose key ``wanted`` accepts (the others are skipped)."""
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
            meta[key] = reader.value(reader.scalar("<I"), keep=wanted(key))
    return meta


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
    n_layer = number("block_count")
    # A hybrid of the Qwen3.5 family: every `full_attention_interval`-th layer attends, the
    # others are gated delta-net layers with a fixed-size f32 state per sequence (llama.cpp's
    # conv state (d_conv - 1) x (d_inner + 2 x groups x d_state) and d_state x d_inner).
    interval = number("full_attention_interval", 0)
    n_kv_layer, recurrent = None, 0
    if interval > 0:
        n_kv_layer = n_layer // interval
        d_inner, d_state = number("ssm.inner_size", 0), number("ssm.state_size", 0)
        conv = (number("ssm.conv_kernel", 1) - 1) * (d_inner + 2 * number("ssm.group_count", 0) * d_state)
        recurrent = 4 * (n_layer - n_kv_layer) * (conv + d_state * d_inner)
    return GgufShape(n_layer=n_layer, n_ctx_train=number("context_length"),
                     n_embd_k_per_layer=n_head_kv * number("attention.key_length", head_dim),
                     n_embd_v_per_layer=n_head_kv * number("attention.value_length", head_dim),
                     n_kv_layer=n_kv_layer, recurrent_bytes=recurrent, n_head=n_head,
                     sliding_window=number("attention.sliding_window", 0))


def attention_matrix_bytes(shape: GgufShape, cells: int) -> int:
    """The attention matrix llama.cpp reserves without flash attention (the ready record's
    ``attention_matrix_bytes``): a 512-token micro-batch against one slot's ``cells``, every
    query head, f32."""
    return 4 * shape.n_head * _MICRO_BATCH * cells


def flash_attention_off(flash_attn: str, shape: GgufShape, cells: int, file_bytes: int) -> bool:
    """Whether a worker with every layer on the CPU, an f16 cache and no speculation runs
    without flash attention: ``--flash-attn off``, or ``auto`` for a model file of
    ``file_bytes`` ≥ :data:`AUTO_FLASH_ATTN_OFF_MIN_MODEL_BYTES` whose every layer attends
    over the whole context and whose attention matrix at ``cells`` per slot fits
    :data:`AUTO_FLASH_ATTN_OFF_MAX_BYTES` (the worker's resolve_flash_attn, cpp/kv_cache_type.h)."""
    return flash_attn == "off" or (flash_attn == "auto" and file_bytes >= AUTO_FLASH_ATTN_OFF_MIN_MODEL_BYTES
                                   and shape.full_attention_only
                                   and attention_matrix_bytes(shape, cells) <= AUTO_FLASH_ATTN_OFF_MAX_BYTES)


def estimate_model_cost(path: str | Path, *, n_ctx: int, slots: int, workers: int,
                        kv_cache_type: str = "f16", kv_budget_bytes: int | None = None,
                        flash_attn: str = "on") -> CostEstimate:
    """A llama model's :class:`CostEstimate`: its weights (``at_least``) plus, in
    ``expected``, each worker's KV cache for ``slots`` slots of ``n_ctx`` cells (0: the
    training context, capped by ``kv_budget_bytes`` per worker as the worker caps it) and,
    when its workers run without flash attention (:func:`flash_attention_off` of
    ``flash_attn``, the setting of a worker with every layer on the CPU and an f16 cache;
    ``"on"`` for any other), its :func:`attention_matrix_bytes`. A file whose metadata
    cannot be read is estimated at its weights alone.

    Raises:
        OSError: the file cannot be read.
    """
    weights = model_weights_bytes(path)
    try:
        shape = read_gguf_shape(path)
    except ValueError:
        return CostEstimate(weights, weights)
    per_element = KV_BYTES_PER_ELEMENT.get(kv_cache_type or "f16", 2.0)
    cells = n_ctx or shape.n_ctx_train
    kv = shape.kv_bytes(cells, per_element) * max(1, slots)
    if n_ctx == 0 and kv_budget_bytes is not None and kv > kv_budget_bytes:
        cells = cells * kv_budget_bytes // kv  # the context the worker's cap leaves
        kv = kv_budget_bytes
    kv += shape.recurrent_bytes * max(1, slots)
    if flash_attention_off(flash_attn, shape, cells, weights):
        kv += attention_matrix_bytes(shape, cells)
    return CostEstimate(weights + kv * max(1, workers), weights)


def estimate_settings_cost(settings: Settings) -> CostEstimate:
    """The :class:`CostEstimate` of a model served with ``settings`` (a model's own, the
    server's with its values applied), before it was ever loaded: the fake engine's KV alone
    (it has no file), else :func:`estimate_model_cost` of its file with the workers' own
    context cap when ``max_context`` is 0 (a quarter of physical memory per worker,
    config.Settings.worker_argv).

    Raises:
        OSError: the model file cannot be read.
    """
    slots = settings.slots or _DEFAULT_SLOTS
    if settings.engine == "fake":
        kv = (_FAKE_KV_BYTES_PER_TOKEN * (settings.max_context or _FAKE_DEFAULT_CONTEXT)
              * slots * settings.workers)
        return CostEstimate(kv, kv)
    path = settings.resolved_model_path() if settings.engine == "llama" else settings.model_path
    kv_budget = None
    cache_type = getattr(settings, "kv_cache_type", "") or "f16"
    # As the llama worker decides (resolve_flash_attn): a quantized cache or layers on a GPU
    # never need the attention matrix in host memory, and auto is on for speculation.
    flash_attn = settings.flash_attn
    if cache_type != "f16" or settings.gpu_layers != 0 or (flash_attn == "auto" and settings.speculative == "auto"):
        flash_attn = "on"
    if settings.max_context == 0:  # the worker's own cap (config.Settings.worker_argv)
        kv_budget = physical_memory_bytes() // 4 // settings.workers
    return estimate_model_cost(path, n_ctx=settings.max_context, slots=slots,
                               workers=settings.workers,
                               kv_cache_type=cache_type, kv_budget_bytes=kv_budget,
                               flash_attn=flash_attn)


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
