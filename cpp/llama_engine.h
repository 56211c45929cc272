// llama_engine.h — the Engine/Session contract over llama.cpp (GGUF models).
//
// One llama_model and ONE llama_context per process; each Session owns one sequence id of
// that context (n_seq_max = capacity, non-unified KV so every sequence gets n_ctx cells), so
// `capacity` isolated sessions share one weight load. Warm resume trims a sequence with
// llama_memory_seq_rm (truncate()). request_stop() interrupts a running llama_decode through
// llama_set_abort_callback (CPU backends; on GPU backends the prefill chunking of the worker
// loop bounds the latency instead).
//
// Threading: as engine.h — one thread drives everything; request_stop() is the only method
// another thread may call (it stores an atomic the abort callback reads). Never writes stdout.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "llama-cpp.h"
#include "llama.h"

namespace trioserve {

struct LlamaConfig {
    std::string model_path;
    int64_t n_ctx = 4096;        ///< per-session context, tokens; 0 = model's training context
    int32_t n_threads = 0;       ///< 0 = number of hardware threads
    int32_t n_gpu_layers = 0;    ///< layers offloaded to a GPU (needs a GPU build); -1 = all
    int64_t capacity = 4;        ///< sessions (sequences) on one weight load
    int64_t prefill_chunk = 512; ///< tokens per llama_decode during prefill (n_batch)
    bool verbose = false;        ///< forward llama.cpp INFO logs to stderr
};

/// llama.cpp logs go to stderr; INFO and below only with `verbose`.
inline void install_llama_log(bool verbose) {
    static bool s_verbose = false;
    s_verbose = verbose;
    llama_log_set(
        [](ggml_log_level level, const char* text, void*) {
            static ggml_log_level last = GGML_LOG_LEVEL_INFO;
            if (level != GGML_LOG_LEVEL_CONT) last = level;
            if (s_verbose || last >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
        },
        nullptr);
}

inline int32_t default_threads(int32_t n) {
    if (n > 0) return n;
    unsigned hc = std::thread::hardware_concurrency();
    return hc > 0 ? static_cast<int32_t>(hc) : 4;
}

/// The context parameters the worker uses; trioserve-llama-direct uses the same ones so the
/// benchmark compares like with like.
inline llama_context_params make_context_params(const LlamaConfig& c, int64_t n_ctx_per_seq) {
    llama_context_params p = llama_context_default_params();
    const int64_t chunk = std::max<int64_t>(1, c.prefill_chunk);
    p.n_seq_max = static_cast<uint32_t>(c.capacity);
    p.n_ctx = static_cast<uint32_t>(n_ctx_per_seq * c.capacity);
    p.kv_unified = false;  // each sequence its own n_ctx cells: sessions cannot starve each other
    p.n_batch = static_cast<uint32_t>(chunk);
    p.n_ubatch = static_cast<uint32_t>(std::min<int64_t>(chunk, 512));
    p.n_threads = default_threads(c.n_threads);
    p.n_threads_batch = p.n_threads;
    p.no_perf = true;
    return p;
}

inline int64_t resolve_n_ctx(const LlamaConfig& c, const llama_model* model) {
    const int64_t train = llama_model_n_ctx_train(model);
    int64_t n = c.n_ctx > 0 ? c.n_ctx : train;
    if (train > 0 && n > train) {
        std::fprintf(stderr, "trioserve-llama-worker: --ctx %lld exceeds the model's training context %lld; using %lld\n",
                     static_cast<long long>(n), static_cast<long long>(train), static_cast<long long>(train));
        n = train;
    }
    return n;
}

class LlamaEngine;

class LlamaSession : public Session {
public:
    LlamaSession(LlamaEngine& e, llama_seq_id seq) : e_(e), seq_(seq) {}
    ~LlamaSession() override;

    Status reset() override;
    int64_t position() const override { return pos_; }
    Status truncate(int64_t pos) override;
    Status prefill(const TokenId* ids, size_t n) override;
    Status start_generation(const SamplingParams& params) override;
    Status sample(TokenId* out) override;
    Status decode(TokenId token) override { return run_batch(&token, 1); }
    void request_stop() override { stop_.store(true, std::memory_order_release); }
    void clear_stop() override { stop_.store(false, std::memory_order_release); }

private:
    friend class LlamaEngine;
    Status run_batch(const TokenId* ids, size_t n);

    LlamaEngine& e_;
    llama_seq_id seq_;
    int64_t pos_ = 0;
    llama_sampler_ptr sampler_;
    std::atomic<bool> stop_{false};
};

class LlamaEngine : public Engine {
public:
    /// Loads the model and creates the context. On failure `error()` is non-empty.
    explicit LlamaEngine(const LlamaConfig& cfg) : cfg_(cfg) {
        llama_backend_init();
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = cfg.n_gpu_layers < 0 ? 999 : cfg.n_gpu_layers;
        model_.reset(llama_model_load_from_file(cfg.model_path.c_str(), mp));
        if (!model_) { error_ = "failed to load model " + cfg.model_path; return; }
        vocab_ = llama_model_get_vocab(model_.get());
        n_ctx_seq_ = resolve_n_ctx(cfg, model_.get());
        llama_context_params cp = make_context_params(cfg, n_ctx_seq_);
        cp.abort_callback = &LlamaEngine::abort_cb;
        cp.abort_callback_data = this;
        ctx_.reset(llama_init_from_model(model_.get(), cp));
        if (!ctx_) { error_ = "failed to create the llama context"; return; }
        n_batch_ = static_cast<int32_t>(cp.n_batch);
        batch_ = llama_batch_init(n_batch_, 0, 1);
        has_batch_ = true;
        seq_used_.assign(static_cast<size_t>(cfg.capacity), false);
        fill_info();
    }

    ~LlamaEngine() override {
        if (has_batch_) llama_batch_free(batch_);
        ctx_.reset();
        model_.reset();
        llama_backend_free();
    }

    const std::string& error() const { return error_; }
    const EngineInfo& info() const override { return info_; }

    std::unique_ptr<Session> create_session() override {
        for (size_t i = 0; i < seq_used_.size(); ++i) {
            if (!seq_used_[i]) {
                seq_used_[i] = true;
                auto s = std::make_unique<LlamaSession>(*this, static_cast<llama_seq_id>(i));
                llama_memory_seq_rm(mem(), s->seq_, -1, -1);
                return s;
            }
        }
        return nullptr;
    }

    Status tokenize(const std::string& text, std::vector<TokenId>& out) const override {
        if (text.empty()) return Status::ok;
        const int32_t len = static_cast<int32_t>(text.size());
        const size_t base = out.size();
        // Size-query idiom: a negative result is the number of tokens needed.
        out.resize(base + text.size() + 8);
        int32_t n = llama_tokenize(vocab_, text.data(), len, out.data() + base, static_cast<int32_t>(out.size() - base),
                                   /*add_special=*/false, /*parse_special=*/true);
        if (n < 0) {
            out.resize(base + static_cast<size_t>(-n));
            n = llama_tokenize(vocab_, text.data(), len, out.data() + base, -n, false, true);
        }
        if (n < 0) { out.resize(base); return Status::engine_error; }
        out.resize(base + static_cast<size_t>(n));
        return Status::ok;
    }

    void token_bytes(TokenId id, std::string& out) const override {
        char buf[256];
        // special=true: control tokens a model emits (other than EOG) stay visible as text.
        int32_t n = llama_token_to_piece(vocab_, id, buf, sizeof buf, 0, /*special=*/true);
        if (n >= 0) { out.append(buf, static_cast<size_t>(n)); return; }
        std::string big(static_cast<size_t>(-n), '\0');
        n = llama_token_to_piece(vocab_, id, big.data(), -n, 0, true);
        if (n > 0) out.append(big.data(), static_cast<size_t>(n));
    }

    bool is_end_of_generation(TokenId id) const override { return llama_vocab_is_eog(vocab_, id); }

    llama_context* ctx() const { return ctx_.get(); }
    llama_memory_t mem() const { return llama_get_memory(ctx_.get()); }

private:
    friend class LlamaSession;

    static bool abort_cb(void* data) {
        auto* self = static_cast<LlamaEngine*>(data);
        const std::atomic<bool>* f = self->active_stop_.load(std::memory_order_acquire);
        return f != nullptr && f->load(std::memory_order_acquire);
    }

    std::string meta(const char* key) const {
        char buf[512];
        int32_t n = llama_model_meta_val_str(model_.get(), key, buf, sizeof buf);
        return n >= 0 ? std::string(buf) : std::string();
    }

    std::string piece_text(TokenId id) const {
        std::string s;
        token_bytes(id, s);
        return s;
    }

    void fill_info() {
        info_.engine = "llama";
        info_.model_path = cfg_.model_path;
        info_.model_name = meta("general.name");
        if (info_.model_name.empty()) {
            std::string p = cfg_.model_path;
            size_t slash = p.find_last_of('/');
            if (slash != std::string::npos) p = p.substr(slash + 1);
            size_t dot = p.rfind(".gguf");
            info_.model_name = dot != std::string::npos ? p.substr(0, dot) : p;
        }
        info_.architecture = meta("general.architecture");
        info_.n_ctx = n_ctx_seq_;
        info_.capacity = cfg_.capacity;
        info_.n_vocab = llama_vocab_n_tokens(vocab_);
        info_.supports_truncate = true;  // per call: truncate() reports unsupported when seq_rm refuses
        const llama_token bos = llama_vocab_bos(vocab_), eos = llama_vocab_eos(vocab_);
        if (bos != LLAMA_TOKEN_NULL) { info_.bos_id = bos; info_.bos_text = piece_text(bos); }
        if (eos != LLAMA_TOKEN_NULL) { info_.eos_id = eos; info_.eos_text = piece_text(eos); }
        if (const char* t = llama_model_chat_template(model_.get(), nullptr)) info_.chat_template = std::string(t);
    }

    LlamaConfig cfg_;
    std::string error_;
    llama_model_ptr model_;
    llama_context_ptr ctx_;
    const llama_vocab* vocab_ = nullptr;
    int64_t n_ctx_seq_ = 0;
    int32_t n_batch_ = 0;
    llama_batch batch_{};
    bool has_batch_ = false;
    std::vector<bool> seq_used_;
    std::atomic<const std::atomic<bool>*> active_stop_{nullptr};
    EngineInfo info_;
};

inline LlamaSession::~LlamaSession() {
    llama_memory_seq_rm(e_.mem(), seq_, -1, -1);
    e_.seq_used_[static_cast<size_t>(seq_)] = false;
}

inline Status LlamaSession::reset() {
    llama_memory_seq_rm(e_.mem(), seq_, -1, -1);  // removing a whole sequence never fails
    pos_ = 0;
    return Status::ok;
}

inline Status LlamaSession::truncate(int64_t pos) {
    if (pos < 0 || pos > pos_) return Status::engine_error;
    if (pos == pos_) return Status::ok;
    // Sliding-window attention caches drop cells older than the window: decoding again at
    // `pos` needs cells [pos - n_swa, pos), which may already be gone. (Recurrent models refuse
    // a partial seq_rm themselves.) Checked before mutating, so `unsupported` changes nothing.
    const int64_t n_swa = llama_model_n_swa(e_.model_.get());
    if (n_swa > 0 && pos > 0) {
        const int64_t pos_min = llama_memory_seq_pos_min(e_.mem(), seq_);
        if (pos_min > std::max<int64_t>(0, pos - n_swa)) return Status::unsupported;
    }
    if (!llama_memory_seq_rm(e_.mem(), seq_, static_cast<llama_pos>(pos), -1)) return Status::unsupported;
    pos_ = pos;
    return Status::ok;
}

inline Status LlamaSession::prefill(const TokenId* ids, size_t n) {
    const int32_t n_vocab = static_cast<int32_t>(e_.info_.n_vocab);
    for (size_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= n_vocab) return Status::invalid_token;
    // The worker loop chunks already; split again only if a caller passes more than n_batch.
    while (n > 0) {
        const size_t k = std::min(n, static_cast<size_t>(e_.n_batch_));
        Status st = run_batch(ids, k);
        if (st != Status::ok) return st;
        ids += k;
        n -= k;
    }
    return Status::ok;
}

inline Status LlamaSession::run_batch(const TokenId* ids, size_t n) {
    if (pos_ + static_cast<int64_t>(n) > e_.n_ctx_seq_) return Status::context_full;
    if (stop_.load(std::memory_order_acquire)) return Status::aborted;
    llama_batch& b = e_.batch_;
    b.n_tokens = static_cast<int32_t>(n);
    for (size_t i = 0; i < n; ++i) {
        b.token[i] = ids[i];
        b.pos[i] = static_cast<llama_pos>(pos_ + static_cast<int64_t>(i));
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = seq_;
        b.logits[i] = (i + 1 == n);  // only the last token's logits are sampled
    }
    e_.active_stop_.store(&stop_, std::memory_order_release);
    const int32_t rc = llama_decode(e_.ctx(), b);
    e_.active_stop_.store(nullptr, std::memory_order_release);
    if (rc == 0) { pos_ += static_cast<int64_t>(n); return Status::ok; }
    // Aborted/fatal: processed micro-batches stay in memory; resync the position from it.
    pos_ = static_cast<int64_t>(llama_memory_seq_pos_max(e_.mem(), seq_)) + 1;
    if (rc == 2) return Status::aborted;
    if (rc == 1) return Status::context_full;
    std::fprintf(stderr, "trioserve-llama-worker: llama_decode returned %d\n", rc);
    return Status::engine_error;
}

inline Status LlamaSession::start_generation(const SamplingParams& p) {
    // llama.cpp's sampler chain; greedy at temperature 0 (argmax, no RNG).
    llama_sampler_chain_params cp = llama_sampler_chain_default_params();
    cp.no_perf = true;
    sampler_.reset(llama_sampler_chain_init(cp));
    if (!sampler_) return Status::engine_error;
    if (p.temperature <= 0.0f) {
        llama_sampler_chain_add(sampler_.get(), llama_sampler_init_greedy());  // chain takes ownership
    } else {
        if (p.top_k > 0) llama_sampler_chain_add(sampler_.get(), llama_sampler_init_top_k(p.top_k));
        if (p.top_p < 1.0f) llama_sampler_chain_add(sampler_.get(), llama_sampler_init_top_p(p.top_p, 1));
        llama_sampler_chain_add(sampler_.get(), llama_sampler_init_temp(p.temperature));
        llama_sampler_chain_add(sampler_.get(), llama_sampler_init_dist(p.seed));
    }
    return Status::ok;
}

inline Status LlamaSession::sample(TokenId* out) {
    if (!sampler_) return Status::engine_error;
    // -1: the last output of the last llama_decode — always this session's, since one request
    // runs at a time and every generation starts with a prefill of >= 1 token.
    *out = llama_sampler_sample(sampler_.get(), e_.ctx(), -1);
    return Status::ok;
}

}  // namespace trioserve
