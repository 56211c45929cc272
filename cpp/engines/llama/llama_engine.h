// llama_engine.h — the batched Engine contract over llama.cpp (GGUF models).
//
// One llama_model and ONE llama_context per process; slot i is sequence id i of that context
// (n_seq_max = capacity, non-unified KV so every sequence gets its own n_ctx cells and slots
// cannot starve each other). step() puts every slot's tokens in one llama_batch and calls
// llama_decode once; logits are requested only for the last token of items that sample.
// Each generation gets its own sampler chain (top-k/top-p/temperature/dist, or greedy) and its
// own grammar sampler when constrained, so generations never share RNG or grammar state.
// sample() checks the chain's pick against the grammar and masks the vocabulary only on a
// rejection (see there); that mask is finish_sample(), which the worker loop runs on its
// sampler thread so one grammar's mask does not hold up the other generations' steps.
//
// Abort: request_abort() makes a running llama_decode stop through llama's abort callback (CPU
// backends; on GPU backends the per-step token budget bounds the latency instead). An aborted
// llama_decode keeps the micro-batches it finished and drops the one it was in; step() then
// rolls EVERY sequence of the batch back to its pre-step position with llama_memory_seq_rm, so
// "aborted" means "nothing appended" and the worker loop can redo the step without the
// cancelled generation, leaving the others unaffected. llama.cpp logs ~4 WARN/ERROR lines for
// an abort; since we initiated it, those exact lines go to the verbose-only path.
//
// Threading: as engine.h — one thread drives everything; request_abort() (it stores an atomic
// the abort callback reads), the THREAD-SAFE tokenizer/grammar checks and finish_sample() (on
// one generation's sampler) are what other threads may call. Never writes stdout.
#pragma once

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <climits>
#include <sys/stat.h>
#include <unistd.h>

#include "cpu_backend.h"
#include "engine.h"
#include "grammar_guard.h"
#include "greedy_pick.h"
#include "engines/llama/llama_context_setup.h"
#include "kv_cache_type.h"
#include "swa_cache.h"
#include "ggml-backend.h"
#include "llama-cpp.h"
#include "llama.h"

namespace trioserve {

/// Adds the nanoseconds of its scope to `acc` when `on` (the engine's profile; otherwise a
/// branch and nothing else).
class StageTimer {
public:
    StageTimer(bool on, uint64_t& acc) : acc_(on ? &acc : nullptr) {
        if (acc_ != nullptr) t0_ = std::chrono::steady_clock::now();
    }
    ~StageTimer() {
        if (acc_ != nullptr)
            *acc_ += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - t0_).count());
    }
    StageTimer(const StageTimer&) = delete;
    StageTimer& operator=(const StageTimer&) = delete;

private:
    uint64_t* acc_;
    std::chrono::steady_clock::time_point t0_{};
};

/// One generation's llama.cpp samplers: the chain (top-k/top-p/temperature/dist, or greedy)
/// and, for a constrained generation, its own grammar sampler kept OUTSIDE the chain so a
/// sampled token can be checked against the grammar before the whole vocabulary is masked.
///
/// A deferred sample (Engine::begin_sample) keeps its logits row and the masking scratch here,
/// in the generation's own sampler, so finish_sample() on the sampler thread shares no buffer
/// with the loop thread. Both grow once (n_vocab entries, ~0.8 MB with SmolLM2's 49k) and only
/// for a generation that needed a mask.
class LlamaSampler : public Sampler {
public:
    LlamaSampler(llama_sampler* chain, llama_sampler* grammar) : chain_(chain), grammar_(grammar) {}
    llama_sampler* chain() const { return chain_.get(); }

    llama_sampler* grammar() const { return grammar_.get(); }  ///< null when unconstrained

private:
    friend class LlamaEngine;
    /// The chain is greedy alone (temperature 0): its pick is the first maximum of the logits
    /// row, which LlamaEngine reads straight from the row (greedy_pick()).
    bool greedy_ = false;
    llama_sampler_ptr chain_;
    llama_sampler_ptr grammar_;
    std::vector<float> deferred_logits_;            ///< the row a deferred sample masks
    std::vector<llama_token_data> mask_candidates_;  ///< finish_sample()'s scratch
};

class LlamaEngine : public Engine {
public:
    /// Loads the model and creates the context. On failure `error()` is non-empty.
    explicit LlamaEngine(const LlamaConfig& cfg) : cfg_(cfg) {
        // Diagnostics for benchmarks (docs/benchmarks.md): per-stage timers reported on stderr
        // when the engine goes, and the greedy fast path switched off to compare against it.
        profile_ = env_is("TRIOSERVE_LLAMA_PROFILE", "1");
        greedy_fast_path_ = !env_is("TRIOSERVE_LLAMA_GREEDY_FAST_PATH", "0");
        // A run-time-selected build has no CPU backend until it is loaded (cpu_backend.h); the
        // worker's main has done that already, this covers every other user of the engine.
        if (const CpuBackendInfo cpu = ensure_cpu_backend(); !cpu.error.empty()) { error_ = cpu.error; return; }
        if (std::string conflict = kv_cache_conflict(cfg.kv_cache_type, cfg.flash_attn); !conflict.empty()) {
            error_ = conflict;
            return;
        }
        llama_backend_init();
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = cfg.n_gpu_layers < 0 ? 999 : cfg.n_gpu_layers;
        mp.use_extra_bufts = cfg.use_extra_bufts;
        llama_log::weight_buffers.clear();
        model_.reset(llama_model_load_from_file(cfg.model_path.c_str(), mp));
        if (!model_) { error_ = "failed to load model " + cfg.model_path; return; }
        vocab_ = llama_model_get_vocab(model_.get());
        n_ctx_seq_ = resolve_n_ctx(cfg, model_.get());
        swa_full_ = resolve_swa_full(cfg, model_.get());
        cfg_.flash_attn = resolve_flash_attn(cfg, model_.get(), n_ctx_seq_);
        if (cfg.flash_attn == FlashAttnMode::automatic && cfg_.flash_attn != FlashAttnMode::automatic)
            std::fprintf(stderr, "trioserve-llama-worker: flash attention %s (--flash-attn auto: %s)\n",
                         flash_attn_mode_name(cfg_.flash_attn),
                         cfg.kv_cache_type != KvCacheType::f16 ? "a quantized cache needs it"
                         : cfg.speculative          ? "a verify step is exact only with it"
                         : flash_attn_off(cfg_)     ? "a model of 512 MiB or more on a CPU, whose attention matrix fits 1 GiB"
                                                    : "a model under 512 MiB, with layers that do not attend over the "
                                                      "whole context, or an attention matrix past 1 GiB");
        llama_context_params cp = make_context_params(cfg_, n_ctx_seq_, swa_full_);
        cp.abort_callback = &LlamaEngine::abort_cb;
        cp.abort_callback_data = this;
        llama_log::kv_cache_mib = 0;
        llama_log::recurrent_state_mib = 0;
        ctx_.reset(llama_init_from_model(model_.get(), cp));
        if (!ctx_ && cfg.kv_cache_type != KvCacheType::f16) {
            error_ = std::string("failed to create the llama context with a ") + kv_cache_type_name(cfg.kv_cache_type) +
                     " KV cache: a quantized V cache needs flash attention, which this llama.cpp build or device "
                     "may not provide (llama.cpp's reason is logged above); use --kv-cache-type f16";
            return;
        }
        if (!ctx_) { error_ = "failed to create the llama context"; return; }
        n_batch_ = static_cast<int32_t>(cp.n_batch);
        batch_ = llama_batch_init(n_batch_, 0, 1);
        has_batch_ = true;
        const size_t cap = static_cast<size_t>(cfg.capacity);
        pos_.assign(cap, 0);
        out_idx_.assign(cap, -1);
        out_n_.assign(cap, 1);
        pre_pos_.reserve(cap);
        if (cfg.deterministic) own_logits_.assign(cap, {});
        fill_info();
    }

    ~LlamaEngine() override {
        if (profile_) report_profile();
        if (has_batch_) llama_batch_free(batch_);
        ctx_.reset();
        model_.reset();
        llama_backend_free();
    }

    const std::string& error() const { return error_; }
    /// The flash-attention mode the context runs with: --flash-attn, auto resolved
    /// (resolve_flash_attn); `automatic` only where llama.cpp decides (layers on a GPU).
    FlashAttnMode flash_attn() const { return cfg_.flash_attn; }
    const EngineInfo& info() const override { return info_; }

    int64_t position(int32_t slot) const override { return pos_[idx(slot)]; }

    Status reset(int32_t slot) override {
        llama_memory_seq_rm(mem(), slot, -1, -1);  // removing a whole sequence never fails
        pos_[idx(slot)] = 0;
        out_idx_[idx(slot)] = -1;
        return Status::ok;
    }

    Status truncate(int32_t slot, int64_t pos) override {
        int64_t& cur = pos_[idx(slot)];
        if (pos < 0 || pos > cur) return Status::engine_error;
        if (pos == cur) return Status::ok;
        // Sliding-window attention caches drop cells older than the window: decoding again at
        // `pos` needs cells [pos - n_swa, pos), which may already be gone. (Recurrent models
        // refuse a partial seq_rm themselves.) Checked before mutating: `unsupported` changes
        // nothing.
        const int64_t n_swa = llama_model_n_swa(model_.get());
        if (n_swa > 0 && pos > 0) {
            const int64_t pos_min = llama_memory_seq_pos_min(mem(), slot);
            if (pos_min > std::max<int64_t>(0, pos - n_swa)) return Status::unsupported;
        }
        if (!llama_memory_seq_rm(mem(), slot, static_cast<llama_pos>(pos), -1)) return Status::unsupported;
        cur = pos;
        out_idx_[idx(slot)] = -1;
        return Status::ok;
    }

    /// truncate()'s checks without the mutation (prefix_index.h asks before copying a slot).
    bool can_truncate(int32_t slot, int64_t pos) const override {
        const int64_t cur = pos_[idx(slot)];
        if (pos < 0 || pos > cur) return false;
        if (pos == cur || pos == 0) return true;
        if (recurrent_) return false;
        const int64_t n_swa = llama_model_n_swa(model_.get());
        if (n_swa > 0) {
            const int64_t pos_min = llama_memory_seq_pos_min(mem(), slot);
            if (pos_min > std::max<int64_t>(0, pos - n_swa)) return false;
        }
        return true;
    }

    Status save_state(int32_t slot, std::vector<uint8_t>& out) override {
        const size_t need = llama_state_seq_get_size(ctx_.get(), slot);
        if (need == 0) return Status::engine_error;
        out.resize(need);
        const size_t wrote = llama_state_seq_get_data(ctx_.get(), out.data(), out.size(), slot);
        if (wrote == 0 || wrote > need) return Status::engine_error;
        out.resize(wrote);
        return Status::ok;
    }

    Status load_state(int32_t slot, const std::vector<uint8_t>& in) override {
        llama_memory_seq_rm(mem(), slot, -1, -1);
        out_idx_[idx(slot)] = -1;
        pos_[idx(slot)] = 0;
        if (in.empty() || llama_state_seq_set_data(ctx_.get(), in.data(), in.size(), slot) == 0) {
            llama_memory_seq_rm(mem(), slot, -1, -1);
            return Status::engine_error;
        }
        pos_[idx(slot)] = static_cast<int64_t>(llama_memory_seq_pos_max(mem(), slot)) + 1;
        return Status::ok;
    }

    /// The state fingerprint (state_store.h, spec §6.4): the model file's identity (resolved
    /// path, size, mtime: a file replaced in place is another model), its description, and
    /// what shapes a sequence state: cells per slot, KV cache type, flash attention (whether
    /// V is stored transposed), a full or small window cache, GPU layers. Empty (no store)
    /// when the file cannot be stat'ed.
    std::string state_fingerprint() const override {
        struct stat st {};
        char real[PATH_MAX];
        if (::realpath(cfg_.model_path.c_str(), real) == nullptr || ::stat(real, &st) != 0) return {};
        char desc[256] = {0};
        llama_model_desc(model_.get(), desc, sizeof desc);
        return std::string("llama|") + real + "|size=" + std::to_string(st.st_size) +
               "|mtime=" + std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + "|" + desc +
               "|n_ctx=" + std::to_string(n_ctx_seq_) + "|kv=" + kv_cache_type_name(cfg_.kv_cache_type) +
               "|fa=" + std::to_string(static_cast<int>(cfg_.flash_attn)) + "|swa_full=" + std::to_string(swa_full_) +
               "|gpu_layers=" + std::to_string(cfg_.n_gpu_layers);
    }

    /// The part of the sequence's state seq_rm cannot cut back (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
    /// an iSWA cache writes only its window cells, a hybrid memory only its recurrent state
    /// (plus its window cells with iSWA attention), a recurrent memory its state).
    Status save_checkpoint(int32_t slot, std::vector<uint8_t>& out) override {
        if (!info_.supports_checkpoints) return Status::unsupported;
        const size_t need = llama_state_seq_get_size_ext(ctx_.get(), slot, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
        if (need == 0) return Status::engine_error;
        out.resize(need);
        const size_t wrote =
            llama_state_seq_get_data_ext(ctx_.get(), out.data(), out.size(), slot, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
        if (wrote == 0 || wrote > need) return Status::engine_error;
        out.resize(wrote);
        return Status::ok;
    }

    /// Loads the window cells / recurrent state saved at `pos` (they replace the sequence's;
    /// the full-attention cells stay), then drops every cell at >= pos: the slot is as it was
    /// when the checkpoint was taken (the caller checked that it holds the same first `pos`
    /// ids). A recurrent cell restored at pos - 1 is outside seq_rm's [pos, end) range.
    Status restore_checkpoint(int32_t slot, int64_t pos, const std::vector<uint8_t>& in) override {
        if (!info_.supports_checkpoints) return Status::unsupported;
        if (pos <= 0 || pos > pos_[idx(slot)] || in.empty()) return Status::unsupported;
        out_idx_[idx(slot)] = -1;
        const size_t read =
            llama_state_seq_set_data_ext(ctx_.get(), in.data(), in.size(), slot, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
        const bool ok = read == in.size() && llama_memory_seq_rm(mem(), slot, static_cast<llama_pos>(pos), -1) &&
                        llama_memory_seq_pos_max(mem(), slot) == static_cast<llama_pos>(pos - 1);
        if (!ok) {
            llama_memory_seq_rm(mem(), slot, -1, -1);
            pos_[idx(slot)] = 0;
            return Status::engine_error;
        }
        pos_[idx(slot)] = pos;
        return Status::ok;
    }

    Status step(const StepItem* items, size_t n) override {
        // Fill one batch over every slot of the step, in increasing slot (sequence id) order.
        // WHY: with per-sequence KV streams (kv_unified = false) llama.cpp splits a batch into
        // micro-batches of sequences whose ids are consecutive in batch order
        // (llama_batch_allocr::split_equal, sequential). Four decodes given as slots 2,0,1,3
        // become two llama graph computes per step instead of one; sorted, they are one.
        // Deterministic mode: one llama_decode per item instead (see decode_each()).
        order_.resize(n);
        for (size_t i = 0; i < n; ++i) order_[i] = i;
        std::sort(order_.begin(), order_.end(), [items](size_t a, size_t b) { return items[a].slot < items[b].slot; });
        pre_pos_.assign(n, 0);
        int64_t total = 0;
        for (const size_t i : order_) {
            const StepItem& it = items[i];
            const int64_t p0 = pos_[idx(it.slot)];
            if (p0 + static_cast<int64_t>(it.n) > n_ctx_seq_) return Status::context_full;
            total += static_cast<int64_t>(it.n);
            if (total > n_batch_) return Status::engine_error;  // scheduler bug
            for (size_t j = 0; j < it.n; ++j)
                if (it.tokens[j] < 0 || it.tokens[j] >= n_vocab_) return Status::invalid_token;
            pre_pos_[i] = p0;
        }
        const auto t_begin = std::chrono::steady_clock::now();
        const int32_t rc = cfg_.deterministic ? decode_each(items, n) : decode_items(items, order_.data(), n);
        if (profile_) note_step(t_begin, items, n);
        llama_log::abort_fired.store(false, std::memory_order_release);  // its log lines are out
        if (rc == 0) {
            if (!cfg_.deterministic) {
                std::fill(out_idx_.begin(), out_idx_.end(), -1);
                int32_t at = 0;
                for (const size_t i : order_) {
                    const StepItem& it = items[i];
                    at += static_cast<int32_t>(it.n);
                    if (it.logits || it.all_logits) out_idx_[idx(it.slot)] = at - 1;
                    out_n_[idx(it.slot)] = it.all_logits ? static_cast<int32_t>(it.n) : 1;
                }
            }
            for (const size_t i : order_) pos_[idx(items[i].slot)] += static_cast<int64_t>(items[i].n);
            return Status::ok;
        }
        // Failed or aborted: llama.cpp kept the micro-batches it finished. Roll every sequence
        // of the batch back to its pre-step position so nothing of this step stays resident.
        bool rolled_back = true;
        std::fill(out_idx_.begin(), out_idx_.end(), -1);
        for (size_t i = 0; i < n; ++i) {
            const int32_t s = items[i].slot;
            if (!llama_memory_seq_rm(mem(), s, static_cast<llama_pos>(pre_pos_[i]), -1)) {
                rolled_back = false;
                pos_[idx(s)] = static_cast<int64_t>(llama_memory_seq_pos_max(mem(), s)) + 1;
            }
        }
        if (!rolled_back) {
            std::fprintf(stderr, "trioserve-llama-worker: could not roll back a failed step (rc %d)\n", rc);
            return Status::engine_error;
        }
        if (rc == 2) return Status::aborted;
        if (rc == 1) return Status::context_full;
        std::fprintf(stderr, "trioserve-llama-worker: llama_decode returned %d\n", rc);
        return Status::engine_error;
    }

    /// Parses `grammar` into a grammar sampler (nullptr and `error` when it does not parse).
    /// Thread-safe: reads the vocabulary only; the log capture is per thread.
    llama_sampler* make_grammar(const std::string& grammar, std::string& error) const {
        if (std::string hazard = grammar_hazard(grammar); !hazard.empty()) {
            error = hazard;
            return nullptr;
        }
        // llama.cpp reports parse errors through its log; they are collected as the
        // request's error message.
        std::string log;
        llama_log::capture = &log;
        llama_sampler* g = llama_sampler_init_grammar(vocab_, grammar.c_str(), "root");
        llama_log::capture = nullptr;
        if (!g) {
            while (!log.empty() && (log.back() == '\n' || log.back() == ' ')) log.pop_back();
            error = log.empty() ? std::string("llama.cpp rejected it") : log;
        }
        return g;
    }

    bool validate_grammar(const std::string& grammar, std::string& error) const override {
        llama_sampler_ptr g(make_grammar(grammar, error));
        return g != nullptr;
    }

    std::unique_ptr<Sampler> new_sampler(const SamplingParams& p, const std::string& grammar, std::string& error) override {
        llama_sampler* g = nullptr;
        if (!grammar.empty()) {
            g = make_grammar(grammar, error);
            if (!g) return nullptr;
        }
        llama_sampler_chain_params cp = llama_sampler_chain_default_params();
        cp.no_perf = true;
        auto s = std::make_unique<LlamaSampler>(llama_sampler_chain_init(cp), g);  // owns g from here
        if (!s->chain()) { error = "could not create a sampler chain"; return nullptr; }
        if (!p.logit_bias.empty()) {
            // First in the chain, so every later stage (greedy, top-k, ...) sees the biased
            // logits: -100 effectively bans a token even at temperature 0. The greedy fast path
            // reads the raw row, so a biased chain always runs through the candidates array;
            // speculative verification picks through the same chain (pick()), so drafts are
            // accepted exactly as plain decoding with the bias would choose.
            std::vector<llama_logit_bias> bias;
            bias.reserve(p.logit_bias.size());
            for (const auto& [id, b] : p.logit_bias) bias.push_back({id, b});
            llama_sampler_chain_add(s->chain(), llama_sampler_init_logit_bias(n_vocab_, static_cast<int32_t>(bias.size()),
                                                                              bias.data()));
        }
        if (p.temperature <= 0.0f) {
            llama_sampler_chain_add(s->chain(), llama_sampler_init_greedy());
            s->greedy_ = greedy_fast_path_ && p.logit_bias.empty();
        } else {
            if (p.top_k > 0) llama_sampler_chain_add(s->chain(), llama_sampler_init_top_k(p.top_k));
            if (p.top_p < 1.0f) llama_sampler_chain_add(s->chain(), llama_sampler_init_top_p(p.top_p, 1));
            llama_sampler_chain_add(s->chain(), llama_sampler_init_temp(p.temperature));
            llama_sampler_chain_add(s->chain(), llama_sampler_init_dist(p.seed));
        }
        return s;
    }

    /// Samples this slot's next token and accepts it (chain state, grammar state, veto):
    /// begin_sample() and, when it defers, finish_sample() at once on this thread.
    ///
    /// Constrained: the chain samples from the UNMASKED logits first and the grammar checks
    /// only that token (a one-candidate array); only when the grammar rejects it is the grammar
    /// applied to the whole vocabulary and the chain run again on the masked candidates. Masking
    /// every token costs a grammar walk per vocabulary entry per step, and the model usually
    /// picks an allowed token anyway, so the common step checks one token instead of ~50k.
    /// Greedy picks the same token either way (the unmasked argmax, when allowed, is the masked
    /// argmax); with temperature the first draw is kept when allowed, as llama-server does.
    ///
    /// A veto (engine.h TokenVeto: unique JSON keys) is checked the same way, after the grammar:
    /// the pick must pass both; otherwise the veto masks the ids it refuses among its short
    /// refusable() list, the grammar masks the vocabulary, and the chain picks again. When the
    /// two masks together leave nothing, the veto yields: the grammar's pick is taken.
    Status sample(int32_t slot, Sampler& sampler, TokenId* out) override {
        return sample_in_both_parts(slot, sampler, out);
    }

    /// The cheap part (engine.h): the chain's pick from the unmasked logits and the one-token
    /// grammar/veto check. A refused pick defers: the logits row is copied into the sampler
    /// (a 49k-float memcpy) and the mask is finish_sample()'s. The chain has then drawn once
    /// (its RNG advanced), exactly as in the one-thread sequence.
    Status begin_sample(int32_t slot, Sampler& sampler, TokenId* out, bool* deferred) override {
        *deferred = false;
        auto& s = static_cast<LlamaSampler&>(sampler);
        const float* logits = logits_of(slot);
        if (logits == nullptr) return Status::engine_error;
        const StageTimer timed(profile_, profile_sample_ns_);
        llama_token token = 0;
        if (!pick(s, logits, &token)) return Status::engine_error;
        llama_sampler* g = s.grammar();
        TokenVeto* veto = s.veto();
        bool allowed = true;
        if (g != nullptr) {
            llama_token_data single{token, 1.0f, 0.0f};
            llama_token_data_array one{&single, 1, -1, false};
            llama_sampler_apply(g, &one);
            allowed = !(std::isinf(one.data[0].logit) && one.data[0].logit < 0);
        }
        if (allowed && veto != nullptr) allowed = veto->allows(token);
        if (!allowed) {
            s.deferred_logits_.assign(logits, logits + n_vocab_);
            *deferred = true;
            return Status::ok;
        }
        accept(s, token);
        *out = token;
        return Status::ok;
    }

    /// Speculative verification (engine.h): the chain's pick from the logits at position i of
    /// the slot's last item, exactly begin_sample()'s unconstrained path. Generations with a
    /// grammar or a veto are never drafted: unsupported.
    Status sample_draft(int32_t slot, size_t i, Sampler& sampler, TokenId* out) override {
        auto& s = static_cast<LlamaSampler&>(sampler);
        if (s.grammar() != nullptr || s.veto() != nullptr) return Status::unsupported;
        if (cfg_.deterministic) return Status::unsupported;  // its logits are copied per slot, one row
        const int32_t last = out_idx_[idx(slot)];
        const int32_t n = out_n_[idx(slot)];
        if (last < 0 || static_cast<int32_t>(i) >= n) return Status::engine_error;
        const float* logits = llama_get_logits_ith(ctx_.get(), last - n + 1 + static_cast<int32_t>(i));
        if (logits == nullptr) return Status::engine_error;
        const StageTimer timed(profile_, profile_sample_ns_);
        llama_token token = 0;
        if (!pick(s, logits, &token)) return Status::engine_error;
        accept(s, token);
        *out = token;
        return Status::ok;
    }

    /// Speculation's exactness self-check (engine.h): the same step() path as service, so the
    /// batches, and with them llama.cpp's kernel choices, are the ones drafting would use.
    Status check_verify_exact(int32_t slot, const std::vector<TokenId>& ids, size_t depth, size_t n,
                              bool* same, std::string& detail) override {
        *same = true;
        if (n == 0 || depth + n > ids.size()) return Status::engine_error;
        if (cfg_.deterministic) return Status::unsupported;  // never drafts (sample_draft())
        Status st = reset(slot);
        for (size_t at = 0; st == Status::ok && at < depth;) {  // the context, a batch at a time
            const size_t piece = std::min<size_t>(depth - at, static_cast<size_t>(n_batch_));
            const StepItem it{slot, ids.data() + at, piece, false, true};
            st = step(&it, 1);
            at += piece;
        }
        std::vector<std::vector<float>> plain(n);
        for (size_t j = 0; st == Status::ok && j < n; ++j) {
            const StepItem it{slot, ids.data() + depth + j, 1, true, false};
            st = step(&it, 1);
            const float* row = st == Status::ok ? logits_of(slot) : nullptr;
            if (st == Status::ok && row == nullptr) st = Status::engine_error;
            if (st == Status::ok) plain[j].assign(row, row + n_vocab_);
        }
        if (st == Status::ok) st = truncate(slot, static_cast<int64_t>(depth));
        if (st == Status::ok) {
            const StepItem it{slot, ids.data() + depth, n, true, false, true};
            st = step(&it, 1);
        }
        const int32_t last = out_idx_[idx(slot)];
        for (size_t j = 0; st == Status::ok && *same && j < n; ++j) {
            const float* row = llama_get_logits_ith(ctx_.get(), last - static_cast<int32_t>(n - 1 - j));
            if (row == nullptr) {
                st = Status::engine_error;
                break;
            }
            size_t differ = 0;
            float worst = 0;
            for (int32_t v = 0; v < n_vocab_; ++v) {
                if (std::memcmp(&row[v], &plain[j][static_cast<size_t>(v)], sizeof(float)) == 0) continue;
                ++differ;
                worst = std::max(worst, std::fabs(row[v] - plain[j][static_cast<size_t>(v)]));
            }
            if (differ == 0) continue;
            *same = false;
            char buf[200];
            std::snprintf(buf, sizeof buf, "position %zu of %zu at a %zu-token context: %zu of %d logits differ, by up to %.3g",
                          j, n, depth, differ, n_vocab_, static_cast<double>(worst));
            detail = buf;
        }
        const Status cleared = reset(slot);
        return st != Status::ok ? st : cleared;
    }

    /// The costly part (engine.h; any thread): the veto's and the grammar's masks over the whole
    /// vocabulary of the kept logits row, the chain's second pick, accept. Touches only `sampler`
    /// and the vocabulary (llama.cpp's grammar apply/accept read the vocab's token texts and
    /// end-of-generation set, both fixed at load; the chain's samplers are the generation's own).
    Status finish_sample(Sampler& sampler, TokenId* out) const override {
        auto& s = static_cast<LlamaSampler&>(sampler);
        if (s.deferred_logits_.size() != static_cast<size_t>(n_vocab_)) return Status::engine_error;
        const float* logits = s.deferred_logits_.data();
        llama_sampler* g = s.grammar();
        TokenVeto* veto = s.veto();
        // fill_candidates() puts id t at index t (the veto's mask relies on it).
        llama_token_data_array cur = fill_candidates(s.mask_candidates_, logits);
        if (veto != nullptr)
            for (TokenId t : veto->refusable())
                if (!veto->allows(t)) cur.data[static_cast<size_t>(t)].logit = -INFINITY;
        if (g != nullptr) llama_sampler_apply(g, &cur);
        if (veto != nullptr && !any_finite(cur)) {  // nothing left: the veto yields
            cur = fill_candidates(s.mask_candidates_, logits);
            if (g != nullptr) llama_sampler_apply(g, &cur);
        }
        llama_sampler_apply(s.chain(), &cur);
        if (cur.selected < 0 || static_cast<size_t>(cur.selected) >= cur.size) return Status::engine_error;
        const llama_token token = cur.data[cur.selected].id;
        accept(s, token);
        *out = token;
        return Status::ok;
    }

    /// The chain's pick from an unmasked logits row. Greedy (the fast path, what llama-server's
    /// greedy sampling amounts to): the first maximum of the row, read in place: the same token
    /// as llama.cpp's greedy sampler over the candidates array (it keeps the first of equal
    /// logits too), without writing 49k candidates first. Any other chain gets the candidates.
    bool pick(LlamaSampler& s, const float* logits, llama_token* token) {
        if (s.greedy_) {
            *token = greedy_pick(logits, n_vocab_);
            return true;
        }
        llama_token_data_array cur = fill_candidates(candidates_, logits);
        llama_sampler_apply(s.chain(), &cur);
        if (cur.selected < 0 || static_cast<size_t>(cur.selected) >= cur.size) return false;
        *token = cur.data[cur.selected].id;
        return true;
    }

    /// The chosen token advances the grammar, the veto and the chain (in this order, as before
    /// the split).
    static void accept(LlamaSampler& s, llama_token token) {
        if (s.grammar() != nullptr) llama_sampler_accept(s.grammar(), token);
        if (s.veto() != nullptr) s.veto()->accept(token);
        llama_sampler_accept(s.chain(), token);
    }

    static bool any_finite(const llama_token_data_array& cur) {
        for (size_t k = 0; k < cur.size; ++k)
            if (!(std::isinf(cur.data[k].logit) && cur.data[k].logit < 0)) return true;
        return false;
    }

    /// The start-up check of the kernel path, as llama-server warms up: a real prefill of a
    /// short prompt (a multi-token batch: the matrix-matrix kernels) in slot 0, then
    /// `decode_steps` greedy decode steps (one token: the matrix-vector kernels), then slot 0
    /// is cleared. `after_prefill` runs between the two (the probe's fault injection).
    /// Returns "" when every step succeeded and every logit was finite, else what failed. A
    /// broken kernel may also crash the process here: the probe (kernel_probe.h) exists for that.
    /// `prompt_cap` cuts the prompt (at least one token): a light warm-up for kernels a probe of
    /// this very setup already ran.
    std::string warm_up(int decode_steps, size_t prompt_cap = SIZE_MAX,
                        const std::function<void()>& after_prefill = {}) {
        std::vector<TokenId> prompt;
        // ~40 tokens: enough rows for the batched (gemm) kernel variants.
        const char* text = "Start-up check: the server runs one short prompt through the model before it serves, "
                           "so that a kernel that fails shows here and not on a request.";
        if (tokenize(text, false, prompt) != Status::ok || prompt.empty()) return "could not tokenize the warm-up prompt";
        if (static_cast<int64_t>(prompt.size()) > n_batch_) prompt.resize(static_cast<size_t>(n_batch_));
        if (prompt.size() > prompt_cap) prompt.resize(std::max<size_t>(prompt_cap, 1));
        std::string err;
        std::unique_ptr<Sampler> sampler = new_sampler(SamplingParams{}, "", err);
        if (!sampler) return "could not create a sampler: " + err;
        std::string failure;
        auto run = [&](const TokenId* t, size_t n, bool prefill) {
            StepItem item{0, t, n, true, prefill};
            const Status st = step(&item, 1);
            if (st != Status::ok) return std::string("warm-up step failed: ") + status_name(st);
            const float* logits = logits_of(0);
            if (logits == nullptr) return std::string("warm-up step produced no logits");
            for (int32_t v = 0; v < n_vocab_; ++v)
                if (!std::isfinite(logits[v])) return std::string("warm-up step produced non-finite logits");
            return std::string();
        };
        reset(0);
        failure = run(prompt.data(), prompt.size(), true);
        if (failure.empty() && after_prefill) after_prefill();
        for (int i = 0; failure.empty() && i < decode_steps; ++i) {
            TokenId next = 0;
            if (sample(0, *sampler, &next) != Status::ok) { failure = "warm-up sampling failed"; break; }
            failure = run(&next, 1, false);
        }
        reset(0);
        return failure;
    }

    void request_abort() override { abort_.store(true, std::memory_order_release); }
    void clear_abort() override { abort_.store(false, std::memory_order_release); }
    uint64_t work_done() const override { return work_.load(std::memory_order_relaxed); }

    /// With `parse_special`, a long text is tokenized in pieces of about kSpecialPieceBytes,
    /// cut where a special token starts: llama.cpp's special-token partitioning copies the
    /// rest of the text at every special token it finds, so one call over a text made of
    /// many special tokens costs their number times its length (20,000 empty
    /// chat messages took 14.7 s, uncancellable). Cut only where the result is the same as
    /// one call's (safe_cut), so pieces make it linear without changing a token.
    Status tokenize(const std::string& text, bool parse_special, std::vector<TokenId>& out) const override {
        return tokenize_pieces(text, parse_special, out, nullptr);
    }

    /// Checks `stop` before each piece (special-parsed text: every ~kSpecialPieceBytes).
    /// Plain text is one llama_tokenize call (a cut could change its merges), uncancellable.
    Status tokenize_cancellable(const std::string& text, bool parse_special, std::vector<TokenId>& out,
                                const std::atomic<bool>& stop) const override {
        return tokenize_pieces(text, parse_special, out, &stop);
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

private:
    Status tokenize_pieces(const std::string& text, bool parse_special, std::vector<TokenId>& out,
                           const std::atomic<bool>* stop) const {
        if (stop != nullptr && stop->load(std::memory_order_acquire)) return Status::aborted;
        if (!parse_special || text.size() <= kSpecialPieceBytes)
            return tokenize_piece(text.data(), text.size(), parse_special, out);
        size_t start = 0;
        while (start < text.size()) {
            if (stop != nullptr && stop->load(std::memory_order_acquire)) return Status::aborted;
            const size_t cut = next_safe_cut(text, start + kSpecialPieceBytes);
            const size_t end = cut == std::string::npos ? text.size() : cut;
            if (const Status s = tokenize_piece(text.data() + start, end - start, true, out); s != Status::ok) return s;
            start = end;
        }
        return Status::ok;
    }

    static constexpr size_t kSpecialPieceBytes = 4096;

    /// One llama_tokenize call (the size-query idiom: a negative result is the count needed).
    Status tokenize_piece(const char* text, size_t size, bool parse_special, std::vector<TokenId>& out) const {
        if (size == 0) return Status::ok;
        const int32_t len = static_cast<int32_t>(size);
        const size_t base = out.size();
        out.resize(base + size + 8);
        int32_t n = llama_tokenize(vocab_, text, len, out.data() + base, static_cast<int32_t>(out.size() - base),
                                   /*add_special=*/false, parse_special);
        if (n < 0) {
            out.resize(base + static_cast<size_t>(-n));
            n = llama_tokenize(vocab_, text, len, out.data() + base, -n, false, parse_special);
        }
        if (n < 0) { out.resize(base); return Status::engine_error; }
        out.resize(base + static_cast<size_t>(n));
        return Status::ok;
    }

    /// The first position >= `from` where `text` may be cut without changing its special
    /// tokenization, or npos. A cut at p is safe when a special token S starts at p (so the
    /// right piece starts with a special token either way: no space prefix differs), S does
    /// not strip whitespace to its left (LSTRIP would reach into the left piece), and no
    /// occurrence of any special token spans p (so every match lies in one piece, found in
    /// the same order). Linear: positions are tested by a first-byte table.
    size_t next_safe_cut(const std::string& text, size_t from) const {
        for (size_t p = from; p < text.size(); ++p) {
            if (!special_first_byte_[static_cast<unsigned char>(text[p])]) continue;
            bool starts = false;
            for (const SpecialText& s : specials_) {
                if (!s.lstrip && text.compare(p, s.text.size(), s.text) == 0) { starts = true; break; }
            }
            if (!starts) continue;
            bool spanned = false;
            for (const SpecialText& t : specials_) {
                const size_t first = p >= t.text.size() ? p - t.text.size() + 1 : 0;
                for (size_t q = first; q < p && !spanned; ++q)
                    spanned = text.compare(q, t.text.size(), t.text) == 0;
                if (spanned) break;
            }
            if (!spanned) return p;
        }
        return std::string::npos;
    }

    struct SpecialText {
        std::string text;
        bool lstrip = false;
    };
    std::vector<SpecialText> specials_;   ///< what llama.cpp's special partitioning matches
    bool special_first_byte_[256] = {};

    /// One llama_decode over the items `sel[0..n)` (checked by step()): returns its code.
    int32_t decode_items(const StepItem* items, const size_t* sel, size_t n) {
        llama_batch& b = batch_;
        int32_t k = 0;
        for (size_t q = 0; q < n; ++q) {
            const StepItem& it = items[sel[q]];
            const int64_t p0 = pos_[idx(it.slot)];
            for (size_t j = 0; j < it.n; ++j) {
                b.token[k] = it.tokens[j];
                b.pos[k] = static_cast<llama_pos>(p0 + static_cast<int64_t>(j));
                b.n_seq_id[k] = 1;
                b.seq_id[k][0] = it.slot;
                b.logits[k] = it.all_logits || (it.logits && j + 1 == it.n);
                ++k;
            }
        }
        b.n_tokens = k;
        return llama_decode(ctx_.get(), b);
    }

    /// Deterministic mode: each item (in slot order) is its own llama_decode, so the matrix
    /// shapes, the kernels they select and the micro-batch cuts of a slot's tokens are the same
    /// whatever else the step holds (llama.cpp splits a multi-sequence batch into micro-batches
    /// with equally many tokens of every sequence, and ggml picks kernels by row count). The
    /// logits row of each item that wants one is copied out before the next call overwrites
    /// it. Stops at the first failing call (step() rolls every item back).
    int32_t decode_each(const StepItem* items, size_t n) {
        std::fill(out_idx_.begin(), out_idx_.end(), -1);
        for (size_t q = 0; q < n; ++q) {
            const size_t i = order_[q];
            const int32_t rc = decode_items(items, &i, 1);
            if (rc != 0) return rc;
            const StepItem& it = items[i];
            if (!it.logits) continue;
            const float* row = llama_get_logits_ith(ctx_.get(), static_cast<int32_t>(it.n) - 1);
            if (row == nullptr) return -1;
            std::vector<float>& keep = own_logits_[idx(it.slot)];
            keep.assign(row, row + n_vocab_);
            out_idx_[idx(it.slot)] = 0;
        }
        return 0;
    }

    /// The logits row of `slot`'s last item with logits (null when none).
    const float* logits_of(int32_t slot) {
        const int32_t i = out_idx_[idx(slot)];
        if (i < 0) return nullptr;
        if (cfg_.deterministic) return own_logits_[idx(slot)].data();
        return llama_get_logits_ith(ctx_.get(), i);
    }

    static size_t idx(int32_t slot) { return static_cast<size_t>(slot); }
    llama_memory_t mem() const { return llama_get_memory(ctx_.get()); }

    /// ggml's CPU backend calls this on its first thread after every graph node, so besides
    /// stopping a step we asked to stop it counts the nodes computed: work_done() for the
    /// heartbeat (a step that computes moves it, a stuck one does not). GPU backends do not
    /// call it: there the count stands still inside a step, whose steps take milliseconds.
    static bool abort_cb(void* data) {
        auto* self = static_cast<LlamaEngine*>(data);
        self->work_.fetch_add(1, std::memory_order_relaxed);
        if (!self->abort_.load(std::memory_order_acquire)) return false;
        llama_log::abort_fired.store(true, std::memory_order_release);
        return true;
    }

    static bool env_is(const char* name, const char* value) {
        const char* v = std::getenv(name);
        return v != nullptr && std::strcmp(v, value) == 0;
    }

    /// Profile bookkeeping of one step that began at `t_begin`. A decode run is a sequence of
    /// decode steps (every item one token); each step notes its llama_decode time, the time
    /// since the previous one ended (the worker loop's own work between steps: sampling,
    /// records, pipe writes, input) and the sampling inside that gap. The run's medians go to
    /// stderr when it ends (the next step that is not a decode step) and when the engine goes.
    /// Medians, not means: on a shared host a preempted gap is milliseconds, not loop work.
    void note_step(std::chrono::steady_clock::time_point t_begin, const StepItem* items, size_t n) {
        using namespace std::chrono;
        const auto t_end = steady_clock::now();
        bool decode = n > 0;
        for (size_t i = 0; i < n; ++i) decode = decode && items[i].n == 1;
        const auto us = [](steady_clock::duration d) { return duration_cast<duration<double, std::micro>>(d).count(); };
        if (!decode) report_profile();
        if (decode) {
            if (!prof_.decode_us.empty()) {
                prof_.gap_us.push_back(us(t_begin - prof_.last_end));
                prof_.sample_us.push_back(static_cast<double>(profile_sample_ns_ - prof_.sample_mark) / 1e3);
            }
            prof_.decode_us.push_back(us(t_end - t_begin));
            prof_.tokens += n;
        }
        prof_.last_end = t_end;
        prof_.sample_mark = profile_sample_ns_;
    }

    /// Writes the decode run's medians (nothing for a run of fewer than 2 steps) and clears it.
    void report_profile() {
        if (prof_.decode_us.size() >= 2) {
            const auto med = [](std::vector<double> v) {
                std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
                return v[v.size() / 2];
            };
            std::fprintf(stderr,
                         "trioserve-llama-worker: profile: decode run of %zu steps (%llu tokens): llama_decode %.1f "
                         "us/step; between steps %.1f us/step, of which sampling %.1f us/step (medians; %s)\n",
                         prof_.decode_us.size(), static_cast<unsigned long long>(prof_.tokens), med(prof_.decode_us),
                         med(prof_.gap_us), med(prof_.sample_us),
                         greedy_fast_path_ ? "greedy fast path on" : "greedy fast path off");
        }
        prof_.decode_us.clear();
        prof_.gap_us.clear();
        prof_.sample_us.clear();
        prof_.tokens = 0;
    }

    std::string meta(const char* key) const {
        char buf[512];
        int32_t n = llama_model_meta_val_str(model_.get(), key, buf, sizeof buf);
        return n >= 0 ? std::string(buf) : std::string();
    }

    /// The candidates array over `logits` (every vocabulary entry), in the reused buffer.
    /// `buf` = one candidate per vocabulary id, id t at index t, with `logits`.
    llama_token_data_array fill_candidates(std::vector<llama_token_data>& buf, const float* logits) const {
        buf.resize(static_cast<size_t>(n_vocab_));
        for (int32_t t = 0; t < n_vocab_; ++t) buf[static_cast<size_t>(t)] = llama_token_data{t, logits[t], 0.0f};
        return llama_token_data_array{buf.data(), buf.size(), -1, false};
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
        info_.n_ctx_train = llama_model_n_ctx_train(model_.get());
        const uint64_t f16_estimate = kv_bytes_per_token(model_.get()) * static_cast<uint64_t>(n_ctx_seq_ * cfg_.capacity);
        info_.kv_cache_bytes = kv_bytes_as(cfg_.kv_cache_type, f16_estimate);
        info_.kv_cache_type = kv_cache_type_name(cfg_.kv_cache_type);
        // What llama.cpp reported allocating, when it did (exact, also for a small window
        // cache, whose layer split the estimate cannot know); the estimate otherwise.
        if (llama_log::kv_cache_mib > 0) {
            const uint64_t full = info_.kv_cache_bytes;
            info_.kv_cache_bytes = static_cast<uint64_t>(llama_log::kv_cache_mib * (1 << 20));
            if (llama_model_n_swa(model_.get()) > 0)
                std::fprintf(stderr, "trioserve-llama-worker: KV cache allocated: %.0f MiB (%s window cache; every "
                             "layer at full size: ~%.0f MiB)\n", llama_log::kv_cache_mib,
                             swa_full_ ? "full-size" : "small", static_cast<double>(full) / (1 << 20));
        }
        if (cfg_.kv_cache_type != KvCacheType::f16) {
            // The f16 cache of the same cells: the allocation scaled back by the block sizes.
            const double mib = static_cast<double>(info_.kv_cache_bytes) / (1 << 20);
            const double f16_mib = mib * 64.0 / static_cast<double>(kv_block_bytes(cfg_.kv_cache_type));
            std::fprintf(stderr, "trioserve-llama-worker: KV cache %s: %.1f MiB, %.1f MiB less than at f16 (%.1f MiB); "
                         "flash attention on\n", info_.kv_cache_type.c_str(), mib, f16_mib - mib, f16_mib);
        }
        info_.recurrent_state_bytes = static_cast<uint64_t>(llama_log::recurrent_state_mib * (1 << 20));
        info_.attention_matrix_bytes = attention_matrix_bytes(cfg_, model_.get(), llama_n_ubatch(ctx_.get()), n_ctx_seq_);
        info_.capacity = cfg_.capacity;
        info_.n_vocab = llama_vocab_n_tokens(vocab_);
        n_vocab_ = static_cast<int32_t>(info_.n_vocab);
        info_.max_step_tokens = n_batch_;
        info_.supports_truncate = true;  // per call: truncate() reports unsupported when seq_rm refuses
        recurrent_ = llama_model_is_recurrent(model_.get()) || llama_model_is_hybrid(model_.get());
        // A loaded state can be cut back anywhere only with plain full attention: recurrent
        // state has no per-position history, and a sliding-window cache keeps only the last
        // window of cells (spec §6.2).
        info_.trims_any_state = !recurrent_ && llama_model_n_swa(model_.get()) == 0;
        info_.n_swa = std::max<int32_t>(0, llama_model_n_swa(model_.get()));
        if (info_.n_swa > 0) info_.swa_cache = swa_full_ ? "full" : "checkpoints";
        // Checkpoints (spec §6.3) of what seq_rm cannot cut back: a small window cache's
        // window cells, and a recurrent state (hybrid and purely recurrent memory). With
        // PARTIAL_ONLY a hybrid memory writes and reads only its recurrent part (and an iSWA
        // attention part its window cells); restoring it into a sequence that holds the same
        // first P ids and removing the attention cells >= P leaves the sequence at P
        // (llama_memory_hybrid::state_read/seq_rm: the recurrent state_read clears only the
        // recurrent cell of the sequence; recurrent seq_rm(P, -1) of a cell at P-1 is a
        // no-op). Not for a hybrid model with a full-size window cache: its window part is
        // n_ctx cells a checkpoint.
        info_.supports_checkpoints = recurrent_ ? (info_.n_swa == 0 || !swa_full_) : (info_.n_swa > 0 && !swa_full_);
        if (info_.supports_checkpoints)
            info_.checkpoint_kind = !recurrent_ ? "window" : info_.n_swa > 0 ? "recurrent+window" : "recurrent";
        info_.supports_grammar = true;
        info_.supports_token_veto = true;
        info_.supports_logit_bias = true;
        // Rejected draft tokens are removed with llama_memory_seq_rm: not for recurrent state.
        info_.supports_speculation = !recurrent_;
        const llama_token bos = llama_vocab_bos(vocab_), eos = llama_vocab_eos(vocab_);
        if (bos != LLAMA_TOKEN_NULL) { info_.bos_id = bos; info_.bos_text = piece_text(bos); }
        if (eos != LLAMA_TOKEN_NULL) { info_.eos_id = eos; info_.eos_text = piece_text(eos); }
        // FIM ids come from the GGUF metadata, or from llama.cpp's detection of the usual
        // token texts (<fim_prefix>, <|fim_prefix|>, <PRE>, ...) when the metadata has none.
        const llama_token pre = llama_vocab_fim_pre(vocab_), suf = llama_vocab_fim_suf(vocab_),
                          mid = llama_vocab_fim_mid(vocab_);
        if (pre != LLAMA_TOKEN_NULL && suf != LLAMA_TOKEN_NULL && mid != LLAMA_TOKEN_NULL) {
            info_.fim_pre_id = pre; info_.fim_suf_id = suf; info_.fim_mid_id = mid;
        }
        if (const char* t = llama_model_chat_template(model_.get(), nullptr)) info_.chat_template = std::string(t);
        // The tokens llama.cpp's special-token partitioning matches (the same attribute
        // test), less those plain tokenization of their text gives anyway (Gemma's
        // whitespace runs and HTML tags are user-defined pieces of ordinary text): what is
        // left is what special parsing adds, the tokens request text must never become.
        const auto special_attrs = LLAMA_TOKEN_ATTR_CONTROL | LLAMA_TOKEN_ATTR_USER_DEFINED | LLAMA_TOKEN_ATTR_UNKNOWN;
        std::vector<TokenId> plain;
        for (llama_token id = 0; id < n_vocab_; ++id) {
            if (!(llama_vocab_get_attr(vocab_, id) & special_attrs)) continue;
            const char* text = llama_vocab_get_text(vocab_, id);
            if (text == nullptr || *text == '\0') continue;
            specials_.push_back({text, (llama_vocab_get_attr(vocab_, id) & LLAMA_TOKEN_ATTR_LSTRIP) != 0});
            special_first_byte_[static_cast<unsigned char>(text[0])] = true;
            plain.clear();
            if (tokenize(text, /*parse_special=*/false, plain) == Status::ok && plain.size() == 1 && plain[0] == id)
                continue;
            info_.control_texts.emplace_back(text);
        }
        std::string piece;
        for (llama_token id = 0; id < n_vocab_; ++id) {
            piece.clear();
            token_bytes(id, piece);
            info_.max_token_bytes = std::max<int64_t>(info_.max_token_bytes, static_cast<int64_t>(piece.size()));
        }
    }

    LlamaConfig cfg_;
    std::string error_;
    llama_model_ptr model_;
    llama_context_ptr ctx_;
    const llama_vocab* vocab_ = nullptr;
    int32_t n_vocab_ = 0;
    bool recurrent_ = false;  ///< recurrent or hybrid memory: no partial truncation
    bool swa_full_ = true;    ///< the sliding-window layers keep a full-size cache (resolve_swa_full())
    int64_t n_ctx_seq_ = 0;
    int32_t n_batch_ = 0;
    llama_batch batch_{};
    bool has_batch_ = false;
    std::vector<int64_t> pos_;      ///< per slot: tokens resident
    std::vector<int32_t> out_idx_;  ///< per slot: batch index of its logits in the last step, -1 none
    std::vector<std::vector<float>> own_logits_;  ///< deterministic mode: per slot, its last logits row
    std::vector<int32_t> out_n_;    ///< per slot: positions with logits ending at out_idx_ (all_logits: the item's n)
    std::vector<int64_t> pre_pos_;  ///< per item of the running step: position before it
    std::vector<size_t> order_;     ///< the running step's item indices in increasing slot order
    std::vector<llama_token_data> candidates_;  ///< begin_sample()'s scratch (loop thread): one entry per vocabulary token
    bool greedy_fast_path_ = true;  ///< greedy chains pick from the logits row in place (pick())
    bool profile_ = false;          ///< TRIOSERVE_LLAMA_PROFILE=1: per-stage timers (note_step())
    uint64_t profile_sample_ns_ = 0;
    struct Profile {  ///< the running decode run (note_step())
        std::vector<double> decode_us, gap_us, sample_us;
        uint64_t tokens = 0, sample_mark = 0;
        std::chrono::steady_clock::time_point last_end{};
    } prof_;
    std::atomic<bool> abort_{false};
    std::atomic<uint64_t> work_{0};  ///< graph nodes computed (abort_cb): work_done()
    EngineInfo info_;
};

}  // namespace trioserve
