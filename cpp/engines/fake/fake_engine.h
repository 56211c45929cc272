// fake_engine.h — a deterministic Engine for tests (spec §10).
//
// Tokenizer: one token per UTF-8 byte (id = byte value), id 256 = EOS, so multi-byte
// characters are split across tokens and exercise UTF-8 assembly; there are no special
// tokens (parse_special changes nothing). Output: with a script (array of strings) the k-th
// admitted generation (k counted in arrival order when its sampler is made) emits
// script[k % len] byte by byte, then EOS; without one it echoes the last 64 bytes of its
// slot's state once the prompt is in (= the prompt), then EOS. Sampling parameters do not
// change the output; a Sampler's TokenVeto (unique JSON keys) does: a refused scripted byte
// gives way to the next allowed byte value (see sample()). So every generation's output is
// exactly what it would be alone, however steps interleave. Fault injection (exit/hang after N tokens, counted over the process life)
// and delays are configured in FakeConfig; delays are per step (see step()), like a real
// batched forward pass.
//
// Threading: as engine.h. request_abort() only sets an atomic; delays sleep in short slices
// so an abort interrupts them quickly (the fake step is "abortable" like llama.cpp's), and
// each slice counts as work done (work_done(): a slow step makes progress, --stuck-token's
// step does not).
#pragma once

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <functional>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "engine.h"
#include "kv_cache_type.h"
#include "worker_process.h"

namespace trioserve {

struct FakeConfig {
    int64_t n_ctx = 4096;               ///< context window, tokens
    int64_t capacity = 4;               ///< slots on one "weight load"
    std::vector<std::string> script;    ///< empty: echo mode
    double token_delay_ms = 0;          ///< period of the grid the sampling steps end on (once, however many streams)
    double prefill_ms_per_token = 0;    ///< sleep per prompt token in a step (abortable)
    /// Sleep per text byte tokenized (--tokenize-us-per-byte): models a real tokenizer's cost
    /// (llama.cpp: seconds for megabytes), so tests can see where that time is spent.
    /// tokenize_cancellable() sleeps in slices of at most 10 ms and stops when asked.
    double tokenize_us_per_byte = 0;
    int64_t exit_after_tokens = -1;     ///< _exit(kFakeCrashStatus) when asked for token N+1 (process life)
    int64_t hang_after_tokens = -1;     ///< hang forever when asked for token N+1 (ignores cancel/EOF)
    int64_t signal_after_tokens = -1;   ///< die by `crash_signal` when asked for token N+1 (process life)
    int crash_signal = SIGILL;          ///< a CPU kernel fault's signal (SIGILL, SIGSEGV, ...)
    std::string chat_template;          ///< reported in the ready record
    bool no_chat_template = false;      ///< report none (null) instead of the default
    bool fim_tokens = false;            ///< add FIM tokens 257..259 (n_vocab 260)
    /// Test-only (--grammar-unenforced): report grammar support and accept a grammar without
    /// applying it, so the control plane's constrained paths run against scripted output.
    bool grammar_unenforced = false;
    bool record_steps = false;          ///< keep a log of every step (unit tests)
    /// Model a hybrid recurrent model (Qwen3.5: recurrent layers + attention layers): a slot
    /// can only be cleared or extended, never cut back to a shorter prefix (spec §6.2: such
    /// states are shared only whole); a checkpoint of the recurrent part (spec §6.3) brings it
    /// back to the position it was taken at.
    bool recurrent = false;
    /// Model a sliding-window model (--swa N): with a small window cache (swa_full false) a
    /// slot holds only its last `swa` positions after each step, so truncate() to an older
    /// position is unsupported and only a checkpoint (spec §6.3) brings it back; with
    /// swa_full every position stays reachable (llama.cpp's full-size SWA cache). 0: off.
    int64_t swa = 0;
    bool swa_full = false;
    /// --kv-cache-type: scales the reported kv_cache_bytes as llama.cpp's block sizes would
    /// (kv_cache_type.h), so budget tests see a quantized cache's memory; nothing else changes.
    KvCacheType kv_cache_type = KvCacheType::f16;
    /// Echo mode prefixes its output with a digest of the slot's WHOLE state (8 hex digits,
    /// then ':'), so a test sees any state difference, not just the last bytes.
    bool echo_digest = false;
    /// Fault injection (--poison-token): a step in which any item carries this token id fails
    /// with engine_error after appending the items before the poisoned one, as a real engine
    /// may leave a failed call's slots partly appended (engine.h). A generation whose prompt
    /// (or scripted output) holds the id is thus "the item that makes the step fail". -1: off.
    int64_t poison_token = -1;
    /// Fault injection (--stuck-token): a step in which any item carries this token id stops
    /// making progress and never returns, like a kernel that stopped: its work counter
    /// (work_done()) stands still, cancels and stdin/cancel-pipe EOF are ignored, only a
    /// signal ends the process (SIGTERM unless --ignore-sigterm). -1: off. The simulated
    /// compute of the delays below counts as work, so a long delay is a slow step that makes
    /// progress.
    int64_t stuck_token = -1;
    /// Unit tests: called first by reset/truncate/save_state/load_state with the operation's
    /// name and slot; a status other than ok is returned instead of doing it (it may throw).
    std::function<Status(const char* op, int32_t slot)> fail_op;
    /// Unit tests: called at the start of every step, before its delays (e.g. to deliver a
    /// cancel frame "while the step runs" deterministically).
    std::function<void(const struct FakeStepRecord&)> on_step;
    /// A stand-in for a grammar's full-vocabulary mask (Engine::begin_sample defers it to the
    /// loop's sampler thread). `--slow-grammar-ms N` (with --grammar-unenforced): every sample
    /// of a generation that has a grammar is deferred and its finish_sample() sleeps N ms.
    double slow_grammar_ms = 0;
    /// Unit tests: whether to defer the sample of (script entry, output position) — -1 is
    /// echo mode — and what finish_sample() does first, on the sampler thread (e.g. wait for
    /// a latch the test opens, so "the mask takes long" is deterministic, not timed).
    std::function<bool(int64_t script_index, size_t pos)> defer_sample;
    std::function<void(int64_t script_index, size_t pos)> on_finish_sample;
    /// Known probabilities (`--dist "a:0.5,b:0.3,c:0.2"`, with `--dist-tokens N`): instead of a
    /// script, every output byte is drawn independently from this distribution with the
    /// generation's seed (one draw per byte), N bytes then EOS: a test can check that drafting
    /// keeps the distribution (and, with the same seed, the very output).
    std::vector<std::pair<char, double>> dist;
    int64_t dist_tokens = 64;
    bool speculation = true;  ///< report supports_speculation (`--no-speculation`: off)
    /// check_verify_exact() reports a verify step whose logits differ from plain decoding (as
    /// llama.cpp's CPU flash attention at two threads does), so the loop's start-up check can
    /// be tested without that machine.
    bool inexact_verify = false;
};

inline constexpr int kFakeCrashStatus = 77;
inline constexpr TokenId kFakeEos = 256;
/// With --fim-tokens: 257, 258, 259 are the FIM prefix, suffix and middle tokens. They have
/// no text in the tokenizer (never produced by tokenize); they detokenize as kFakeFimText.
inline constexpr TokenId kFakeFimPre = 257;
inline const char* const kFakeFimText[3] = {"<fim_prefix>", "<fim_suffix>", "<fim_middle>"};

/// A simple ChatML template (the fake tokenizer has no special tokens; they are plain text).
inline const char* kFakeChatTemplate =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A step as the fake engine saw it (unit tests of the scheduler read FakeEngine::step_log()).
struct FakeStepRecord {
    struct Item {
        int32_t slot;
        size_t n;
        bool logits;
        bool prefill;
    };
    std::vector<Item> items;
    bool aborted = false;
    bool failed = false;  ///< a poisoned step (FakeConfig::poison_token)
};

/// One generation's fake sampling state: which script entry it plays (assigned at creation,
/// i.e. at admission, in arrival order) and how far it got.
class FakeSampler : public Sampler {
public:
    FakeSampler(int64_t script_index, bool constrained, uint32_t seed = 0)
        : script_index_(script_index), constrained_(constrained), rng_(seed) {}

private:
    friend class FakeEngine;
    int64_t script_index_;     ///< -1: echo mode
    bool constrained_;         ///< made with a grammar (--grammar-unenforced)
    bool started_ = false;     ///< output_ fixed (at the first sample)
    std::string output_;       ///< bytes of this generation's output
    size_t pos_ = 0;           ///< next byte of output_ to sample
    std::mt19937_64 rng_;      ///< FakeConfig::dist draws
    int64_t drawn_ = 0;        ///< FakeConfig::dist: bytes drawn so far
};

class FakeEngine : public Engine {
public:
    explicit FakeEngine(FakeConfig cfg) : cfg_(std::move(cfg)) {
        info_.engine = "fake";
        info_.model_name = "fake";
        info_.architecture = "fake";
        info_.model_path = "";
        info_.n_ctx = cfg_.n_ctx;
        info_.n_ctx_train = cfg_.n_ctx;
        info_.kv_cache_bytes = static_cast<uint64_t>(cfg_.n_ctx * cfg_.capacity) * 4;  // 4 bytes a token id
        if (small_window()) {
            // The fake's "layers": half full attention (n_ctx cells), half windowed (swa cells).
            info_.kv_cache_bytes = static_cast<uint64_t>((cfg_.n_ctx + std::min(cfg_.swa, cfg_.n_ctx)) * cfg_.capacity) * 2;
        }
        info_.kv_cache_bytes = kv_bytes_as(cfg_.kv_cache_type, info_.kv_cache_bytes);
        info_.kv_cache_type = kv_cache_type_name(cfg_.kv_cache_type);
        info_.n_swa = std::max<int64_t>(0, cfg_.swa);
        if (cfg_.swa > 0) info_.swa_cache = cfg_.swa_full ? "full" : "checkpoints";
        info_.supports_checkpoints = small_window() || cfg_.recurrent;
        if (cfg_.recurrent) info_.checkpoint_kind = "recurrent";
        else if (small_window()) info_.checkpoint_kind = "window";
        info_.capacity = cfg_.capacity;
        info_.n_vocab = cfg_.fim_tokens ? 260 : 257;
        if (cfg_.fim_tokens) {
            info_.fim_pre_id = kFakeFimPre;
            info_.fim_suf_id = kFakeFimPre + 1;
            info_.fim_mid_id = kFakeFimPre + 2;
        }
        info_.max_step_tokens = INT64_MAX;
        info_.supports_truncate = !cfg_.recurrent;
        info_.trims_any_state = !cfg_.recurrent && !small_window();
        info_.supports_grammar = cfg_.grammar_unenforced;
        info_.supports_token_veto = true;  // sample() applies it to the scripted bytes
        info_.supports_speculation = cfg_.speculation && !cfg_.recurrent;
        info_.eos_text = "<|im_end|>";
        info_.eos_id = kFakeEos;
        if (!cfg_.no_chat_template)
            info_.chat_template = cfg_.chat_template.empty() ? std::string(kFakeChatTemplate) : cfg_.chat_template;
        kv_.resize(static_cast<size_t>(cfg_.capacity));
        min_pos_.assign(static_cast<size_t>(cfg_.capacity), 0);
        logits_.assign(static_cast<size_t>(cfg_.capacity), false);
        logit_n_.assign(static_cast<size_t>(cfg_.capacity), 0);
    }

    const EngineInfo& info() const override { return info_; }

    int64_t position(int32_t slot) const override { return static_cast<int64_t>(kv_[idx(slot)].size()); }

    Status reset(int32_t slot) override {
        if (Status f = fault("reset", slot); f != Status::ok) return f;
        kv_[idx(slot)].clear();
        min_pos_[idx(slot)] = 0;
        return Status::ok;
    }

    Status truncate(int32_t slot, int64_t pos) override {
        if (Status f = fault("truncate", slot); f != Status::ok) return f;
        if (pos < 0 || pos > position(slot)) return Status::engine_error;
        if (cfg_.recurrent && pos != 0 && pos != position(slot)) return Status::unsupported;
        if (!can_truncate(slot, pos)) return Status::unsupported;  // the window slid past `pos`
        kv_[idx(slot)].resize(static_cast<size_t>(pos));
        if (pos == 0) min_pos_[idx(slot)] = 0;
        return Status::ok;
    }

    bool can_truncate(int32_t slot, int64_t pos) const override {
        if (pos < 0 || pos > position(slot)) return false;
        if (pos == 0 || pos == position(slot)) return true;
        if (cfg_.recurrent) return false;
        return pos >= min_pos_[idx(slot)];
    }

    /// A checkpoint. Small window: the position, then the window's ids [min_pos, P) — what a
    /// real engine's window cells hold — 4 bytes each. Recurrent: the position, then the
    /// "recurrent state" after P ids: a digest of them, padded to kRecurrentStateBytes (a
    /// real recurrent state has a fixed size whatever the position).
    Status save_checkpoint(int32_t slot, std::vector<uint8_t>& out) override {
        if (!small_window() && !cfg_.recurrent) return Status::unsupported;
        if (Status f = fault("save_checkpoint", slot); f != Status::ok) return f;
        const auto& kv = kv_[idx(slot)];
        out.clear();
        if (cfg_.recurrent) {
            put_u32(out, static_cast<uint32_t>(kv.size()));
            put_u32(out, ids_digest(kv, kv.size()));
            out.resize(kRecurrentStateBytes, 0);
            ++checkpoints_saved_;
            return Status::ok;
        }
        put_u32(out, static_cast<uint32_t>(kv.size()));
        for (size_t i = static_cast<size_t>(min_pos_[idx(slot)]); i < kv.size(); ++i) put_u32(out, static_cast<uint32_t>(kv[i]));
        ++checkpoints_saved_;
        return Status::ok;
    }

    /// Checks the checkpoint against the slot's ids (the window part must be what the slot
    /// held there: a mismatch is a caller bug, reported as engine_error with the slot reset).
    /// Recurrent: the digest must be that of the slot's first `pos` ids (the attention cells
    /// the restored recurrent state goes with), then every cell at >= pos is dropped.
    Status restore_checkpoint(int32_t slot, int64_t pos, const std::vector<uint8_t>& in) override {
        if (!small_window() && !cfg_.recurrent) return Status::unsupported;
        if (pos <= 0 || pos > position(slot) || in.size() < 4 || in.size() % 4 != 0) return Status::unsupported;
        auto& kv = kv_[idx(slot)];
        if (Status f = fault("restore_checkpoint", slot); f != Status::ok) {
            kv.clear();
            min_pos_[idx(slot)] = 0;
            return f;
        }
        if (cfg_.recurrent) {
            if (in.size() != kRecurrentStateBytes || get_u32(in, 0) != static_cast<uint32_t>(pos) ||
                get_u32(in, 1) != ids_digest(kv, static_cast<size_t>(pos))) {
                kv.clear();
                return Status::engine_error;
            }
            kv.resize(static_cast<size_t>(pos));
            ++checkpoints_restored_;
            return Status::ok;
        }
        const int64_t n_window = static_cast<int64_t>(in.size() / 4) - 1;
        const int64_t start = pos - n_window;
        bool same = get_u32(in, 0) == static_cast<uint32_t>(pos) && start >= 0;
        for (int64_t i = 0; same && i < n_window; ++i)
            same = get_u32(in, static_cast<size_t>(i + 1)) == static_cast<uint32_t>(kv[static_cast<size_t>(start + i)]);
        if (!same) {
            kv.clear();
            min_pos_[idx(slot)] = 0;
            return Status::engine_error;
        }
        kv.resize(static_cast<size_t>(pos));
        min_pos_[idx(slot)] = start;
        ++checkpoints_restored_;
        return Status::ok;
    }

    /// Spill: the resident ids, 4 bytes each (little-endian), so a restore is exact and costs
    /// no prefill delay, like a real state copy.
    Status save_state(int32_t slot, std::vector<uint8_t>& out) override {
        if (Status f = fault("save_state", slot); f != Status::ok) return f;
        const auto& kv = kv_[idx(slot)];
        out.resize(kv.size() * 4);
        for (size_t i = 0; i < kv.size(); ++i)
            for (int b = 0; b < 4; ++b) out[i * 4 + b] = static_cast<uint8_t>((static_cast<uint32_t>(kv[i]) >> (8 * b)) & 0xFF);
        if (small_window()) {  // a window cache's state carries only its last cells: min_pos first
            std::vector<uint8_t> head;
            put_u32(head, static_cast<uint32_t>(min_pos_[idx(slot)]));
            out.insert(out.begin(), head.begin(), head.end());
        }
        return Status::ok;
    }

    Status load_state(int32_t slot, const std::vector<uint8_t>& in) override {
        auto& kv = kv_[idx(slot)];
        if (Status f = fault("load_state", slot); f != Status::ok) {
            kv.clear();  // engine.h: a failed load leaves the slot reset
            return f;
        }
        kv.clear();
        min_pos_[idx(slot)] = 0;
        const size_t head = small_window() ? 4 : 0;
        if (in.size() < head || in.size() % 4 != 0 || static_cast<int64_t>((in.size() - head) / 4) > cfg_.n_ctx)
            return Status::engine_error;
        if (head > 0) min_pos_[idx(slot)] = get_u32(in, 0);
        for (size_t i = head; i < in.size(); i += 4) {
            uint32_t v = 0;
            for (int b = 0; b < 4; ++b) v |= static_cast<uint32_t>(in[i + b]) << (8 * b);
            kv.push_back(static_cast<TokenId>(v));
        }
        return Status::ok;
    }

    /// The fake's "model": what changes its state bytes (a window cache's states carry their
    /// window start; the context bounds what load_state() takes).
    std::string state_fingerprint() const override {
        return "fake|ctx=" + std::to_string(cfg_.n_ctx) + "|recurrent=" + std::to_string(cfg_.recurrent) +
               "|swa=" + std::to_string(cfg_.swa) + "|small_window=" + std::to_string(small_window()) +
               "|kv=" + kv_cache_type_name(cfg_.kv_cache_type);
    }

    /// Validates, sleeps the configured delays ONCE for the whole step (prefill delay per
    /// prompt token in it, token delay when a sample follows), abortable in ~1 ms slices, then
    /// appends every item. Aborted: nothing appended.
    Status step(const StepItem* items, size_t n) override {
        size_t prefill_tokens = 0;
        bool sample_follows = false;
        for (size_t i = 0; i < n; ++i) {
            const StepItem& it = items[i];
            if (it.slot < 0 || it.slot >= cfg_.capacity || it.n == 0) return Status::engine_error;
            for (size_t k = 0; k < it.n; ++k)
                if (it.tokens[k] < 0 || it.tokens[k] >= info_.n_vocab) return Status::invalid_token;
            if (position(it.slot) + static_cast<int64_t>(it.n) > cfg_.n_ctx) return Status::context_full;
            if (it.prefill) prefill_tokens += it.n;
            sample_follows |= it.logits;
        }
        FakeStepRecord rec;  // built only for tests (no allocation on the normal path)
        if (cfg_.record_steps || cfg_.on_step)
            for (size_t i = 0; i < n; ++i) rec.items.push_back({items[i].slot, items[i].n, items[i].logits, items[i].prefill});
        if (cfg_.on_step) cfg_.on_step(rec);
        if (cfg_.stuck_token >= 0)
            for (size_t i = 0; i < n; ++i)
                if (std::find(items[i].tokens, items[i].tokens + items[i].n, static_cast<TokenId>(cfg_.stuck_token)) !=
                    items[i].tokens + items[i].n) {
                    std::fprintf(stderr, "fake-worker: --stuck-token %lld in a step; making no progress\n",
                                 static_cast<long long>(cfg_.stuck_token));
                    g_simulated_hang.store(true);
                    for (;;) pause();  // only a signal ends this
                }
        const double delay = cfg_.prefill_ms_per_token * static_cast<double>(prefill_tokens) +
                             (sample_follows ? ms_to_next_sample_due() : 0.0);
        if ((delay > 0 && !sleep_ms(delay)) || abort_.load(std::memory_order_acquire)) {
            rec.aborted = true;
            if (cfg_.record_steps) log_.push_back(std::move(rec));
            return Status::aborted;
        }
        std::fill(logits_.begin(), logits_.end(), false);
        for (size_t i = 0; i < n; ++i) {
            const StepItem& it = items[i];
            auto& kv = kv_[idx(it.slot)];
            if (cfg_.poison_token >= 0 &&
                std::find(it.tokens, it.tokens + it.n, static_cast<TokenId>(cfg_.poison_token)) != it.tokens + it.n) {
                std::fill(logits_.begin(), logits_.end(), false);
                rec.failed = true;
                if (cfg_.record_steps) log_.push_back(std::move(rec));
                return Status::engine_error;  // items before this one stay appended
            }
            kv.insert(kv.end(), it.tokens, it.tokens + it.n);
            if (small_window())  // the window cache keeps only the last `swa` positions
                min_pos_[idx(it.slot)] = std::max(min_pos_[idx(it.slot)], static_cast<int64_t>(kv.size()) - cfg_.swa);
            if (it.logits || it.all_logits) logits_[idx(it.slot)] = true;
            logit_n_[idx(it.slot)] = it.all_logits ? it.n : 1;
        }
        if (cfg_.record_steps) log_.push_back(std::move(rec));
        return Status::ok;
    }

    std::unique_ptr<Sampler> new_sampler(const SamplingParams& params, const std::string& grammar, std::string& error) override {
        if (!grammar.empty() && !cfg_.grammar_unenforced) {  // the worker loop rejects grammars first
            error = "the fake engine has no grammar support";
            return nullptr;
        }
        const int64_t k = cfg_.script.empty() ? -1 : static_cast<int64_t>(generation_ % cfg_.script.size());
        ++generation_;
        return std::make_unique<FakeSampler>(k, !grammar.empty(), params.seed);
    }

    Status sample(int32_t slot, Sampler& sampler, TokenId* out) override {
        return sample_in_both_parts(slot, sampler, out);
    }

    /// Loop thread: fixes the output at the first sample (echo mode reads the slot) and runs the
    /// process-wide fault counters; then picks the byte, unless this sample is deferred
    /// (FakeConfig::slow_grammar_ms, defer_sample): finish_sample() picks it, on any thread.
    Status begin_sample(int32_t slot, Sampler& sampler, TokenId* out, bool* deferred) override {
        *deferred = false;
        if (!logits_[idx(slot)]) return Status::engine_error;
        auto& s = static_cast<FakeSampler&>(sampler);
        if (!cfg_.dist.empty()) return draw(s, out);
        if (!s.started_) {  // echo mode echoes the slot state as it is once the prompt is in
            s.started_ = true;
            if (s.script_index_ >= 0) {
                s.output_ = cfg_.script[static_cast<size_t>(s.script_index_)];
            } else {
                for (TokenId t : kv_[idx(slot)]) if (t >= 0 && t < 256) s.output_.push_back(static_cast<char>(t));
                if (s.output_.size() > 64) s.output_ = s.output_.substr(s.output_.size() - 64);
                if (cfg_.echo_digest) s.output_ = state_digest(kv_[idx(slot)]) + ":" + s.output_;
            }
        }
        if (s.pos_ < s.output_.size()) before_token();
        if ((s.constrained_ && cfg_.slow_grammar_ms > 0) ||
            (cfg_.defer_sample && cfg_.defer_sample(s.script_index_, s.pos_))) {
            *deferred = true;
            return Status::ok;
        }
        *out = pick(s);
        return Status::ok;
    }

    /// Speculative verification: the fake's output does not depend on its context, so
    /// position i samples like sample() (the script's next byte, or a FakeConfig::dist draw).
    Status sample_draft(int32_t slot, size_t i, Sampler& sampler, TokenId* out) override {
        if (!logits_[idx(slot)] || i >= logit_n_[idx(slot)]) return Status::engine_error;
        bool deferred = false;
        Status st = begin_sample(slot, sampler, out, &deferred);
        if (st == Status::ok && deferred) st = finish_sample(sampler, out);
        return st;
    }

    /// The fake's verification is exact by construction (sample_draft()); FakeConfig::
    /// inexact_verify scripts the opposite finding.
    Status check_verify_exact(int32_t, const std::vector<TokenId>&, size_t depth, size_t n, bool* same,
                              std::string& detail) override {
        *same = !cfg_.inexact_verify;
        if (!*same) detail = "scripted: position 0 of " + std::to_string(n) + " at a " + std::to_string(depth) + "-token context";
        return Status::ok;
    }

    /// The deferred part: the configured stand-in for a mask's cost, then the pick. Touches
    /// only the sampler and the (immutable) configuration.
    Status finish_sample(Sampler& sampler, TokenId* out) const override {
        auto& s = static_cast<FakeSampler&>(sampler);
        if (cfg_.on_finish_sample) cfg_.on_finish_sample(s.script_index_, s.pos_);
        if (s.constrained_ && cfg_.slow_grammar_ms > 0)
            std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(cfg_.slow_grammar_ms));
        *out = pick(s);
        return Status::ok;
    }

    /// FakeConfig::dist: one byte drawn from the known distribution (EOS after dist_tokens).
    Status draw(FakeSampler& s, TokenId* out) const {
        if (s.drawn_ >= cfg_.dist_tokens) {
            *out = kFakeEos;
            return Status::ok;
        }
        double total = 0;
        for (const auto& e : cfg_.dist) total += e.second;
        std::uniform_real_distribution<double> U(0.0, total);
        const double r = U(s.rng_);
        double acc = 0;
        *out = static_cast<TokenId>(static_cast<unsigned char>(cfg_.dist.back().first));
        for (const auto& [c, p] : cfg_.dist) {
            acc += p;
            if (r < acc) {
                *out = static_cast<TokenId>(static_cast<unsigned char>(c));
                break;
            }
        }
        ++s.drawn_;
        return Status::ok;
    }

    /// The next byte of the sampler's output (EOS at its end), through its veto.
    static TokenId pick(FakeSampler& s) {
        TokenVeto* veto = s.veto();
        if (s.pos_ >= s.output_.size()) {
            if (veto != nullptr) veto->accept(kFakeEos);
            return kFakeEos;
        }
        const auto want = static_cast<TokenId>(static_cast<unsigned char>(s.output_[s.pos_]));
        TokenId pick = want;
        if (veto != nullptr && !veto->allows(want)) {
            // The veto refuses the scripted byte: like a model whose best token is masked, take
            // the next byte value (wrapping) the veto allows and offer the scripted byte again
            // at the next step. A script `{"a": 1, "a": 2}` thus becomes `{"a": 1, "a#": 2}`.
            for (int k = 1; k < 256; ++k) {
                const auto c = static_cast<TokenId>((want + k) % 256);
                if (veto->allows(c)) { pick = c; break; }
            }
        }
        if (pick == want) ++s.pos_;  // (a veto refusing every byte yields: the scripted byte)
        if (veto != nullptr) veto->accept(pick);
        return pick;
    }

    void request_abort() override { abort_.store(true, std::memory_order_release); }
    void clear_abort() override { abort_.store(false, std::memory_order_release); }
    /// Milliseconds of simulated compute (the delays' ~1 ms slices) over the engine's life.
    uint64_t work_done() const override { return work_.load(std::memory_order_relaxed); }

    Status tokenize(const std::string& text, bool /*parse_special*/, std::vector<TokenId>& out) const override {
        simulate_tokenize_cost(text.size(), nullptr);
        for (unsigned char c : text) out.push_back(static_cast<TokenId>(c));  // no special tokens
        return Status::ok;
    }

    Status tokenize_cancellable(const std::string& text, bool parse_special, std::vector<TokenId>& out,
                                const std::atomic<bool>& stop) const override {
        if (!simulate_tokenize_cost(text.size(), &stop)) return Status::aborted;
        for (unsigned char c : text) out.push_back(static_cast<TokenId>(c));
        (void)parse_special;
        return Status::ok;
    }

    void token_bytes(TokenId id, std::string& out) const override {
        if (id >= 0 && id < 256) out.push_back(static_cast<char>(id));
        else if (cfg_.fim_tokens && id >= kFakeFimPre && id < kFakeFimPre + 3) out.append(kFakeFimText[id - kFakeFimPre]);
    }

    bool is_end_of_generation(TokenId id) const override { return id == kFakeEos; }

    const FakeConfig& config() const { return cfg_; }
    const std::vector<FakeStepRecord>& step_log() const { return log_; }
    const std::vector<TokenId>& slot_tokens(int32_t slot) const { return kv_[idx(slot)]; }
    int64_t window_start(int32_t slot) const { return min_pos_[idx(slot)]; }  ///< lowest position held (--swa)
    uint64_t checkpoints_saved() const { return checkpoints_saved_; }
    uint64_t checkpoints_restored() const { return checkpoints_restored_; }

private:
    /// Sleeps --tokenize-us-per-byte for `bytes` bytes, in slices of at most 10 ms; returns
    /// false when `stop` became true first (then the rest is not slept).
    bool simulate_tokenize_cost(size_t bytes, const std::atomic<bool>* stop) const {
        if (cfg_.tokenize_us_per_byte <= 0) return stop == nullptr || !stop->load(std::memory_order_acquire);
        double left_us = cfg_.tokenize_us_per_byte * static_cast<double>(bytes);
        while (left_us > 0) {
            if (stop != nullptr && stop->load(std::memory_order_acquire)) return false;
            const double slice = std::min(left_us, 10000.0);
            std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(slice)));
            left_us -= slice;
        }
        return stop == nullptr || !stop->load(std::memory_order_acquire);
    }

    static size_t idx(int32_t slot) { return static_cast<size_t>(slot); }
    /// --recurrent: the size of one checkpoint's state (position, digest, padding).
    static constexpr size_t kRecurrentStateBytes = 64;
    bool small_window() const { return cfg_.swa > 0 && !cfg_.swa_full && !cfg_.recurrent; }

    static void put_u32(std::vector<uint8_t>& out, uint32_t v) {
        for (int b = 0; b < 4; ++b) out.push_back(static_cast<uint8_t>((v >> (8 * b)) & 0xFF));
    }
    static uint32_t get_u32(const std::vector<uint8_t>& in, size_t word) {
        uint32_t v = 0;
        for (int b = 0; b < 4; ++b) v |= static_cast<uint32_t>(in[word * 4 + b]) << (8 * b);
        return v;
    }

    /// FNV-1a over the first `n` ids of a state.
    static uint32_t ids_digest(const std::vector<TokenId>& kv, size_t n) {
        uint32_t h = 2166136261u;
        for (size_t i = 0; i < n && i < kv.size(); ++i)
            for (int b = 0; b < 4; ++b) {
                h ^= (static_cast<uint32_t>(kv[i]) >> (8 * b)) & 0xFFu;
                h *= 16777619u;
            }
        return h;
    }

    /// FNV-1a over every id of a state, as 8 hex digits.
    static std::string state_digest(const std::vector<TokenId>& kv) {
        const uint32_t h = ids_digest(kv, kv.size());
        char buf[9];
        std::snprintf(buf, sizeof buf, "%08x", h);
        return std::string(buf, 8);
    }
    Status fault(const char* op, int32_t slot) const { return cfg_.fail_op ? cfg_.fail_op(op, slot) : Status::ok; }

    /// Fault injection point, called before each sampled token (counted over the process life).
    void before_token() {
        if (cfg_.exit_after_tokens >= 0 && tokens_ >= cfg_.exit_after_tokens) {
            std::fprintf(stderr, "fake-worker: --exit-after-tokens %lld reached; crashing\n",
                         static_cast<long long>(cfg_.exit_after_tokens));
            _exit(kFakeCrashStatus);
        }
        if (cfg_.signal_after_tokens >= 0 && tokens_ >= cfg_.signal_after_tokens) {
            std::fprintf(stderr, "fake-worker: --signal-after-tokens %lld reached; dying by signal %d\n",
                         static_cast<long long>(cfg_.signal_after_tokens), cfg_.crash_signal);
            // Like a faulting kernel: the default action of the signal, whatever was installed.
            ::signal(cfg_.crash_signal, SIG_DFL);
            std::raise(cfg_.crash_signal);
            _exit(kFakeCrashStatus);  // not reached
        }
        if (cfg_.hang_after_tokens >= 0 && tokens_ >= cfg_.hang_after_tokens) {
            std::fprintf(stderr, "fake-worker: --hang-after-tokens %lld reached; hanging\n",
                         static_cast<long long>(cfg_.hang_after_tokens));
            g_simulated_hang.store(true);
            for (;;) pause();  // only a signal ends this (SIGTERM unless --ignore-sigterm)
        }
        ++tokens_;
    }

    /// The token delay is a cadence, not a pause: sampling steps end on a grid `token_delay_ms`
    /// apart, so the worker loop's own work between them (sampling, records, the pipe write) and
    /// a late wake-up from the previous sleep are absorbed by the next step, as a GPU's fixed
    /// step absorbs its host's work, and a fleet benchmark's nominal step is the real one (no
    /// drift of the loop's share per step). A step that starts a whole period past its grid
    /// point (an idle gap, or a stall) starts a new grid and pays the whole delay. Advances the
    /// grid by one step and returns the time until that step's end, in ms.
    double ms_to_next_sample_due() {
        using namespace std::chrono;
        const auto now = steady_clock::now();
        const auto period = duration_cast<steady_clock::duration>(duration<double, std::milli>(cfg_.token_delay_ms));
        if (sample_due_ == steady_clock::time_point{} || now >= sample_due_ + period)
            sample_due_ = now + period;
        else
            sample_due_ += period;
        return duration<double, std::milli>(sample_due_ - now).count();
    }

    // Sleeps `ms` in ~1 ms slices; false as soon as an abort is requested.
    bool sleep_ms(double ms) {
        using namespace std::chrono;
        auto until = steady_clock::now() + duration_cast<steady_clock::duration>(duration<double, std::milli>(ms));
        while (steady_clock::now() < until) {
            if (abort_.load(std::memory_order_acquire)) return false;
            auto left = until - steady_clock::now();
            std::this_thread::sleep_for(std::min<steady_clock::duration>(left, milliseconds(1)));
            work_.fetch_add(1, std::memory_order_relaxed);
        }
        return !abort_.load(std::memory_order_acquire);
    }

    FakeConfig cfg_;
    EngineInfo info_;
    std::vector<std::vector<TokenId>> kv_;  ///< per slot
    std::vector<bool> logits_;              ///< per slot: the last step computed its logits
    std::vector<size_t> logit_n_;           ///< per slot: positions with logits (all_logits: the item's n)
    std::vector<int64_t> min_pos_;          ///< per slot: lowest position the window still holds (--swa)
    uint64_t checkpoints_saved_ = 0, checkpoints_restored_ = 0;
    std::atomic<bool> abort_{false};
    std::atomic<uint64_t> work_{0};  ///< simulated compute slices (work_done())
    std::chrono::steady_clock::time_point sample_due_{};  ///< when the last sampling step was due to end (the grid)
    uint64_t generation_ = 0;
    int64_t tokens_ = 0;
    std::vector<FakeStepRecord> log_;
};

}  // namespace trioserve
