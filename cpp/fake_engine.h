// fake_engine.h — a deterministic Engine for tests (spec §10).
//
// Tokenizer: one token per UTF-8 byte (id = byte value), id 256 = EOS, so multi-byte
// characters are split across tokens and exercise UTF-8 assembly. Output: with a script
// (array of strings) generation k emits script[k % len] byte by byte, then EOS; without one
// it echoes the last 64 bytes of the prompt, then EOS. Sampling parameters do not change the
// output. Fault injection (exit/hang after N tokens) and delays are configured in FakeConfig.
//
// Threading: as engine.h. request_stop() only sets an atomic; delays sleep in short slices
// so a stop interrupts them quickly (the fake prefill is "abortable" like llama.cpp's).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "engine.h"
#include "worker_process.h"

namespace trioserve {

struct FakeConfig {
    int64_t n_ctx = 4096;               ///< context window, tokens
    int64_t capacity = 4;               ///< sessions on one "weight load"
    std::vector<std::string> script;    ///< empty: echo mode
    double token_delay_ms = 0;          ///< sleep per sampled token
    double prefill_ms_per_token = 0;    ///< sleep per prefilled token (cancellable)
    int64_t exit_after_tokens = -1;     ///< _exit(kFakeCrashStatus) when asked for token N+1 (process life)
    int64_t hang_after_tokens = -1;     ///< hang forever when asked for token N+1 (ignores cancel/EOF)
    std::string chat_template;          ///< reported in the ready record
    bool no_chat_template = false;      ///< report none (null) instead of the default
};

inline constexpr int kFakeCrashStatus = 77;
inline constexpr TokenId kFakeEos = 256;

/// A simple ChatML template (the fake tokenizer has no special tokens; they are plain text).
inline const char* kFakeChatTemplate =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

class FakeEngine;

class FakeSession : public Session {
public:
    FakeSession(FakeEngine& e, int* slots_used) : e_(e), slots_used_(slots_used) { ++*slots_used_; }
    ~FakeSession() override { --*slots_used_; }

    Status reset() override { kv_.clear(); return Status::ok; }
    int64_t position() const override { return static_cast<int64_t>(kv_.size()); }
    Status truncate(int64_t pos) override {
        if (pos < 0 || pos > position()) return Status::engine_error;
        kv_.resize(static_cast<size_t>(pos));
        return Status::ok;
    }
    Status prefill(const TokenId* ids, size_t n) override;
    Status start_generation(const SamplingParams& params) override;
    Status sample(TokenId* out) override;
    Status decode(TokenId token) override {
        if (stop_.load(std::memory_order_acquire)) return Status::aborted;
        kv_.push_back(token);
        ++out_pos_;
        return Status::ok;
    }
    void request_stop() override { stop_.store(true, std::memory_order_release); }
    void clear_stop() override { stop_.store(false, std::memory_order_release); }

private:
    // Sleeps `ms`, in slices, returning false early when a stop was requested.
    bool sleep_ms(double ms) {
        using namespace std::chrono;
        auto until = steady_clock::now() + duration_cast<steady_clock::duration>(duration<double, std::milli>(ms));
        while (steady_clock::now() < until) {
            if (stop_.load(std::memory_order_acquire)) return false;
            auto left = until - steady_clock::now();
            std::this_thread::sleep_for(std::min<steady_clock::duration>(left, milliseconds(1)));
        }
        return !stop_.load(std::memory_order_acquire);
    }

    FakeEngine& e_;
    int* slots_used_;
    std::vector<TokenId> kv_;
    std::string output_;     ///< bytes of this generation's output
    size_t out_pos_ = 0;     ///< next byte of output_ to sample
    std::atomic<bool> stop_{false};
};

class FakeEngine : public Engine {
public:
    explicit FakeEngine(FakeConfig cfg) : cfg_(std::move(cfg)) {
        info_.engine = "fake";
        info_.model_name = "fake";
        info_.architecture = "fake";
        info_.model_path = "";
        info_.n_ctx = cfg_.n_ctx;
        info_.capacity = cfg_.capacity;
        info_.n_vocab = 257;
        info_.supports_truncate = true;
        info_.eos_text = "<|im_end|>";
        info_.eos_id = kFakeEos;
        if (!cfg_.no_chat_template)
            info_.chat_template = cfg_.chat_template.empty() ? std::string(kFakeChatTemplate) : cfg_.chat_template;
    }

    const EngineInfo& info() const override { return info_; }

    std::unique_ptr<Session> create_session() override {
        if (slots_used_ >= cfg_.capacity) return nullptr;
        return std::make_unique<FakeSession>(*this, &slots_used_);
    }

    Status tokenize(const std::string& text, std::vector<TokenId>& out) const override {
        for (unsigned char c : text) out.push_back(static_cast<TokenId>(c));
        return Status::ok;
    }

    void token_bytes(TokenId id, std::string& out) const override {
        if (id >= 0 && id < 256) out.push_back(static_cast<char>(id));
    }

    bool is_end_of_generation(TokenId id) const override { return id == kFakeEos; }

    const FakeConfig& config() const { return cfg_; }

    /// Output of the next generation (advances the generation counter).
    std::string next_output(const std::vector<TokenId>& prompt) {
        if (!cfg_.script.empty()) return cfg_.script[static_cast<size_t>(generation_++ % cfg_.script.size())];
        ++generation_;
        std::string s;
        for (TokenId t : prompt) if (t >= 0 && t < 256) s.push_back(static_cast<char>(t));
        return s.size() > 64 ? s.substr(s.size() - 64) : s;
    }

    /// Fault injection point, called before each sampled token (counted over the process life).
    void before_token() {
        if (cfg_.exit_after_tokens >= 0 && tokens_ >= cfg_.exit_after_tokens) {
            std::fprintf(stderr, "fake-worker: --exit-after-tokens %lld reached; crashing\n",
                         static_cast<long long>(cfg_.exit_after_tokens));
            _exit(kFakeCrashStatus);
        }
        if (cfg_.hang_after_tokens >= 0 && tokens_ >= cfg_.hang_after_tokens) {
            std::fprintf(stderr, "fake-worker: --hang-after-tokens %lld reached; hanging\n",
                         static_cast<long long>(cfg_.hang_after_tokens));
            g_simulated_hang.store(true);
            for (;;) pause();  // only a signal ends this (SIGTERM unless --ignore-sigterm)
        }
        ++tokens_;
    }

private:
    FakeConfig cfg_;
    EngineInfo info_;
    int slots_used_ = 0;
    uint64_t generation_ = 0;
    int64_t tokens_ = 0;
};

inline Status FakeSession::prefill(const TokenId* ids, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] > kFakeEos) return Status::invalid_token;
        if (position() >= e_.info().n_ctx) return Status::context_full;
        if (e_.config().prefill_ms_per_token > 0 && !sleep_ms(e_.config().prefill_ms_per_token)) return Status::aborted;
        if (stop_.load(std::memory_order_acquire)) return Status::aborted;
        kv_.push_back(ids[i]);
    }
    return Status::ok;
}

inline Status FakeSession::start_generation(const SamplingParams&) {
    output_ = e_.next_output(kv_);
    out_pos_ = 0;
    return Status::ok;
}

inline Status FakeSession::sample(TokenId* out) {
    if (out_pos_ >= output_.size()) { *out = kFakeEos; return Status::ok; }
    e_.before_token();
    if (e_.config().token_delay_ms > 0) sleep_ms(e_.config().token_delay_ms);
    *out = static_cast<unsigned char>(output_[out_pos_]);
    return Status::ok;
}

}  // namespace trioserve
