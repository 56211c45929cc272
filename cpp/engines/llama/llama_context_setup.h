// llama_context_setup.h — how the llama worker sets up llama.cpp before the engine runs: the
// engine's configuration (LlamaConfig), llama.cpp's log routing (abort noise, weight buffer and
// KV cache size lines), the CPU's extra buffer types, the context parameters (shared with
// trioserve-llama-direct), and the sizing of the per-slot context and the sliding-window cache
// from the KV budget (spec/worker-protocol.md §10, §6.3). Split out of llama_engine.h (which
// includes it) so the engine file holds the Engine contract's implementation only.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "cpu_backend.h"
#include "kv_cache_type.h"
#include "swa_cache.h"
#include "ggml-backend.h"
#include "llama.h"

namespace trioserve {

struct LlamaConfig {
    std::string model_path;
    int64_t n_ctx = 0;           ///< per-slot context, tokens; 0 = the model's training context within kv_budget_bytes
    uint64_t kv_budget_bytes = 0; ///< KV cache memory for all slots when n_ctx is 0; 0 = a quarter of physical memory
    int32_t n_threads = 0;       ///< 0 = number of hardware threads
    int32_t n_gpu_layers = 0;    ///< layers offloaded to a GPU (needs a GPU build); -1 = all
    int64_t capacity = 4;        ///< slots (sequences) on one weight load
    int64_t prefill_chunk = 512; ///< largest prefill chunk of one generation per step
    int64_t batch_tokens = 512;  ///< per-step token budget of the scheduler
    bool verbose = false;        ///< forward llama.cpp INFO logs (and abort noise) to stderr
    /// Let llama.cpp put weights in the CPU's "extra buffer types" (CPU_REPACK, AMX): faster
    /// kernels where they work; false = plain buffers only (llama-server's --no-repack).
    bool use_extra_bufts = true;
    /// Sliding-window models: the window cache full-size, or small + checkpoints (swa_cache.h,
    /// spec §6.3). No effect on models without sliding-window layers.
    SwaCacheMode swa_cache = SwaCacheMode::automatic;
    /// `--deterministic` (spec/worker-protocol.md §4.5): every slot's items of a step are their
    /// own llama_decode, split into micro-batches of exactly `prefill_grid` tokens, so what a
    /// slot computes never depends on the other slots of the step.
    bool deterministic = false;
    int64_t prefill_grid = 64;
    /// --kv-cache-type (kv_cache_type.h): the K and V cache element type; a quantized one
    /// needs flash attention, which `flash_attn` auto turns on for it.
    KvCacheType kv_cache_type = KvCacheType::f16;
    FlashAttnMode flash_attn = FlashAttnMode::automatic;
    /// --speculative auto: flash attention `auto` stays on for it (resolve_flash_attn).
    bool speculative = false;
};

inline ggml_type kv_ggml_type(KvCacheType t) {
    switch (t) {
        case KvCacheType::f16: return GGML_TYPE_F16;
        case KvCacheType::q8_0: return GGML_TYPE_Q8_0;
        case KvCacheType::q4_0: return GGML_TYPE_Q4_0;
    }
    return GGML_TYPE_F16;
}

namespace llama_log {

/// Set by the abort callback when it stops a llama_decode we asked to stop; cleared by step().
/// While set, llama.cpp's abort-related WARN/ERROR lines are verbose-only.
inline std::atomic<bool> abort_fired{false};
/// When non-null (loop thread, around grammar parsing), ERROR text is collected here instead
/// of logged: it becomes the message of the request's invalid_grammar error.
/// Per thread: the input reader thread validates grammars while the loop thread steps.
inline thread_local std::string* capture = nullptr;
inline bool verbose = false;
/// The buffer types llama.cpp reported holding model weights while loading ("CPU_Mapped",
/// "CPU_REPACK", "AMX", "CUDA0"...), in log order: which kernel families the model runs on.
inline std::vector<std::string> weight_buffers;

/// Collects the buffer name of a "load_tensors:   CPU_REPACK model buffer size = 1.0 MiB" line.
inline void note_weight_buffer(const char* text) {
    const char* end = std::strstr(text, " model buffer size");
    const char* start = std::strstr(text, "load_tensors:");
    if (end == nullptr || start == nullptr || start > end) return;
    start += std::strlen("load_tensors:");
    while (start < end && *start == ' ') ++start;
    if (start < end) weight_buffers.emplace_back(start, static_cast<size_t>(end - start));
}

/// Adds the MiB of an allocation line llama.cpp writes ("<prefix>24.00 MiB (...)") to `total`.
template <size_t N>
inline void add_logged_mib(const char* text, const char (&prefix)[N], double& total) {
    if (std::strncmp(text, prefix, N - 1) == 0) total += std::strtod(text + N - 1, nullptr);
}

/// MiB of KV cache llama.cpp reported allocating ("llama_kv_cache: size =   24.00 MiB (...)"
/// lines; an iSWA cache writes one for its full-attention and one for its window layers).
inline double kv_cache_mib = 0;

/// MiB of a recurrent or hybrid model's recurrent state llama.cpp reported allocating
/// ("llama_memory_recurrent: size = 21.98 MiB (...)"): memory every slot holds beside its KV
/// cells, which the memory budget counts (spec §3).
inline double recurrent_state_mib = 0;

inline void note_state_sizes(const char* text) {
    add_logged_mib(text, "llama_kv_cache: size = ", kv_cache_mib);
    add_logged_mib(text, "llama_memory_recurrent: size = ", recurrent_state_mib);
}

/// The lines llama.cpp writes when a llama_decode is aborted (llama-context.cpp): the graph
/// compute failure, the per-sequence memory rollback, and llama_decode's own failure line.
inline bool is_abort_noise(const char* text) {
    return std::strstr(text, "compute_async failed") != nullptr || std::strstr(text, "failed to compute graph") != nullptr ||
           std::strstr(text, "removing memory module entries") != nullptr ||
           std::strstr(text, "failed to decode, ret = 2") != nullptr;
}

}  // namespace llama_log

/// llama.cpp logs go to stderr: WARN and above always, INFO and below only with `verbose`;
/// abort noise of an abort we initiated is treated as INFO.
inline void install_llama_log(bool verbose) {
    llama_log::verbose = verbose;
    llama_log_set(
        [](ggml_log_level level, const char* text, void*) {
            // Per thread: a CONT piece continues the line of the thread that logs it.
            static thread_local ggml_log_level last = GGML_LOG_LEVEL_INFO;
            static thread_local bool quiet = false;  // the line (and its CONT pieces) is verbose-only
            if (level != GGML_LOG_LEVEL_CONT) {
                last = level;
                llama_log::note_weight_buffer(text);
                llama_log::note_state_sizes(text);
                quiet = last >= GGML_LOG_LEVEL_WARN && llama_log::abort_fired.load(std::memory_order_acquire) &&
                        llama_log::is_abort_noise(text);
            }
            if (llama_log::capture != nullptr && last >= GGML_LOG_LEVEL_ERROR) {
                llama_log::capture->append(text);
                return;
            }
            if (llama_log::verbose || (last >= GGML_LOG_LEVEL_WARN && !quiet)) std::fputs(text, stderr);
        },
        nullptr);
}

/// The extra buffer types the CPU device offers (e.g. "CPU_REPACK", "AMX"): where llama.cpp
/// would put weights when llama_model_params.use_extra_bufts is true (the default). Empty when
/// the CPU backend offers none. Loads the backend registry (llama_backend_init is not needed).
inline std::vector<std::string> cpu_extra_buffer_types() {
    std::vector<std::string> names;
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr) return names;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu);
    auto get = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
    if (get == nullptr) return names;
    for (ggml_backend_buffer_type_t* b = get(cpu); b != nullptr && *b != nullptr; ++b)
        names.emplace_back(ggml_backend_buft_name(*b));
    return names;
}

inline int32_t default_threads(int32_t n) {
    if (n > 0) return n;
    unsigned hc = std::thread::hardware_concurrency();
    return hc > 0 ? static_cast<int32_t>(hc) : 4;
}

/// Tokens one llama_decode of the worker may carry: the step budget (or a bigger prefill chunk)
/// plus one decode token per slot (scheduler.h max_step_tokens()).
inline int64_t batch_capacity(const LlamaConfig& c) {
    return std::max<int64_t>(std::max<int64_t>(c.batch_tokens, c.prefill_chunk), 1) + c.capacity;
}

/// Whether the context runs without flash attention for sure: `--flash-attn off` (given, or
/// resolve_flash_attn()'s choice for auto) with an f16 cache (make_context_params). Otherwise
/// it is on, or llama.cpp's auto, which turns it on wherever the device computes it.
inline bool flash_attn_off(const LlamaConfig& c) {
    return c.flash_attn == FlashAttnMode::off && c.kv_cache_type == KvCacheType::f16;
}

/// resolve_flash_attn (kv_cache_type.h) for this configuration and model.
inline FlashAttnMode resolve_flash_attn(const LlamaConfig& c, const llama_model* m, int64_t n_ctx_per_seq) {
    struct stat st {};
    const uint64_t file_bytes = ::stat(c.model_path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    const bool full_attention_only =
        !llama_model_is_hybrid(m) && !llama_model_is_recurrent(m) && llama_model_n_swa(m) == 0;
    return resolve_flash_attn(c.flash_attn, {c.kv_cache_type, c.n_gpu_layers, c.speculative, file_bytes,
                                             full_attention_only, llama_model_n_head(m), n_ctx_per_seq});
}

/// Host bytes of the attention matrix llama.cpp reserves without flash attention: one
/// micro-batch's queries against a sequence's whole context, every query head, f32 (the
/// softmax runs in place). Every prompt chunk deep into a long context writes it, so unlike
/// the rest of the compute buffer (mostly logit rows for a whole micro-batch, which a step
/// never writes) the memory budget counts it (spec §3): dense 1.5B, 2 x 20,480 cells, 640 MiB
/// of the 702 MiB llama.cpp reserves, against 104 MiB with flash attention. 0 with flash
/// attention (which works through the cache in tiles) and with layers on a GPU.
inline uint64_t attention_matrix_bytes(const LlamaConfig& c, const llama_model* m, uint32_t n_ubatch,
                                       int64_t n_ctx_per_seq) {
    if (!flash_attn_off(c) || c.n_gpu_layers != 0) return 0;
    return uint64_t{4} * static_cast<uint64_t>(std::max(0, llama_model_n_head(m))) * n_ubatch *
           static_cast<uint64_t>(std::max<int64_t>(0, n_ctx_per_seq));
}

/// The context parameters the worker uses; trioserve-llama-direct uses the same ones so the
/// benchmark compares like with like.
inline llama_context_params make_context_params(const LlamaConfig& c, int64_t n_ctx_per_seq, bool swa_full = true) {
    llama_context_params p = llama_context_default_params();
    // Sliding-window layers: the full-size cache (llama.cpp's default) or only the last window
    // plus a batch of cells (resolve_swa_full()). Models without them ignore it.
    p.swa_full = swa_full;
    const int64_t n_batch = batch_capacity(c);
    p.n_seq_max = static_cast<uint32_t>(c.capacity);
    p.n_ctx = static_cast<uint32_t>(n_ctx_per_seq * c.capacity);
    p.kv_unified = false;  // each sequence its own n_ctx cells: slots cannot starve each other
    p.n_batch = static_cast<uint32_t>(n_batch);
    p.n_ubatch = static_cast<uint32_t>(std::min<int64_t>(n_batch, 512));
    // Deterministic: llama.cpp cuts one sequence's tokens into micro-batches of n_ubatch from
    // the first one; the worker starts every prefill on the grid, so the pieces are the grid's.
    if (c.deterministic) p.n_ubatch = static_cast<uint32_t>(std::min<int64_t>(n_batch, c.prefill_grid));
    p.n_threads = default_threads(c.n_threads);
    p.n_threads_batch = p.n_threads;
    p.no_perf = true;
    p.type_k = p.type_v = kv_ggml_type(c.kv_cache_type);
    // A quantized V cache is computed only by flash attention: "auto" means on for it (llama.cpp's
    // own auto may pick off on a device and then refuse the context). The engine resolves "auto"
    // for an f16 cache first (resolve_flash_attn); what is still "auto" (layers on a GPU) is
    // llama.cpp's choice. "off" with a quantized type never gets here (kv_cache_conflict()).
    if (c.flash_attn == FlashAttnMode::on || c.kv_cache_type != KvCacheType::f16)
        p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    else if (flash_attn_off(c))
        p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    return p;
}

/// KV cache bytes per token per sequence at f16 (K and V of every attention layer). An
/// estimate from the model's shape: in a hybrid of the Qwen3.5 family only every
/// `full_attention_interval`-th layer attends (the others hold a fixed-size recurrent state,
/// not KV cells), as worker/model_cost.py counts them; per-layer head counts are not modelled.
/// The bytes at the configured --kv-cache-type: kv_bytes_as(type, this).
inline uint64_t kv_bytes_per_token(const llama_model* model) {
    const int64_t n_head = std::max<int32_t>(1, llama_model_n_head(model));
    const int64_t n_head_kv = std::max<int32_t>(1, llama_model_n_head_kv(model));
    // The head size: the GGUF's attention.key_length / value_length when given (Gemma's 256 is
    // not n_embd / n_head), else n_embd / n_head.
    char arch[64] = {0};
    llama_model_meta_val_str(model, "general.architecture", arch, sizeof arch);
    auto meta_int = [&](const char* suffix, int64_t fallback) {
        char buf[32] = {0};
        const std::string key = std::string(arch) + suffix;
        if (arch[0] == '\0' || llama_model_meta_val_str(model, key.c_str(), buf, sizeof buf) < 0) return fallback;
        const long long v = std::strtoll(buf, nullptr, 10);
        return v > 0 ? static_cast<int64_t>(v) : fallback;
    };
    const int64_t plain = llama_model_n_embd(model) / n_head;
    const int64_t k_dim = meta_int(".attention.key_length", plain), v_dim = meta_int(".attention.value_length", plain);
    const int64_t n_layer = llama_model_n_layer(model), interval = meta_int(".full_attention_interval", 0);
    const int64_t n_kv_layer = interval > 0 ? n_layer / interval : n_layer;
    return static_cast<uint64_t>(2 /*f16*/ * n_kv_layer * n_head_kv * (k_dim + v_dim));
}

/// The KV budget when none is given: a quarter of physical memory (the weights, the spill
/// store and the host need the rest).
inline uint64_t default_kv_budget() {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return uint64_t(4) << 30;
    return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 4;
}

/// The per-slot context: --ctx when given (capped at the training context), else the
/// training context, lowered (to a multiple of 256, at least 256) until capacity x n_ctx KV
/// cells fit the budget. Logs the choice and its memory on stderr (startup report).
inline int64_t resolve_n_ctx(const LlamaConfig& c, const llama_model* model) {
    const int64_t train = llama_model_n_ctx_train(model);
    const uint64_t per_token = kv_bytes_as(c.kv_cache_type, kv_bytes_per_token(model));
    const uint64_t budget = c.kv_budget_bytes > 0 ? c.kv_budget_bytes : default_kv_budget();
    int64_t n = c.n_ctx > 0 ? c.n_ctx : train;
    if (c.n_ctx <= 0 && per_token > 0 && c.capacity > 0) {
        const uint64_t fit = budget / (per_token * static_cast<uint64_t>(c.capacity));
        if (fit < static_cast<uint64_t>(n)) {
            n = std::max<int64_t>(256, static_cast<int64_t>(fit / 256 * 256));
            std::fprintf(stderr, "trioserve-llama-worker: the training context %lld does not fit the KV budget "
                         "(%.0f MiB for %lld slots); using %lld tokens per slot\n", static_cast<long long>(train),
                         static_cast<double>(budget) / (1 << 20), static_cast<long long>(c.capacity),
                         static_cast<long long>(n));
        }
    }
    if (train > 0 && n > train) {
        std::fprintf(stderr, "trioserve-llama-worker: --ctx %lld exceeds the model's training context %lld; using %lld\n",
                     static_cast<long long>(n), static_cast<long long>(train), static_cast<long long>(train));
        n = train;
    }
    const int64_t n_swa = llama_model_n_swa(model);
    std::fprintf(stderr, "trioserve-llama-worker: context %lld tokens per slot x %lld slots (training context %lld); "
                 "KV cache ~%.0f MiB at %s (budget %.0f MiB)%s\n", static_cast<long long>(n),
                 static_cast<long long>(c.capacity), static_cast<long long>(train),
                 static_cast<double>(per_token * static_cast<uint64_t>(n * c.capacity)) / (1 << 20),
                 kv_cache_type_name(c.kv_cache_type),
                 static_cast<double>(budget) / (1 << 20),
                 n_swa > 0 ? "; the model has sliding-window layers (see the next line)" : "");
    return n;
}

/// Whether a sliding-window model keeps the full-size window cache (swa_cache.h): `full`,
/// `checkpoints`, or `auto` = full when capacity x the wanted context (the training context,
/// or --ctx) of every layer at full size fits the KV budget. Logs the choice and what the
/// full-size cache costs. True for models without sliding-window layers (no effect). With the
/// small cache the per-slot context is still sized as if every layer were full-size (llama.cpp
/// does not say how many layers slide), so the KV memory stays under the budget.
inline bool resolve_swa_full(const LlamaConfig& c, const llama_model* model) {
    const int64_t n_swa = llama_model_n_swa(model);
    if (n_swa <= 0) return true;
    const int64_t train = llama_model_n_ctx_train(model);
    int64_t want = c.n_ctx > 0 ? c.n_ctx : train;
    if (train > 0) want = std::min(want, train);
    const uint64_t full = kv_bytes_as(c.kv_cache_type, kv_bytes_per_token(model)) *
                          static_cast<uint64_t>(std::max<int64_t>(want, 0) * c.capacity);
    const uint64_t budget = c.kv_budget_bytes > 0 ? c.kv_budget_bytes : default_kv_budget();
    const bool keep = keep_full_swa_cache(c.swa_cache, full, budget);
    const char* why = c.swa_cache == SwaCacheMode::full          ? "--swa-cache full"
                      : c.swa_cache == SwaCacheMode::checkpoints ? "--swa-cache checkpoints"
                      : keep                                      ? "auto: it fits the KV budget"
                                                                  : "auto: it exceeds the KV budget";
    std::fprintf(stderr, "trioserve-llama-worker: sliding-window layers (window %lld tokens): %s (%s; the full-size "
                 "cache of %lld tokens x %lld slots needs ~%.0f MiB at %s for all layers, budget %.0f MiB)\n",
                 static_cast<long long>(n_swa),
                 keep ? "full-size window cache, every position reachable"
                      : "small window cache (the last window + a batch of cells) with checkpoints at turn boundaries",
                 why, static_cast<long long>(want), static_cast<long long>(c.capacity),
                 static_cast<double>(full) / (1 << 20), kv_cache_type_name(c.kv_cache_type),
                 static_cast<double>(budget) / (1 << 20));
    return keep;
}

}  // namespace trioserve
