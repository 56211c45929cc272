// scheduler.h — what one engine step contains (pure; unit-tested in cpp/tests/test_scheduler.cpp).
//
// Continuous batching with a per-step token budget (`--batch-tokens`):
//   1. every decoding generation appends its one sampled token (so running streams keep their
//      pace whatever is being admitted);
//   2. the rest of the budget goes to prefill chunks of starting generations in FIFO
//      (admission) order, each chunk at most `max_chunk` tokens. A generation later in the
//      queue gets budget only once the ones before it have their whole prompt in: FIFO, no
//      starvation. When decodes use the whole budget, prefill still gets one token per step,
//      so admission always progresses.
// Logits are requested for decodes and for the chunk that completes a prompt (a sample
// follows), nowhere else.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace trioserve {

/// One in-flight generation as the planner sees it, in admission order.
struct StepCandidate {
    bool decoding = false;        ///< has a sampled token to append
    size_t prefill_remaining = 0; ///< prompt tokens not yet appended (when not decoding)
    size_t draft = 0;             ///< draft tokens verified after the sampled one (speculation.h)
};

/// One planned item: candidate `index` appends `n` tokens (a decode with a draft: 1 + draft).
struct PlannedItem {
    size_t index = 0;
    size_t n = 0;
    bool logits = false;
    bool prefill = false;
    size_t draft = 0;  ///< a decode's draft tokens (logits at every position)
};

/// Plans one step over `cands` (admission order) into `out` (cleared): decodes first (with
/// their drafts: a draft's tokens count against the budget like decodes), then
/// prefill chunks FIFO from what is left of `budget` (at least 1 token when any prefill is
/// pending). `max_chunk` >= 1 bounds one generation's chunk.
inline void plan_step(const std::vector<StepCandidate>& cands, size_t budget, size_t max_chunk,
                      std::vector<PlannedItem>& out) {
    out.clear();
    if (max_chunk == 0) max_chunk = 1;
    size_t n_decode = 0;
    for (size_t i = 0; i < cands.size(); ++i) {
        if (!cands[i].decoding) continue;
        out.push_back(PlannedItem{i, 1 + cands[i].draft, true, false, cands[i].draft});
        n_decode += 1 + cands[i].draft;
    }
    size_t left = budget > n_decode ? budget - n_decode : 0;
    if (left == 0) left = 1;  // admission never stalls behind a full set of decodes
    for (size_t i = 0; i < cands.size() && left > 0; ++i) {
        const StepCandidate& c = cands[i];
        if (c.decoding || c.prefill_remaining == 0) continue;
        const size_t n = std::min({c.prefill_remaining, max_chunk, left});
        out.push_back(PlannedItem{i, n, n == c.prefill_remaining, true});
        left -= n;
    }
}

/// Sizes the budget of a step that carries running decodes so that the step lasts about
/// `target_ms` (`--step-target-ms`). WHY: on a CPU backend a 512-token prefill chunk takes
/// seconds, and every decoding stream waits for the whole step: without pacing, admitting a
/// long prompt stalls the running streams for that long on every chunk. On a GPU the same
/// chunk takes milliseconds and the cap (`max_budget`) binds, so pacing changes nothing there.
///
/// Pure: the worker loop reports each prefill-carrying step's tokens and duration
/// (observe()); the estimate is an exponential average of milliseconds per token, which
/// includes each step's fixed cost and so errs towards shorter steps. Contract of budget():
///   * pacing off (target <= 0) or no decoding stream: `max_budget` (nobody is kept waiting,
///     so the prompt gets the most efficient batch);
///   * otherwise decodes + at least `min_prefill` prompt tokens, at most `max_budget`; before
///     the first measurement exactly that minimum (a small first step measures the rate).
class StepPacer {
public:
    StepPacer(double target_ms, size_t min_prefill, size_t max_budget)
        : target_ms_(target_ms), min_prefill_(std::max<size_t>(min_prefill, 1)),
          max_budget_(std::max<size_t>(max_budget, 1)) {}

    size_t budget(size_t n_decode) const {
        if (target_ms_ <= 0 || n_decode == 0) return max_budget_;
        const size_t floor = std::min(max_budget_, n_decode + min_prefill_);
        if (ms_per_token_ <= 0) return floor;
        const double fit = target_ms_ / ms_per_token_;
        if (fit >= static_cast<double>(max_budget_)) return max_budget_;
        return std::max(floor, static_cast<size_t>(fit));
    }

    /// A step of `tokens` tokens (decodes + prefill) that carried prefill took `ms`.
    void observe(size_t tokens, double ms) {
        if (tokens == 0 || !(ms > 0)) return;
        const double x = ms / static_cast<double>(tokens);
        ms_per_token_ = ms_per_token_ <= 0 ? x : (1.0 - kWeight) * ms_per_token_ + kWeight * x;
    }

    /// The measured milliseconds per token of prefill-carrying steps; 0 before any.
    double ms_per_token() const { return ms_per_token_; }

private:
    static constexpr double kWeight = 0.5;  ///< of the newest step: adapts within a few steps
    double target_ms_;
    size_t min_prefill_;
    size_t max_budget_;
    double ms_per_token_ = 0;  ///< 0 until the first observation
};

/// Most tokens plan_step() can put in one step: the engine's batch must hold this many.
inline size_t max_step_tokens(size_t budget, size_t capacity) { return std::max(budget, size_t(1)) + capacity; }

}  // namespace trioserve
