// generation.h — one generate request as an explicit state machine; the unit of state of the
// worker (several are in flight at once, protocol 2).
//
// Phases: queued (admitted: slot chosen and prepared, waiting for its first step) → prefill
// (prompt chunks being appended) → decode (one sampled token per step) → done (terminal
// record written). A cancel can end it in any phase before done.
//
// A Generation owns everything the v1 decode loop kept in locals: the prompt, its sampler
// (sampling chain, RNG, grammar state), the UTF-8 assembler, the stop matcher, the cancel
// flag, counters and timings. The scheduler (cpp/loop/step.h) moves it between phases and feeds
// it sampled tokens; on_sample() is the per-token hot path (no allocation once the shared
// scratch buffers have grown; the token record is hand-built by RecordWriter).
//
// Thread-safety: the cancel flag is written by the cancel watcher thread (through
// CancelController, which shares its ownership: a frame arriving after the generation is gone
// writes a flag nobody reads, never freed memory); everything else belongs to the worker loop
// thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cassert>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cancel_controller.h"
#include "engine.h"
#include "records.h"
#include "speculation.h"
#include "stop_matcher.h"
#include "utf8_assembler.h"

namespace trioserve {

using Clock = std::chrono::steady_clock;

inline double ms_between(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
}

/// Buffers shared by every generation's per-token path (one thread), reused so a token costs
/// no allocation.
struct TokenScratch {
    std::string piece, text, emit;
};

class Generation {
public:
    enum class Phase { queued, prefill, decode, done };

    Generation(uint64_t id, Clock::time_point t_read) : id_(id), t_read_(t_read) {}
    Generation(const Generation&) = delete;
    Generation& operator=(const Generation&) = delete;

    // -- setup (admission) ---------------------------------------------------------------

    /// Sets the request facts. `reused` prompt tokens are already resident in the slot (warm
    /// reuse); prefill starts after them.
    void configure(std::string session_id, int32_t slot, std::vector<TokenId> prompt, int64_t max_new,
                   std::vector<std::string> stops, std::unique_ptr<Sampler> sampler, size_t reused,
                   const char* plan) {
        session_id_ = std::move(session_id);
        slot_ = slot;
        prompt_ = std::move(prompt);
        max_new_ = max_new;
        stops_.reset(std::move(stops));
        sampler_ = std::move(sampler);
        reused_ = reused;
        prefill_pos_ = reused;
        plan_ = plan;
        generated_.reserve(static_cast<size_t>(std::min<int64_t>(max_new, 4096)));
    }

    /// A generation that waited for another one's prefill (loop/prefix_sharing.h, spec §6.2) starts
    /// from more resident tokens than at admission. Only before its first step (queued).
    void restart_prefill(size_t reused, const char* plan) {
        if (phase_ != Phase::queued) return;
        reused_ = reused;
        prefill_pos_ = reused;
        plan_ = plan;
    }

    const std::vector<TokenId>& prompt() const { return prompt_; }

    /// Prompt positions where the slot's state is saved as a checkpoint when the prefill
    /// passes them (spec §6.3: the control plane's marks, the prompt's end aside), ascending.
    void set_checkpoint_marks(std::vector<size_t> marks) { marks_ = std::move(marks); }
    /// The first mark after prompt position `pos`, or 0.
    size_t next_mark(size_t pos) const {
        for (size_t m : marks_)
            if (m > pos) return m;
        return 0;
    }
    bool is_mark(size_t pos) const { return std::find(marks_.begin(), marks_.end(), pos) != marks_.end(); }
    const std::vector<size_t>& marks() const { return marks_; }
    /// The tokens emitted so far (EOS excluded); the last one is pending() while decoding.
    const std::vector<TokenId>& output() const { return generated_; }
    /// Tokens it may still emit (max_tokens after the context clamp).
    int64_t remaining() const { return max_new_ - completion_; }

    /// Speculative decoding state (speculation.h); null: this generation is never drafted
    /// (speculation off, or a grammar / unique_keys stage: spec/worker-protocol.md §4.6).
    SpecState* spec() { return spec_.get(); }
    void enable_speculation(std::unique_ptr<SpecState> s) { spec_ = std::move(s); }

    /// Adds a field to the done record (e.g. `restored_prompt_tokens`, `restore_ms`).
    void set_extra(const std::string& key, json value) { extra_[key] = std::move(value); }

    uint64_t id() const { return id_; }
    int32_t slot() const { return slot_; }
    Phase phase() const { return phase_; }
    const std::string& session_id() const { return session_id_; }
    const CancelFlag& cancel_flag() const { return cancel_flag_; }
    bool cancel_requested() const { return cancel_flag_->load(std::memory_order_acquire); }
    /// Its sampler. Not while lent (awaiting_sample()).
    Sampler& sampler() {
        assert(sampler_ && "the sampler is out with a deferred sample");
        return *sampler_;
    }

    // -- deferred sampling (loop/step.h, sample_worker.h) ---------------------------------

    /// Hands the sampler to a deferred sample's job. Until return_sampler(), the generation
    /// waits for its token: it has nothing to append, so it takes no part in steps.
    std::unique_ptr<Sampler> lend_sampler() {
        assert(phase_ == Phase::decode && sampler_);
        return std::move(sampler_);
    }
    /// The sampler is back (the job's result, or a hand-over that failed).
    void return_sampler(std::unique_ptr<Sampler> s) { sampler_ = std::move(s); }
    /// A deferred sample's costly part took `ms` on the sampler thread (done record fields
    /// deferred_samples, deferred_sample_ms).
    void note_deferred_sample(double ms) {
        ++deferred_samples_;
        deferred_ms_ += ms;
    }
    /// Whether a deferred sample holds the sampler (the generation's next token is coming).
    bool awaiting_sample() const { return !sampler_ && phase_ == Phase::decode; }

    // -- prefill ---------------------------------------------------------------------------

    /// Prompt tokens not yet appended to the slot.
    size_t prefill_remaining() const { return prompt_.size() - prefill_pos_; }
    const TokenId* prefill_cursor() const { return prompt_.data() + prefill_pos_; }

    /// This generation takes part in a step for the first time (ends its queue time).
    void mark_stepped(Clock::time_point now) {
        if (phase_ == Phase::queued) {
            phase_ = Phase::prefill;
            t_first_step_ = now;
        }
    }

    /// `n` prompt tokens were appended by a step that ended at `now`. When the prompt is
    /// complete the generation moves to decode (its first sample follows).
    void prefilled(size_t n, Clock::time_point now) {
        prefill_pos_ += n;
        if (prefill_pos_ == prompt_.size()) {
            phase_ = Phase::decode;
            t_decode_ = now;
        }
    }

    // -- decode ----------------------------------------------------------------------------

    /// The sampled token to append in the next step (decode phase).
    const TokenId* pending() const { return &pending_; }

    /// Handles one sampled token: EOS, UTF-8 assembly, stop strings, the token record, the
    /// length limit. Returns true when the generation took its terminal decision (then call
    /// finish()); false when `pending()` must be appended in the next step.
    bool on_sample(TokenId tok, const Engine& engine, CancelController& cancel, RecordWriter& out,
                   TokenScratch& s) {
        if (engine.is_end_of_generation(tok)) {  // CONTRACT: EOS never emitted nor counted
            cancelled_ = cancel.seal(id_);
            finish_ = "stop";
            return true;
        }
        ++completion_;
        generated_.push_back(tok);
        s.piece.clear();
        s.text.clear();
        s.emit.clear();
        engine.token_bytes(tok, s.piece);
        utf8_.push(s.piece, s.text);
        hit_ = stops_.push(s.text, s.emit);
        const bool last = hit_ || completion_ >= max_new_;
        if (last) cancelled_ = cancel.seal(id_);  // the terminal decision (spec §7 "sealed")
        if (!s.emit.empty()) write_token(out, s.emit);
        if (hit_) { finish_ = "stop"; return true; }
        if (last) { finish_ = "length"; return true; }
        pending_ = tok;
        return false;
    }

    /// A cancel observed at a step boundary ends the generation (any phase before done).
    void cancel_now(CancelController& cancel) {
        cancel.seal(id_);
        cancelled_ = true;
    }

    // -- terminal --------------------------------------------------------------------------

    /// Flushes held-back text (unless a stop string hit), stamps the end time and marks done.
    /// The caller then writes done_record() and frees the slot.
    void finish(RecordWriter& out, TokenScratch& s, Clock::time_point now) {
        if (!hit_) {  // flush what was held back (EOS, length or cancel)
            s.text.clear();
            s.emit.clear();
            utf8_.flush(s.text);
            stops_.push(s.text, s.emit);
            if (stops_.hit_index() >= 0) hit_ = true;
            else stops_.flush(s.emit);
            if (!s.emit.empty()) write_token(out, s.emit);
        }
        if (cancelled_) finish_ = "stop";
        if (hit_) stop_text_ = stops_.stop(static_cast<size_t>(stops_.hit_index()));
        t_end_ = now;
        phase_ = Phase::done;
    }

    /// Marks done without writing anything (an error record ends it instead).
    void finish_silently() { phase_ = Phase::done; }

    bool cancelled() const { return cancelled_; }


    /// The done record (spec §4.2). Call after finish().
    json done_record() const {
        auto rate = [](int64_t n, double ms) { return ms > 0 ? n * 1000.0 / ms : 0.0; };
        const double total = ms_between(t_read_, t_end_);
        const double queue = t_first_step_ ? ms_between(t_read_, *t_first_step_) : total;
        const double ttft = t_first_token_ ? ms_between(t_read_, *t_first_token_) : total;
        double prefill = 0, decode = 0;
        if (t_first_step_) prefill = ms_between(*t_first_step_, t_decode_ ? *t_decode_ : t_end_);
        if (t_decode_) decode = ms_between(*t_decode_, t_end_);
        const int64_t n_prompt = static_cast<int64_t>(prompt_.size());
        const int64_t reused = static_cast<int64_t>(reused_);
        const int64_t prefilled = static_cast<int64_t>(prefill_pos_ - reused_);
        json j{{"type", "done"},
               {"id", id_},
               {"finish_reason", finish_},
               {"cancelled", cancelled_},
               {"stop_string", hit_ ? json(stop_text_) : json(nullptr)},
               {"prompt_tokens", n_prompt},
               {"completion_tokens", completion_},
               {"reused_prompt_tokens", reused},
               {"prefilled_prompt_tokens", n_prompt - reused},
               {"prefill_plan", plan_},
               {"queue_ms", queue},
               {"ttft_ms", ttft},
               {"prefill_ms", prefill},
               {"decode_ms", decode},
               {"total_ms", total},
               {"prefill_tok_s", rate(prefilled, prefill)},
               {"decode_tok_s", rate(completion_, decode)}};
        // CONTRACT: ids only when they match what the client saw and the slot state (no
        // stop-string cut, no cancel). Pinned by tests/worker_process/test_fake_worker.py.
        if (!cancelled_ && !hit_) j["generated_token_ids"] = generated_;
        if (!session_id_.empty()) j["session_id"] = session_id_;
        if (deferred_samples_ > 0) {
            j["deferred_samples"] = deferred_samples_;
            j["deferred_sample_ms"] = deferred_ms_;
        }
        if (spec_) {
            j["drafted_tokens"] = spec_->drafted;
            j["accepted_draft_tokens"] = spec_->accepted;
            j["draft_steps"] = spec_->verify_steps;
        }
        for (const auto& [k, v] : extra_.items()) j[k] = v;
        return j;
    }

private:
    void write_token(RecordWriter& out, const std::string& text) {
        out.write_token(id_, text, !t_first_token_);
        if (!t_first_token_) t_first_token_ = Clock::now();
    }

    // Identity and request.
    json extra_ = json::object();
    uint64_t id_;
    std::string session_id_;
    int32_t slot_ = -1;
    std::vector<TokenId> prompt_;
    std::vector<size_t> marks_;  ///< checkpoint marks (set_checkpoint_marks)
    int64_t max_new_ = 0;
    std::unique_ptr<Sampler> sampler_;
    std::unique_ptr<SpecState> spec_;
    const char* plan_ = "new";

    // State.
    Phase phase_ = Phase::queued;
    size_t reused_ = 0;
    size_t prefill_pos_ = 0;
    TokenId pending_ = 0;
    CancelFlag cancel_flag_ = make_cancel_flag();
    Utf8Assembler utf8_;
    StopMatcher stops_;

    // Outcome.
    const char* finish_ = "stop";
    bool cancelled_ = false;
    bool hit_ = false;
    std::string stop_text_;
    int64_t completion_ = 0;
    std::vector<TokenId> generated_;
    int64_t deferred_samples_ = 0;  ///< samples whose costly part ran on the sampler thread
    double deferred_ms_ = 0;        ///< their time there

    // Timings.
    Clock::time_point t_read_;
    std::optional<Clock::time_point> t_first_step_, t_decode_, t_first_token_;
    Clock::time_point t_end_{};
};

}  // namespace trioserve
