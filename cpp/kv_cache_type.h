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

#include <algorithm>
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

/// The flag's spelling of `m` (parse_flash_attn_mode's inverse).
inline const char* flash_attn_mode_name(FlashAttnMode m) {
    switch (m) {
        case FlashAttnMode::on: return "on";
        case FlashAttnMode::off: return "off";
        case FlashAttnMode::automatic: return "auto";
    }
    return "auto";
}

/// `--flash-attn auto` on a CPU runs without flash attention only for a model file of at least
/// this size (512 MiB) whose every layer attends over the whole context, and an attention matrix (a 512-token micro-batch against one sequence's
/// cells, every query head, f32) of at most kAutoFlashAttnOffMaxBytes (1 GiB: e.g. 43,690
/// cells per slot at 12 query heads, 16,384 at 32). Mirrored by trioserve/worker/model_cost.py.
inline constexpr uint64_t kAutoFlashAttnOffMinModelBytes = uint64_t{512} << 20;
inline constexpr uint64_t kAutoFlashAttnOffMaxBytes = uint64_t{1} << 30;

/// What resolve_flash_attn weighs besides the setting.
struct FlashAttnInputs {
    KvCacheType kv_cache_type = KvCacheType::f16;
    int32_t n_gpu_layers = 0;
    bool speculative = false;        ///< --speculative auto
    uint64_t model_file_bytes = 0;
    /// Every layer attends over the whole context: no recurrent (hybrid) and no sliding-window layers.
    bool full_attention_only = true;
    int64_t n_head = 0;              ///< query heads
    int64_t n_ctx_per_seq = 0;       ///< cells per slot
};

/// What `--flash-attn auto` means (spec/worker-protocol.md §10); `on` and `off` are returned
/// as given. Auto is on with a quantized cache (only flash attention computes one); llama.cpp's
/// own choice (`automatic`) with layers on a GPU; on with `--speculative auto` (without flash
/// attention a verify step's logits differ from plain decoding at every thread count measured,
/// so the start-up check would refuse drafting). On a CPU otherwise it is off for a model file
/// of at least kAutoFlashAttnOffMinModelBytes whose every layer attends over the whole context
/// and whose attention matrix then fits kAutoFlashAttnOffMaxBytes, else on. Why: ggml's CPU flash attention streams the whole cache
/// once per query row, so a step of n queries deep in a context costs about n decode steps;
/// from the 1.5B class on (2 cores) a paced prompt step deep in a context outlasts the step
/// target by seconds with it (dense 1.5B at 8k cells: 16 queries 3.9 s with it, 0.84 s
/// without; a decode 0.20 vs 0.12 s), while a smaller model's steps fit the target either way
/// and run faster with it (SmolLM2-135M: decode 8-15 % faster). A hybrid (Qwen3.5: one layer in
/// four attends) or sliding-window model (Gemma: one in six sees the whole context) does a
/// fraction of that work: the Qwen3.5-shaped MoE kept its stream's wait within 1.4 s with it,
/// and decoded faster with it. docs/configuration.md.
inline FlashAttnMode resolve_flash_attn(FlashAttnMode mode, const FlashAttnInputs& in) {
    if (mode != FlashAttnMode::automatic) return mode;
    if (in.kv_cache_type != KvCacheType::f16) return FlashAttnMode::on;
    if (in.n_gpu_layers != 0) return FlashAttnMode::automatic;
    if (in.speculative || in.model_file_bytes < kAutoFlashAttnOffMinModelBytes || !in.full_attention_only)
        return FlashAttnMode::on;
    const uint64_t matrix = uint64_t{4} * static_cast<uint64_t>(std::max<int64_t>(0, in.n_head)) * 512 *
                            static_cast<uint64_t>(std::max<int64_t>(0, in.n_ctx_per_seq));
    return matrix <= kAutoFlashAttnOffMaxBytes ? FlashAttnMode::off : FlashAttnMode::on;
}

/// Why a KV cache type and flash-attention setting cannot go together; empty when they can.
inline std::string kv_cache_conflict(KvCacheType t, FlashAttnMode fa) {
    if (t == KvCacheType::f16 || fa != FlashAttnMode::off) return {};
    return std::string("--kv-cache-type ") + kv_cache_type_name(t) +
           " quantizes the V cache, which llama.cpp can only compute with flash attention, and "
           "--flash-attn is off: use --flash-attn auto (or on), or --kv-cache-type f16";
}

}  // namespace trioserve
