// executorch_engine.h — the Engine contract (engine.h) over an ExecuTorch `.pte` LLM program.
//
// What program: one exported by ExecuTorch's `export_llama` with a KV cache (`-kv`), i.e. a
// `forward(tokens: int64[1, S], input_pos: int64[1]) -> logits` method whose KV cache lives in
// the program's mutable buffers, plus the constant methods the exporter writes
// (`get_max_context_len`, `get_max_seq_len`, `get_vocab_size`, `use_kv_cache`,
// `enable_dynamic_shape`, `get_bos_id`, `get_eos_ids`). It runs through the ExecuTorch
// `Module` API of the `executorch` wheel's C++ runtime (no libtorch, no libpython).
//
// One slot (capacity 1): the program has ONE KV cache, so one generation at a time. The
// slot's position is a counter: the cache rows at positions >= it are stale but never read
// (the program masks attention causally by `input_pos` and overwrites a row before reading
// it), so truncate() and reset() only move the counter, and a step that is aborted part way
// rolls back by restoring it. That is what makes warm append-only resume free: the next turn
// of a conversation continues at the resident position and prefills only its new tokens.
//
// step() runs the item's tokens through `forward` in chunks of at most `max_seq_len` tokens
// (the exporter's largest prefill shape; 1 when the program was exported without dynamic
// shapes) and checks the abort flag before every chunk, so a cancel interrupts a long prefill
// within one chunk. Logits of the last chunk are copied out (the output buffer is reused by
// the next execute) for sample().
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
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/platform/runtime.h>

#include "engine.h"
#include "hf_vocab.h"
#include "llama_custom_ops.h"

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
    double test_step_delay_ms = 0;  ///< tests only: abortable sleep before every forward call
};

/// One generation's sampling state: its parameters and its own RNG.
class ExecuTorchSampler : public Sampler {
public:
    explicit ExecuTorchSampler(const SamplingParams& p) : params(p), rng(p.seed) {}
    SamplingParams params;
    std::mt19937 rng;
};

class ExecuTorchEngine : public Engine {
public:
    /// Loads the program and the tokenizer's vocabulary. On failure `error()` is non-empty.
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
        module_ = std::make_unique<executorch::extension::Module>(cfg.model_path,
                                                                  executorch::extension::Module::LoadMode::Mmap);
        if (module_->load() != executorch::runtime::Error::Ok) {
            error_ = "failed to load the ExecuTorch program " + cfg.model_path;
            return;
        }
        if (!read_metadata()) return;
        if (module_->load_method("forward") != executorch::runtime::Error::Ok) {
            error_ = "the program's forward method does not load (a missing kernel or backend? see the log above)";
            return;
        }
        fill_info();
    }

    const std::string& error() const { return error_; }
    const EngineInfo& info() const override { return info_; }

    int64_t position(int32_t) const override { return pos_; }

    Status reset(int32_t) override {
        pos_ = 0;
        has_logits_ = false;
        return Status::ok;
    }

    /// Moves the position back: rows at or after it are never read again (see the header).
    Status truncate(int32_t, int64_t pos) override {
        if (pos < 0 || pos > pos_) return Status::engine_error;
        pos_ = pos;
        has_logits_ = false;
        return Status::ok;
    }

    Status step(const StepItem* items, size_t n) override {
        if (n != 1 || items[0].slot != 0 || items[0].n == 0) return Status::engine_error;
        const StepItem& it = items[0];
        const int64_t p0 = pos_;
        if (p0 + static_cast<int64_t>(it.n) > info_.n_ctx) return Status::context_full;
        for (size_t k = 0; k < it.n; ++k)
            if (it.tokens[k] < 0 || it.tokens[k] >= info_.n_vocab) return Status::invalid_token;
        has_logits_ = false;
        size_t done = 0;
        while (done < it.n) {
            // Before every chunk: an abort leaves nothing appended (the position is restored;
            // the rows the finished chunks wrote are beyond it, hence never read).
            if (abort_.load(std::memory_order_acquire) || !test_delay()) {
                pos_ = p0;
                return Status::aborted;
            }
            const size_t c = std::min(it.n - done, chunk_);
            ids_.assign(it.tokens + done, it.tokens + done + c);
            int64_t start = pos_;
            auto tokens = executorch::extension::from_blob(ids_.data(), {1, static_cast<int32_t>(c)},
                                                          executorch::aten::ScalarType::Long);
            auto input_pos = executorch::extension::from_blob(&start, {1}, executorch::aten::ScalarType::Long);
            auto out = module_->forward({executorch::runtime::EValue(*tokens), executorch::runtime::EValue(*input_pos)});
            if (!out.ok() || out->empty() || !(*out)[0].isTensor()) {
                std::fprintf(stderr, "trioserve-executorch-worker: forward failed (error 0x%x)\n",
                             out.ok() ? 0u : static_cast<unsigned>(out.error()));
                pos_ = p0;
                return Status::engine_error;
            }
            pos_ += static_cast<int64_t>(c);
            done += c;
            if (done == it.n && it.logits && !copy_logits((*out)[0].toTensor())) {
                pos_ = p0;
                return Status::engine_error;
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

    /// Greedy: the first index of the largest logit (what argmax gives in ExecuTorch's Python
    /// runtime). Otherwise top-k, then top-p over the temperature-scaled softmax, then a draw
    /// from the generation's own RNG.
    Status sample(int32_t, Sampler& sampler, TokenId* out) override {
        if (!has_logits_) return Status::engine_error;
        auto& s = static_cast<ExecuTorchSampler&>(sampler);
        const size_t nv = logits_.size();
        if (s.params.temperature <= 0.0f) {
            *out = static_cast<TokenId>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
            return Status::ok;
        }
        order_.resize(nv);
        for (size_t i = 0; i < nv; ++i) order_[i] = static_cast<int32_t>(i);
        size_t keep = nv;
        if (s.params.top_k > 0 && static_cast<size_t>(s.params.top_k) < nv) keep = static_cast<size_t>(s.params.top_k);
        auto by_logit = [this](int32_t a, int32_t b) {
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
    /// Reads the exporter's constant methods and checks the program is one this engine runs.
    bool read_metadata() {
        auto names = module_->method_names();
        if (!names.ok() || names->count("forward") == 0) {
            error_ = cfg_.model_path + ": the program has no forward method";
            return false;
        }
        auto constant = [&](const char* name, int64_t fallback) -> int64_t {
            if (names->count(name) == 0) return fallback;
            auto r = module_->execute(name);
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
        auto meta = module_->method_meta("forward");
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
            auto r = module_->execute("get_eos_ids");
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
        info_.capacity = 1;
        info_.n_vocab = vocab_size_;
        info_.max_step_tokens = info_.n_ctx;  // step() chunks internally
        info_.supports_truncate = true;
        info_.trims_any_state = true;  // a position move, whatever the state came from
        info_.supports_grammar = false;
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
    bool copy_logits(const executorch::aten::Tensor& t) {
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
        has_logits_ = true;
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
    std::unique_ptr<executorch::extension::Module> module_;
    int64_t max_context_ = 0;
    int64_t vocab_size_ = 0;
    int64_t bos_id_ = -1;
    bool dynamic_shape_ = false;
    size_t chunk_ = 1;
    std::set<TokenId> eos_ids_;
    EngineInfo info_;
    int64_t pos_ = 0;
    bool has_logits_ = false;
    std::vector<float> logits_;
    std::vector<int64_t> ids_;        ///< the running chunk's tokens as int64 (forward's dtype)
    std::vector<int32_t> order_;      ///< sample()'s scratch: candidate ids
    std::vector<double> probs_;       ///< sample()'s scratch: their weights
    std::atomic<bool> abort_{false};
};

}  // namespace trioserve
