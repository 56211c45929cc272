// kv_cache_type.h — the element type of the KV cache (--kv-cache-type, spec/worker-protocol.md
// §3, §10, §11) and its flash-attention setting (--flash-attn).
//
//   f16   2 bytes an element (llama.cpp's default)
//   q8_0  blocks of 32 elements in 34 bytes (an f16 scale + 32 int8): 53% of f16
//   q4_0  blocks of 32 elements in 18 bytes (an f16 scale + 32 nibbles): 28% of f16
//
// K and V take the same type. llama.cpp computes attention over a quantized V cache only with
// flash attention, so a quantized type needs --flash-attn auto (turned on) or on; with off the
// worker refuses to start rather than let llama.cpp fail later or fall back silently.
#pragma once

#include <cstdint>
#include <string>

namespace trioserve {

enum class KvCacheType { f16, q8_0, q4_0 };
enum class FlashAttnMode { automatic, on, off };

/// Parses "f16" | "q8_0" | "q4_0"; false for anything else.
inline bool parse_kv_cache_type(const std::string& s, KvCacheType& out) {
    if (s == "f16") out = KvCacheType::f16;
    else if (s == "q8_0") out = KvCacheType::q8_0;
    else if (s == "q4_0") out = KvCacheType::q4_0;
    else return false;
    return true;
}

inline const char* kv_cache_type_name(KvCacheType t) {
    switch (t) {
        case KvCacheType::f16: return "f16";
        case KvCacheType::q8_0: return "q8_0";
        case KvCacheType::q4_0: return "q4_0";
    }
    return "f16";
}

/// Bytes of a block of 32 elements (ggml's block sizes; f16: 32 x 2).
inline uint64_t kv_block_bytes(KvCacheType t) {
    switch (t) {
        case KvCacheType::f16: return 64;
        case KvCacheType::q8_0: return 34;
        case KvCacheType::q4_0: return 18;
    }
    return 64;
}

/// `f16_bytes` of KV cache stored as `t` (whole 32-element blocks: every head size in use is a
/// multiple of 32).
inline uint64_t kv_bytes_as(KvCacheType t, uint64_t f16_bytes) { return f16_bytes / 64 * kv_block_bytes(t); }

/// Parses "auto" | "on" | "off"; false for anything else.
inline bool parse_flash_attn_mode(const std::string& s, FlashAttnMode& out) {
    if (s == "auto") out = FlashAttnMode::automatic;
    else if (s == "on") out = FlashAttnMode::on;
    else if (s == "off") out = FlashAttnMode::off;
    else return false;
    return true;
}

/// Why a KV cache type and flash-attention setting cannot go together; empty when they can.
inline std::string kv_cache_conflict(KvCacheType t, FlashAttnMode fa) {
    if (t == KvCacheType::f16 || fa != FlashAttnMode::off) return {};
    return std::string("--kv-cache-type ") + kv_cache_type_name(t) +
           " quantizes the V cache, which llama.cpp can only compute with flash attention, and "
           "--flash-attn is off: use --flash-attn auto (or on), or --kv-cache-type f16";
}

}  // namespace trioserve
