// executorch_engine.h — the Engine contract (engine.h) over an ExecuTorch `.pte` LLM program.
//
// What program: one exported by ExecuTorch's `export_llama` with a KV cache (`-kv`), i.e. a
// `forward(tokens: int64[1, S], input_pos: int64[1]) -> logits` method whose KV cache lives in
// the program's mutable buffers, plus the constant methods the exporter writes
// (`get_max_context_len`, `get_max_seq_len`, `get_vocab_size`, `use_kv_cache`,
// `enable_dynamic_shape`, `get_bos_id`, `get_eos_ids`). It runs through the ExecuTorch
// `Module` API of the `executorch` wheel's C++ runtime (no libtorch, no libpython).
//
// Slots on one weight load: the program is loaded once (Mmap) and backs `capacity` Modules
// (`Module(program)`), each with its own `forward` Method and its own planned-memory arenas,
// which this engine allocates from `method_meta` sizes. The KV cache is a mutable buffer, and
// mutable buffers live in planned memory, so every instance has its own cache; constant
// weights stay in the mapped file, shared. What an extra instance costs beyond its arenas
// (the XNNPACK delegate packs its weights per instance unless its weight cache is on) is
// measured at startup (resident bytes before and after loading and running it), reported in
// the ready record, and the slot count is capped to what fits the memory budget.
//
// A slot's position is a counter: the cache rows at positions >= it are stale but never read
// (the program masks attention causally by `input_pos` and overwrites a row before reading
// it), so truncate() and reset() only move the counter, and a step that is aborted part way
// rolls back by restoring it. That is what makes warm append-only resume free.
//
// step() runs one `forward` per item (the program's batch size is 1), each in chunks of at
// most `max_seq_len` tokens (1 for a static-shape program), and checks the abort flag before
// every chunk, so a cancel interrupts a long prefill within one chunk; an aborted step restores
// every item's position. Logits of each item's last chunk are copied out per slot (the output
// buffer is reused by the next execute) for sample().
//
// State (save/load/copy, spec §6): programs exported with `--use_sdpa_with_kv_cache` write
// their caches through trioserve's `llama::update_cache` kernel, which reports each cache's
// address and shape during one warm-up call per instance (llama_custom_ops.h: cache_log), so
// a slot's state is the first `position` rows of each K/V buffer. Other programs (plain
// attention: the caches are unnamed mutable buffers written by index_put) have their whole
// planned arenas saved instead (every mutable buffer is in them; activations are scratch).
// Either way the bytes carry the program's hash and the buffer shapes, and load_state()
// refuses (unsupported, slot unchanged) a state of another program or layout.
//
// Tokenization: none here (tokenize() reports `unsupported`): the control plane encodes text
// with the Hugging Face `tokenizers` library and sends ids. Decoding uses the tokenizer's
// vocabulary (hf_vocab.h). EOS: the program's `get_eos_ids`, plus the tokenizer config's
// eos_token.
//
// Threading: as engine.h. request_abort() only stores an atomic.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/backend/backend_options_map.h>
#include <executorch/runtime/backend/options.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/platform/runtime.h>

#include "engine.h"
#include "hf_vocab.h"
#include "engines/executorch/llama_custom_ops.h"

// The wheel ships the thread pool library but not its header; this is the one call we need
// (sizing the pool to --threads), declared as the library defines it.
namespace executorch::extension::threadpool {
class ThreadPool {
public:
    bool _unsafe_reset_threadpool(uint32_t num_threads);
    size_t get_thread_count() const;
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace trioserve {

struct ExecuTorchConfig {
    std::string model_path;      ///< the .pte program
    std::string tokenizer_path;  ///< Hugging Face tokenizer.json (decoding, special tokens)
    int64_t n_ctx = 0;           ///< context window; 0 or more than the program's = the program's
    int32_t n_threads = 0;       ///< ExecuTorch thread pool size; 0 = leave the runtime's default
    int64_t capacity = 4;        ///< slots requested (capped to what fits memory_budget_bytes)
    /// Memory the extra slots may take together (bytes); 0 = half of what is available at
    /// startup (MemAvailable, or a cgroup limit's remainder when smaller).
    uint64_t memory_budget_bytes = 0;
    /// XNNPACK's weight cache (backend option `weight_cache_enabled`): packed weights shared by
    /// every instance instead of packed once per instance.
    bool xnnpack_weight_cache = true;
    double test_step_delay_ms = 0;  ///< tests only: abortable sleep before every forward call
};

/// One generation's sampling state: its parameters and its own RNG.
class ExecuTorchSampler : public Sampler {
public:
    explicit ExecuTorchSampler(const SamplingParams& p) : params(p), rng(p.seed) {}
    SamplingParams params;
    std::mt19937 rng;
};

/// What loading the slots cost (ready record, `executorch` object; docs/executorch.md).
struct ExecuTorchSlotReport {
    int64_t requested = 1;             ///< --capacity
    int64_t capacity = 1;              ///< slots loaded
    uint64_t planned_bytes_per_slot = 0;   ///< the forward method's planned arenas (KV cache + activations)
    uint64_t first_slot_bytes = 0;     ///< resident growth of loading + warming the first instance
    uint64_t bytes_per_extra_slot = 0; ///< measured resident growth per further instance (mean)
    uint64_t program_bytes = 0;        ///< the .pte file's size
    uint64_t memory_budget_bytes = 0;  ///< what the extra slots could take
    bool weights_duplicated = false;   ///< an extra slot costs about the program's size
    std::string capped_reason;         ///< why capacity < requested (empty: not capped)
    std::string state_layout;          ///< "kv_rows" (learned caches) or "arenas"
    uint64_t program_hash = 0;
};

namespace et_detail {

/// The process's resident set size in bytes (/proc/self/statm), 0 when unreadable.
inline uint64_t resident_bytes() {
    FILE* f = std::fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long long size = 0, resident = 0;
    const int n = std::fscanf(f, "%llu %llu", &size, &resident);
    std::fclose(f);
    return n == 2 ? static_cast<uint64_t>(resident) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

/// Memory this process can still take, bytes: MemAvailable from /proc/meminfo, less when a
/// cgroup v2 limit (memory.max − memory.current, a container's `--memory`) leaves less; 0 when
/// unknown.
inline uint64_t mem_available_bytes() {
    uint64_t avail = 0;
    {
        std::ifstream in("/proc/meminfo");
        std::string key, unit;
        unsigned long long kb = 0;
        while (in >> key >> kb >> unit)
            if (key == "MemAvailable:") { avail = static_cast<uint64_t>(kb) * 1024; break; }
    }
    std::ifstream max_in("/sys/fs/cgroup/memory.max"), cur_in("/sys/fs/cgroup/memory.current");
    unsigned long long max = 0, cur = 0;
    if (max_in >> max && cur_in >> cur && max > cur) {  // "max" (no limit) does not parse
        const uint64_t left = static_cast<uint64_t>(max - cur);
        if (avail == 0 || left < avail) avail = left;
    }
    return avail;
}

/// FNV-1a (64-bit) of a file's bytes, with its size; {0, 0} when unreadable. Identifies the
/// program a saved state belongs to.
inline std::pair<uint64_t, uint64_t> file_hash(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return {0, 0};
    uint64_t h = 1469598103934665603ULL, size = 0;
    std::vector<char> buf(1 << 20);
    while (in) {
        in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
        const std::streamsize got = in.gcount();
        for (std::streamsize i = 0; i < got; ++i) {
            h ^= static_cast<uint8_t>(buf[static_cast<size_t>(i)]);
            h *= 1099511628211ULL;
        }
        size += static_cast<uint64_t>(got);
    }
    return {h, size};
}

inline void put_u64(std::vector<uint8_t>& out, uint64_t v) {
    for (int b = 0; b < 8; ++b) out.push_back(static_cast<uint8_t>(v >> (8 * b)));
}

inline bool get_u64(const std::vector<uint8_t>& in, size_t& at, uint64_t& v) {
    if (in.size() < at + 8) return false;
    v = 0;
    for (int b = 0; b < 8; ++b) v |= static_cast<uint64_t>(in[at + static_cast<size_t>(b)]) << (8 * b);
    at += 8;
    return true;
}

}  // namespace et_detail

class ExecuTorchEngine : public Engine {
public:
    /// Loads the program once and `cfg.capacity` instances of its forward method over it (fewer
    /// when the memory budget caps them: see report()). On failure `error()` is non-empty.
    explicit ExecuTorchEngine(const ExecuTorchConfig& cfg) : cfg_(cfg) {
        executorch::runtime::runtime_init();
        // Programs exported with --use_sdpa_with_kv_cache call these (llama_custom_ops.h).
        if (!llama_ops::register_llama_custom_ops())
            std::fprintf(stderr, "trioserve-executorch-worker: the llama:: kernels were not registered\n");
        if (!vocab_.load(cfg.tokenizer_path, error_)) return;
        // Before anything loads: the XNNPACK delegate keeps the pool it finds when the method
        // is initialized, and a reset afterwards leaves it a destroyed pool (a hang, measured).
        if (cfg.n_threads > 0) {
            if (auto* pool = executorch::extension::threadpool::get_threadpool())
                pool->_unsafe_reset_threadpool(static_cast<uint32_t>(cfg.n_threads));
        }
        const auto [hash, size] = et_detail::file_hash(cfg.model_path);
        report_.program_hash = hash;
        report_.program_bytes = size;
        report_.requested = std::max<int64_t>(1, cfg.capacity);
        xnn_options_.set_option("weight_cache_enabled", cfg.xnnpack_weight_cache);
        backend_options_.set_options("XnnpackBackend", xnn_options_.view());
        auto first = std::make_unique<executorch::extension::Module>(cfg.model_path,
                                                                     executorch::extension::Module::LoadMode::Mmap);
        if (first->load() != executorch::runtime::Error::Ok) {
            error_ = "failed to load the ExecuTorch program " + cfg.model_path;
            return;
        }
        // Metadata through the first Module: its constant methods load into that Module only.
        module0_ = first.get();
        if (!read_metadata()) return;
        load_slots(std::move(first));
        if (!error_.empty()) return;
        fill_info();
    }

    ~ExecuTorchEngine() override {
        // The first Module owns the program's data loader: the other instances go first.
        while (slots_.size() > 1) slots_.pop_back();
    }

    const std::string& error() const { return error_; }
    const EngineInfo& info() const override { return info_; }
    const ExecuTorchSlotReport& report() const { return report_; }

    int64_t position(int32_t slot) const override { return slots_[idx(slot)].pos; }

    Status reset(int32_t slot) override {
        Instance& s = slots_[idx(slot)];
        s.pos = 0;
        s.has_logits = false;
        return Status::ok;
    }

    /// Moves the position back: rows at or after it are never read again (see the header).
    Status truncate(int32_t slot, int64_t pos) override {
        Instance& s = slots_[idx(slot)];
        if (pos < 0 || pos > s.pos) return Status::engine_error;
        s.pos = pos;
        s.has_logits = false;
        return Status::ok;
    }

    /// The state fingerprint (state_store.h, spec §6.4): the program's hash (the .pte's
    /// bytes), its state layout and the context; load_state() checks hash and shapes again.
    std::string state_fingerprint() const override {
        return "executorch|program=" + std::to_string(report_.program_hash) + "|layout=" + report_.state_layout +
               "|n_ctx=" + std::to_string(info_.n_ctx);
    }

    /// The header, then per buffer the first `position` rows (kv_rows) or the whole arena.
    Status save_state(int32_t slot, std::vector<uint8_t>& out) override {
        const Instance& s = slots_[idx(slot)];
        out.clear();
        write_header(s, out);
        for (const Region& r : s.regions) {
            const size_t n = region_bytes(r, s.pos);
            out.insert(out.end(), r.data, r.data + n);
        }
        return Status::ok;
    }

    /// Refuses (unsupported, slot unchanged) bytes of another program, layout or shape, or cut
    /// short; otherwise the slot holds the saved tokens.
    Status load_state(int32_t slot, const std::vector<uint8_t>& in) override {
        Instance& s = slots_[idx(slot)];
        int64_t pos = 0;
        size_t at = 0;
        if (!check_header(s, in, at, pos)) return Status::unsupported;
        size_t need = at;
        for (const Region& r : s.regions) need += region_bytes(r, pos);
        if (in.size() != need) {
            std::fprintf(stderr, "trioserve-executorch-worker: a saved state of %zu bytes where %zu were expected; refused\n",
                         in.size(), need);
            return Status::unsupported;
        }
        for (const Region& r : s.regions) {
            const size_t n = region_bytes(r, pos);
            std::memcpy(r.data, in.data() + at, n);
            at += n;
        }
        s.pos = pos;
        s.has_logits = false;
        return Status::ok;
    }

    /// Row copies between the two instances' buffers (no host round trip).
    Status copy_state(int32_t src, int32_t dst, std::vector<uint8_t>&) override {
        const Instance& a = slots_[idx(src)];
        Instance& b = slots_[idx(dst)];
        if (src == dst) return Status::ok;
        if (a.regions.size() != b.regions.size()) return Status::unsupported;
        for (size_t i = 0; i < a.regions.size(); ++i) {
            if (a.regions[i].rows != b.regions[i].rows || a.regions[i].row_bytes != b.regions[i].row_bytes)
                return Status::unsupported;
        }
        for (size_t i = 0; i < a.regions.size(); ++i)
            std::memcpy(b.regions[i].data, a.regions[i].data, region_bytes(a.regions[i], a.pos));
        b.pos = a.pos;
        b.has_logits = false;
        return Status::ok;
    }

    Status step(const StepItem* items, size_t n) override {
        if (n == 0) return Status::engine_error;
        // Validate every item first: nothing is appended unless all can be.
        for (size_t i = 0; i < n; ++i) {
            const StepItem& it = items[i];
            if (it.slot < 0 || it.slot >= static_cast<int32_t>(slots_.size()) || it.n == 0) return Status::engine_error;
            for (size_t j = 0; j < i; ++j)
                if (items[j].slot == it.slot) return Status::engine_error;
            if (slots_[idx(it.slot)].pos + static_cast<int64_t>(it.n) > info_.n_ctx) return Status::context_full;
            for (size_t k = 0; k < it.n; ++k)
                if (it.tokens[k] < 0 || it.tokens[k] >= info_.n_vocab) return Status::invalid_token;
        }
        start_pos_.resize(n);
        for (size_t i = 0; i < n; ++i) {
            Instance& s = slots_[idx(items[i].slot)];
            start_pos_[i] = s.pos;
            s.has_logits = false;
        }
        for (size_t i = 0; i < n; ++i) {
            const StepItem& it = items[i];
            Instance& s = slots_[idx(it.slot)];
            size_t done = 0;
            while (done < it.n) {
                // Before every chunk: an abort leaves nothing appended in any slot of the step
                // (positions restored; rows written beyond them are never read).
                if (abort_.load(std::memory_order_acquire) || !test_delay()) {
                    for (size_t j = 0; j < n; ++j) {
                        slots_[idx(items[j].slot)].pos = start_pos_[j];
                        slots_[idx(items[j].slot)].has_logits = false;
                    }
                    return Status::aborted;
                }
                const size_t c = std::min(it.n - done, chunk_);
                ids_.assign(it.tokens + done, it.tokens + done + c);
                auto out = forward(s, ids_.data(), c, s.pos);
                if (!out.ok() || out->empty() || !(*out)[0].isTensor()) {
                    std::fprintf(stderr, "trioserve-executorch-worker: forward failed in slot %d (error 0x%x)\n",
                                 it.slot, out.ok() ? 0u : static_cast<unsigned>(out.error()));
                    s.pos = start_pos_[i];  // earlier items stay appended: position() says so
                    return Status::engine_error;
                }
                s.pos += static_cast<int64_t>(c);
                done += c;
                if (done == it.n && it.logits && !copy_logits(s, (*out)[0].toTensor())) {
                    s.pos = start_pos_[i];
                    return Status::engine_error;
                }
            }
        }
        return Status::ok;
    }

    std::unique_ptr<Sampler> new_sampler(const SamplingParams& p, const std::string& grammar, std::string& error) override {
        if (!grammar.empty()) {  // the loop rejects grammars first (supports_grammar: false)
            error = "the ExecuTorch engine has no grammar support";
            return nullptr;
        }
        return std::make_unique<ExecuTorchSampler>(p);
    }

    /// A logit bias first (SamplingParams::logit_bias, on a copy of the row: the slot's row
    /// stays the model's). Greedy: the first index of the largest logit (what argmax gives in
    /// ExecuTorch's Python runtime). Otherwise top-k, then top-p over the temperature-scaled
    /// softmax, then a draw from the generation's own RNG.
    Status sample(int32_t slot, Sampler& sampler, TokenId* out) override {
        if (slot < 0 || slot >= static_cast<int32_t>(slots_.size()) || !slots_[idx(slot)].has_logits)
            return Status::engine_error;
        auto& s = static_cast<ExecuTorchSampler&>(sampler);
        const std::vector<float>* row = &slots_[idx(slot)].logits;
        if (!s.params.logit_bias.empty()) {
            biased_ = *row;
            for (const auto& [id, bias] : s.params.logit_bias)  // ids checked < n_vocab at admission
                if (static_cast<size_t>(id) < biased_.size()) biased_[static_cast<size_t>(id)] += bias;
            row = &biased_;
        }
        const std::vector<float>& logits_ = *row;
        const size_t nv = logits_.size();
        if (s.params.temperature <= 0.0f) {
            *out = static_cast<TokenId>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
            return Status::ok;
        }
        order_.resize(nv);
        for (size_t i = 0; i < nv; ++i) order_[i] = static_cast<int32_t>(i);
        size_t keep = nv;
        if (s.params.top_k > 0 && static_cast<size_t>(s.params.top_k) < nv) keep = static_cast<size_t>(s.params.top_k);
        auto by_logit = [&logits_](int32_t a, int32_t b) {
            return logits_[static_cast<size_t>(a)] > logits_[static_cast<size_t>(b)] ||
                   (logits_[static_cast<size_t>(a)] == logits_[static_cast<size_t>(b)] && a < b);
        };
        std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(keep), order_.end(), by_logit);
        order_.resize(keep);
        probs_.resize(keep);
        const float top = logits_[static_cast<size_t>(order_[0])];
        double sum = 0;
        for (size_t i = 0; i < keep; ++i) {
            probs_[i] = std::exp((logits_[static_cast<size_t>(order_[i])] - top) / s.params.temperature);
            sum += probs_[i];
        }
        if (s.params.top_p < 1.0f) {
            double acc = 0;
            size_t cut = keep;
            for (size_t i = 0; i < keep; ++i) {
                acc += probs_[i] / sum;
                if (acc >= s.params.top_p) { cut = i + 1; break; }
            }
            keep = cut;
            sum = 0;
            for (size_t i = 0; i < keep; ++i) sum += probs_[i];
        }
        std::uniform_real_distribution<double> u(0.0, sum);
        double r = u(s.rng);
        for (size_t i = 0; i < keep; ++i) {
            r -= probs_[i];
            if (r <= 0) { *out = order_[i]; return Status::ok; }
        }
        *out = order_[keep - 1];
        return Status::ok;
    }

    void request_abort() override { abort_.store(true, std::memory_order_release); }
    void clear_abort() override { abort_.store(false, std::memory_order_release); }

    /// Text is tokenized by the control plane (see the header): a text segment reaching the
    /// worker is a configuration error, reported as a failed tokenization.
    Status tokenize(const std::string& text, bool, std::vector<TokenId>&) const override {
        return text.empty() ? Status::ok : Status::unsupported;
    }

    void token_bytes(TokenId id, std::string& out) const override { vocab_.append_bytes(id, out); }

    bool is_end_of_generation(TokenId id) const override { return eos_ids_.count(id) != 0; }

private:
    /// One buffer of a slot's state: a K or V cache of `rows` positions (kv_rows layout), or a
    /// whole planned arena (`rows` 1, `row_bytes` its size: arenas layout).
    struct Region {
        uint8_t* data = nullptr;
        int64_t rows = 0;
        size_t row_bytes = 0;
    };

    /// One slot: a Module over the shared program with its own forward Method and arenas.
    struct Instance {
        std::unique_ptr<executorch::extension::Module> module;
        std::vector<std::vector<uint8_t>> arenas;  ///< planned memory (KV cache + activations)
        std::vector<executorch::runtime::Span<uint8_t>> spans;
        std::unique_ptr<executorch::runtime::HierarchicalAllocator> planned;
        std::vector<Region> regions;  ///< what save_state() copies
        int64_t pos = 0;
        bool has_logits = false;
        std::vector<float> logits;
    };

    static constexpr uint64_t kStateMagic = 0x31585354'45545254ULL;  // "TRTETSX1"
    static constexpr uint64_t kLayoutKvRows = 1, kLayoutArenas = 2;

    static size_t idx(int32_t slot) { return static_cast<size_t>(slot); }

    size_t region_bytes(const Region& r, int64_t pos) const {
        return kv_rows_ ? static_cast<size_t>(pos) * r.row_bytes : r.row_bytes;
    }

    void write_header(const Instance& s, std::vector<uint8_t>& out) const {
        using et_detail::put_u64;
        put_u64(out, kStateMagic);
        put_u64(out, report_.program_hash);
        put_u64(out, kv_rows_ ? kLayoutKvRows : kLayoutArenas);
        put_u64(out, s.regions.size());
        for (const Region& r : s.regions) {
            put_u64(out, static_cast<uint64_t>(r.rows));
            put_u64(out, r.row_bytes);
        }
        put_u64(out, static_cast<uint64_t>(s.pos));
    }

    /// Whether `in` starts with a header this slot can take (same program, layout, shapes).
    bool check_header(const Instance& s, const std::vector<uint8_t>& in, size_t& at, int64_t& pos) const {
        uint64_t magic = 0, hash = 0, layout = 0, n = 0, p = 0;
        auto refuse = [](const char* why) {
            std::fprintf(stderr, "trioserve-executorch-worker: a saved state was refused: %s\n", why);
            return false;
        };
        if (!et_detail::get_u64(in, at, magic) || magic != kStateMagic) return refuse("not an ExecuTorch engine state");
        if (!et_detail::get_u64(in, at, hash) || hash != report_.program_hash) return refuse("saved from another program");
        if (!et_detail::get_u64(in, at, layout) || layout != (kv_rows_ ? kLayoutKvRows : kLayoutArenas))
            return refuse("another state layout");
        if (!et_detail::get_u64(in, at, n) || n != s.regions.size()) return refuse("another number of buffers");
        for (const Region& r : s.regions) {
            uint64_t rows = 0, row_bytes = 0;
            if (!et_detail::get_u64(in, at, rows) || !et_detail::get_u64(in, at, row_bytes) ||
                rows != static_cast<uint64_t>(r.rows) || row_bytes != r.row_bytes)
                return refuse("another buffer shape");
        }
        if (!et_detail::get_u64(in, at, p) || p > static_cast<uint64_t>(info_.n_ctx)) return refuse("a bad position");
        pos = static_cast<int64_t>(p);
        return true;
    }

    executorch::runtime::Result<std::vector<executorch::runtime::EValue>> forward(Instance& s, int64_t* ids, size_t c,
                                                                                int64_t start) {
        auto tokens = executorch::extension::from_blob(ids, {1, static_cast<int32_t>(c)},
                                                      executorch::aten::ScalarType::Long);
        auto input_pos = executorch::extension::from_blob(&start, {1}, executorch::aten::ScalarType::Long);
        return s.module->forward({executorch::runtime::EValue(*tokens), executorch::runtime::EValue(*input_pos)});
    }

    /// Loads instance after instance over the first Module's program, measuring each one's
    /// resident cost (load + one warm-up token, which also learns its KV buffers), and stops
    /// at report_.requested or where the next one would not fit the memory budget.
    void load_slots(std::unique_ptr<executorch::extension::Module> first) {
        using executorch::runtime::Error;
        auto meta = module0_->method_meta("forward");
        if (!meta.ok()) {
            error_ = "the program's forward method has no metadata";
            return;
        }
        std::vector<size_t> sizes;
        for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
            auto sz = meta->memory_planned_buffer_size(i);
            sizes.push_back(sz.ok() ? static_cast<size_t>(*sz) : 0);
            report_.planned_bytes_per_slot += sizes.back();
        }
        const uint64_t avail = et_detail::mem_available_bytes();
        report_.memory_budget_bytes = cfg_.memory_budget_bytes > 0 ? cfg_.memory_budget_bytes : avail / 2;
        slots_.reserve(static_cast<size_t>(report_.requested));
        uint64_t extra_total = 0;
        for (int64_t i = 0; i < report_.requested; ++i) {
            const uint64_t before = et_detail::resident_bytes();
            Instance inst;
            inst.module = i == 0 ? std::move(first) : std::make_unique<executorch::extension::Module>(module0_->program());
            for (size_t b = 0; b < sizes.size(); ++b) inst.arenas.emplace_back(sizes[b]);  // zeroed: resident now
            for (auto& a : inst.arenas) inst.spans.emplace_back(a.data(), a.size());
            inst.planned = std::make_unique<executorch::runtime::HierarchicalAllocator>(
                executorch::runtime::Span<executorch::runtime::Span<uint8_t>>(inst.spans.data(), inst.spans.size()));
            std::string why;
            if (inst.module->load_method("forward", inst.planned.get(), nullptr, &backend_options_) != Error::Ok) {
                why = "the program's forward method does not load (a missing kernel or backend? see the log above)";
            } else {
                // The warm-up token: its row is beyond position 0, so it is never read.
                std::vector<llama_ops::CacheBuffer> log;
                llama_ops::cache_log() = &log;
                int64_t tok = bos_id_ >= 0 && bos_id_ < vocab_size_ ? bos_id_ : 0;
                auto out = forward(inst, &tok, 1, 0);
                llama_ops::cache_log() = nullptr;
                if (!out.ok() || out->empty() || !(*out)[0].isTensor())
                    why = "the warm-up forward call failed";
                else
                    why = learn_regions(inst, log, i);
            }
            if (!why.empty()) {
                if (i == 0) {
                    error_ = why;
                    return;
                }
                std::fprintf(stderr, "trioserve-executorch-worker: slot %lld: %s; serving %lld slots\n",
                             static_cast<long long>(i), why.c_str(), static_cast<long long>(i));
                report_.capped_reason = "slot " + std::to_string(i) + ": " + why;
                break;
            }
            const uint64_t after = et_detail::resident_bytes();
            const uint64_t grew = after > before ? after - before : 0;
            if (i == 0) {
                report_.first_slot_bytes = grew;
                slots_.push_back(std::move(inst));
                continue;
            }
            // Beyond its own arenas, an instance that shares the weights costs little (method
            // tables, delegate workspace); one whose delegate packed its own copy costs about
            // the program again.
            const uint64_t beyond_arenas = grew > report_.planned_bytes_per_slot ? grew - report_.planned_bytes_per_slot : 0;
            if (i == 1 && report_.program_bytes > 0 && beyond_arenas * 2 >= report_.program_bytes) {
                report_.weights_duplicated = true;
                std::fprintf(stderr,
                             "trioserve-executorch-worker: an extra slot costs %.2f MB resident beyond its %.2f MB of "
                             "planned memory, about the program's %.2f MB: the weights are duplicated per slot "
                             "(packed per instance), not shared\n",
                             beyond_arenas / 1e6, report_.planned_bytes_per_slot / 1e6, report_.program_bytes / 1e6);
            }
            if (extra_total + grew > report_.memory_budget_bytes) {
                report_.capped_reason = "slot " + std::to_string(i) + " would exceed the memory budget";
                std::fprintf(stderr,
                             "trioserve-executorch-worker: slot %lld costs %.1f MB; with it the extra slots would "
                             "exceed the memory budget of %.1f MB: serving %lld slots of the %lld requested\n",
                             static_cast<long long>(i), grew / 1e6, report_.memory_budget_bytes / 1e6,
                             static_cast<long long>(i), static_cast<long long>(report_.requested));
                break;  // `inst` goes here, freeing what it took
            }
            extra_total += grew;
            slots_.push_back(std::move(inst));
            const uint64_t per = extra_total / static_cast<uint64_t>(i);
            if (i + 1 < report_.requested && extra_total + per > report_.memory_budget_bytes) {
                report_.capped_reason = "the next slot would exceed the memory budget";
                std::fprintf(stderr,
                             "trioserve-executorch-worker: %.1f MB per extra slot; the memory budget of %.1f MB fits "
                             "%lld slots of the %lld requested\n",
                             per / 1e6, report_.memory_budget_bytes / 1e6, static_cast<long long>(i + 1),
                             static_cast<long long>(report_.requested));
                break;
            }
        }
        report_.capacity = static_cast<int64_t>(slots_.size());
        if (slots_.size() > 1) report_.bytes_per_extra_slot = extra_total / static_cast<uint64_t>(slots_.size() - 1);
        report_.state_layout = kv_rows_ ? "kv_rows" : "arenas";
    }

    /// Sets `inst.regions` from the caches the warm-up call wrote (kv_rows) or its arenas.
    /// Returns why the instance cannot serve (empty: it can).
    std::string learn_regions(Instance& inst, const std::vector<llama_ops::CacheBuffer>& log, int64_t i) {
        if (i == 0) kv_rows_ = !log.empty();
        if (kv_rows_) {
            for (const auto& c : log) {
                // The cache must be this instance's own planned memory: a buffer outside the
                // arenas would be shared by every slot (not isolated sessions).
                const bool own = std::any_of(inst.arenas.begin(), inst.arenas.end(), [&c](const std::vector<uint8_t>& a) {
                    return c.data >= a.data() && c.data + static_cast<size_t>(c.rows) * c.row_bytes <= a.data() + a.size();
                });
                if (!own) return "a KV cache outside the instance's planned memory (not per-instance state)";
                inst.regions.push_back({c.data, c.rows, c.row_bytes});
            }
            if (i > 0) {
                const auto& ref = slots_[0].regions;
                bool same = ref.size() == inst.regions.size();
                for (size_t k = 0; same && k < ref.size(); ++k)
                    same = ref[k].rows == inst.regions[k].rows && ref[k].row_bytes == inst.regions[k].row_bytes;
                if (!same) return "its KV caches differ from slot 0's";
            }
        } else {
            for (auto& a : inst.arenas) inst.regions.push_back({a.data(), 1, a.size()});
        }
        return {};
    }

    /// Reads the exporter's constant methods and checks the program is one this engine runs.
    bool read_metadata() {
        auto names = module0_->method_names();
        if (!names.ok() || names->count("forward") == 0) {
            error_ = cfg_.model_path + ": the program has no forward method";
            return false;
        }
        auto constant = [&](const char* name, int64_t fallback) -> int64_t {
            if (names->count(name) == 0) return fallback;
            auto r = module0_->execute(name);
            if (!r.ok() || r->empty()) return fallback;
            const auto& v = (*r)[0];
            if (v.isInt()) return v.toInt();
            if (v.isBool()) return v.toBool() ? 1 : 0;
            return fallback;
        };
        if (constant("use_kv_cache", 1) == 0) {
            error_ = cfg_.model_path + ": exported without a KV cache (use export_llama -kv); not supported";
            return false;
        }
        max_context_ = constant("get_max_context_len", constant("get_max_seq_len", 0));
        const int64_t max_seq = constant("get_max_seq_len", 1);
        dynamic_shape_ = constant("enable_dynamic_shape", 0) != 0;
        vocab_size_ = constant("get_vocab_size", static_cast<int64_t>(vocab_.size()));
        bos_id_ = constant("get_bos_id", -1);
        if (max_context_ <= 0) {
            error_ = cfg_.model_path + ": no get_max_context_len/get_max_seq_len metadata (not an export_llama program?)";
            return false;
        }
        auto meta = module0_->method_meta("forward");
        if (!meta.ok() || meta->num_inputs() != 2) {
            error_ = cfg_.model_path + ": forward must take (tokens, input_pos); other signatures are not supported";
            return false;
        }
        for (size_t i = 0; i < 2; ++i) {
            auto t = meta->input_tensor_meta(i);
            if (!t.ok() || t->scalar_type() != executorch::aten::ScalarType::Long) {
                error_ = cfg_.model_path + ": forward's inputs must be int64 tensors (tokens, input_pos)";
                return false;
            }
        }
        // The largest token run one forward call takes: the tokens input's declared (upper
        // bound) length with dynamic shapes, else exactly that length, which must be 1.
        auto tok_meta = meta->input_tensor_meta(0);
        const auto sizes = tok_meta->sizes();
        const int64_t declared = sizes.size() == 2 ? sizes[1] : 0;
        if (dynamic_shape_) {
            chunk_ = static_cast<size_t>(std::max<int64_t>(1, std::min<int64_t>(max_seq, declared > 0 ? declared : max_seq)));
        } else if (declared == 1) {
            chunk_ = 1;
        } else {
            error_ = cfg_.model_path + ": a static-shape program must take one token per call";
            return false;
        }
        if (names->count("get_eos_ids")) {
            auto r = module0_->execute("get_eos_ids");
            if (r.ok())
                for (const auto& v : *r)
                    if (v.isInt()) eos_ids_.insert(static_cast<TokenId>(v.toInt()));
        }
        if (vocab_.eos_text())
            if (auto id = vocab_.id_of(*vocab_.eos_text())) eos_ids_.insert(*id);
        return true;
    }

    void fill_info() {
        info_.engine = "executorch";
        info_.model_path = cfg_.model_path;
        std::string stem = cfg_.model_path;
        if (const size_t slash = stem.find_last_of('/'); slash != std::string::npos) stem = stem.substr(slash + 1);
        if (const size_t dot = stem.rfind(".pte"); dot != std::string::npos) stem = stem.substr(0, dot);
        info_.model_name = stem;
        info_.architecture = "executorch";
        info_.n_ctx = cfg_.n_ctx > 0 ? std::min<int64_t>(cfg_.n_ctx, max_context_) : max_context_;
        if (cfg_.n_ctx > max_context_)
            std::fprintf(stderr, "trioserve-executorch-worker: --ctx %lld exceeds the program's context %lld; using %lld\n",
                         static_cast<long long>(cfg_.n_ctx), static_cast<long long>(max_context_),
                         static_cast<long long>(max_context_));
        info_.n_ctx_train = max_context_;
        info_.capacity = static_cast<int64_t>(slots_.size());
        info_.n_vocab = vocab_size_;
        info_.max_step_tokens = info_.n_ctx * info_.capacity;  // step() chunks internally
        for (const Region& r : slots_[0].regions)
            info_.kv_cache_bytes += static_cast<uint64_t>(r.rows) * r.row_bytes * static_cast<uint64_t>(info_.capacity);
        info_.supports_truncate = true;
        info_.trims_any_state = true;  // a position move, whatever the state came from
        info_.supports_grammar = false;
        info_.supports_logit_bias = true;  // sample() adds it to a copy of the logits row
        info_.chat_template = vocab_.chat_template();
        if (bos_id_ >= 0) {
            info_.bos_id = static_cast<TokenId>(bos_id_);
            std::string s;
            vocab_.append_bytes(static_cast<TokenId>(bos_id_), s);
            info_.bos_text = s;
        } else if (vocab_.bos_text()) {
            info_.bos_text = vocab_.bos_text();
            if (auto id = vocab_.id_of(*vocab_.bos_text())) info_.bos_id = *id;
        }
        if (vocab_.eos_text()) {
            info_.eos_text = vocab_.eos_text();
            if (auto id = vocab_.id_of(*vocab_.eos_text())) info_.eos_id = *id;
        } else if (!eos_ids_.empty()) {
            info_.eos_id = *eos_ids_.begin();
            std::string s;
            vocab_.append_bytes(*info_.eos_id, s);
            info_.eos_text = s;
        }
    }

    /// Copies the last position's logits (the output is [1, V] or [1, S, V]) as floats.
    bool copy_logits(Instance& s, const executorch::aten::Tensor& t) {
        std::vector<float>& logits_ = s.logits;
        const size_t nv = static_cast<size_t>(vocab_size_);
        const size_t numel = static_cast<size_t>(t.numel());
        if (numel < nv || numel % nv != 0) {
            std::fprintf(stderr, "trioserve-executorch-worker: logits of %zu values for a vocabulary of %zu\n", numel, nv);
            return false;
        }
        logits_.resize(nv);
        const size_t off = numel - nv;
        switch (t.scalar_type()) {
            case executorch::aten::ScalarType::Float: {
                const float* p = t.const_data_ptr<float>() + off;
                std::copy(p, p + nv, logits_.begin());
                break;
            }
            case executorch::aten::ScalarType::Half: {
                const auto* p = t.const_data_ptr<executorch::aten::Half>() + off;
                for (size_t i = 0; i < nv; ++i) logits_[i] = static_cast<float>(p[i]);
                break;
            }
            case executorch::aten::ScalarType::BFloat16: {
                const auto* p = t.const_data_ptr<executorch::aten::BFloat16>() + off;
                for (size_t i = 0; i < nv; ++i) logits_[i] = static_cast<float>(p[i]);
                break;
            }
            default:
                std::fprintf(stderr, "trioserve-executorch-worker: logits dtype %d is not supported\n",
                             static_cast<int>(t.scalar_type()));
                return false;
        }
        s.has_logits = true;
        return true;
    }

    /// Tests only (--test-step-delay-ms): sleeps in 1 ms slices; false when an abort arrives.
    bool test_delay() {
        if (cfg_.test_step_delay_ms <= 0) return true;
        using namespace std::chrono;
        const auto until = steady_clock::now() + duration_cast<steady_clock::duration>(duration<double, std::milli>(cfg_.test_step_delay_ms));
        while (steady_clock::now() < until) {
            if (abort_.load(std::memory_order_acquire)) return false;
            std::this_thread::sleep_for(std::min<steady_clock::duration>(until - steady_clock::now(), milliseconds(1)));
        }
        return !abort_.load(std::memory_order_acquire);
    }

    ExecuTorchConfig cfg_;
    std::string error_;
    HfVocab vocab_;
    executorch::extension::Module* module0_ = nullptr;  ///< slot 0's Module (metadata)
    int64_t max_context_ = 0;
    int64_t vocab_size_ = 0;
    int64_t bos_id_ = -1;
    bool dynamic_shape_ = false;
    size_t chunk_ = 1;
    std::set<TokenId> eos_ids_;
    EngineInfo info_;
    std::vector<Instance> slots_;
    bool kv_rows_ = false;  ///< state = the learned caches' rows (else whole arenas)
    std::vector<int64_t> start_pos_;  ///< step()'s scratch: each item's position before the step
    executorch::runtime::BackendOptions<4> xnn_options_;
    executorch::runtime::LoadBackendOptionsMap backend_options_;
    ExecuTorchSlotReport report_;
    std::vector<int64_t> ids_;        ///< the running chunk's tokens as int64 (forward's dtype)
    std::vector<float> biased_;       ///< sample()'s scratch: the row plus a generation's logit bias
    std::vector<int32_t> order_;      ///< sample()'s scratch: candidate ids
    std::vector<double> probs_;       ///< sample()'s scratch: their weights
    std::atomic<bool> abort_{false};
};

}  // namespace trioserve
