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
//
// Prefill grid (`--deterministic`, spec/worker-protocol.md §4.5): with grid G > 1 a chunk ends
// on a multiple of G (absolute prompt position) unless it ends the prompt, so every prompt is
// computed in the same pieces [0, G), [G, 2G), ... whatever the budget, the other streams or
// where its prefill resumed; a chunk that cannot reach the next multiple within the budget
// waits for the next step (the first prefill of a step always gets at least G tokens).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace trioserve {

/// One in-flight generation as the planner sees it, in admission order.
struct StepCandidate {
    bool decoding = false;        ///< has a sampled token to append
    size_t prefill_remaining = 0; ///< prompt tokens not yet appended (when not decoding)
    size_t prefill_start = 0;     ///< prompt position of its next prefill token (used with a grid)
    size_t draft = 0;             ///< draft tokens verified after the sampled one (speculation.h)
    size_t stop_at = 0;           ///< prompt position its prefill piece may not pass (a checkpoint mark); 0: none
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
/// pending). `max_chunk` >= 1 bounds one generation's chunk. `grid` > 1: chunks end on the
/// grid or at the prompt's end (see above); max_chunk should then be a multiple of it.
inline void plan_step(const std::vector<StepCandidate>& cands, size_t budget, size_t max_chunk,
                      std::vector<PlannedItem>& out, size_t grid = 0) {
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
    if (grid > 1 && left < grid) left = grid;  // nor behind a budget smaller than one piece
    for (size_t i = 0; i < cands.size() && left > 0; ++i) {
        const StepCandidate& c = cands[i];
        if (c.decoding || c.prefill_remaining == 0) continue;
        size_t n = std::min({c.prefill_remaining, max_chunk, left});
        if (c.stop_at > c.prefill_start) n = std::min(n, c.stop_at - c.prefill_start);  // marks are on the grid
        if (grid > 1 && n < c.prefill_remaining) {
            const size_t end = (c.prefill_start + n) / grid * grid;  // back to the grid
            n = end > c.prefill_start ? end - c.prefill_start : 0;
            if (n == 0) continue;  // not a whole piece left in this step's budget
        }
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
/// Pure: the worker loop reports each prefill-carrying step's tokens and duration (observe(),
/// which learns from the paced ones only); the estimate is an exponential average of
/// milliseconds per token, which includes each step's fixed cost and so errs towards shorter
/// steps. Contract of budget():
///   * pacing off (target <= 0) or no decoding stream: `max_budget` (nobody is kept waiting,
///     so the prompt gets the most efficient batch);
///   * otherwise decodes + at least `min_prefill` prompt tokens, at most `max_budget`; before
///     the first measurement exactly that minimum (a small first step measures the rate);
///   * an engine whose kernels take longer per token below some batch (`efficient_prefill`,
///     0 = none) gets at least that many prompt tokens whenever they fit in kStretch times the
///     target at the measured rate. WHY: a pacer that has measured the slow kernels' rate keeps
///     choosing chunks small enough to run on them (docs/benchmarks.md, "Why the prefill
///     halved"); the stretch bounds what a slow model's decoding streams pay for it.
class StepPacer {
public:
    StepPacer(double target_ms, size_t min_prefill, size_t max_budget, size_t efficient_prefill = 0)
        : target_ms_(target_ms), min_prefill_(std::max<size_t>(min_prefill, 1)),
          max_budget_(std::max<size_t>(max_budget, 1)), efficient_prefill_(efficient_prefill) {}

    size_t budget(size_t n_decode) const {
        if (target_ms_ <= 0 || n_decode == 0) return max_budget_;
        size_t min_prefill = min_prefill_;
        if (ms_per_token_ > 0 && static_cast<double>(efficient_prefill_) * ms_per_token_ <= kStretch * target_ms_)
            min_prefill = std::max(min_prefill, efficient_prefill_);
        const size_t floor = std::min(max_budget_, n_decode + min_prefill);
        if (ms_per_token_ <= 0) return floor;
        const double fit = target_ms_ / ms_per_token_;
        if (fit >= static_cast<double>(max_budget_)) return max_budget_;
        return std::max(floor, static_cast<size_t>(fit));
    }

    /// A step of `tokens` tokens, `decodes` of them decodes (drafts included), that carried
    /// prefill took `ms`. Only a step that carried decodes counts: it is the kind budget()
    /// sizes. WHY: a step with nobody decoding takes the whole budget, the most efficient batch,
    /// and its ms per token is a fraction of a paced step's (on an MoE model every expert is
    /// read for any batch): learnt from it, the first paced step after a prompt prefilled alone
    /// ran 2.3 s against a 1 s target (synthetic Qwen3.5-MoE 3B, 2 cores).
    void observe(size_t tokens, size_t decodes, double ms) {
        if (tokens == 0 || decodes == 0 || !(ms > 0)) return;
        const double x = ms / static_cast<double>(tokens);
        ms_per_token_ = ms_per_token_ <= 0 ? x : (1.0 - kWeight) * ms_per_token_ + kWeight * x;
    }

    /// The measured milliseconds per token of prefill-carrying steps; 0 before any.
    double ms_per_token() const { return ms_per_token_; }

private:
    static constexpr double kWeight = 0.5;  ///< of the newest step: adapts within a few steps
    static constexpr double kStretch = 1.2; ///< the longest step, in targets, efficient_prefill may ask
    double target_ms_;
    size_t min_prefill_;
    size_t max_budget_;
    size_t efficient_prefill_;
    double ms_per_token_ = 0;  ///< 0 until the first observation
};

/// Bounds the prompt tokens of one step so that a step carrying prefill stays within
/// `bound_ms` (`--max-step-ms`) when the machine slows down. WHY: under CPU contention one
/// step of a full prefill piece has been seen to take over a minute; every decoding stream,
/// every cancel and every between-steps reply (ping, tokenize) waits for the whole step.
///
/// The limit is always on the grid `full >> k` (full, full/2, full/4, ... down to the
/// smallest such size >= `min_piece`), so piece sizes come from a fixed set whatever the
/// timing history: a run that never slows down uses exactly `full`. Pure: the loop reports
/// each whole step that carried prefill (observe()). Only a step *at the limit* (its prompt
/// tokens at least half of it) counts: a small one (the end of a prompt, a paced step beside
/// decodes) is dominated by its fixed cost. Contract:
///   * off (bound <= 0): limit() is always `full`;
///   * a step over the bound shrinks the limit to the largest grid size that its rate (ms per
///     token of the step, fixed cost included) fits in the bound, at least the smallest;
///   * the shrink must pay: the next step at the new limit must save at least half of what
///     the rate promised (e.g. a halving at least a quarter of the step's time). When it does
///     not, the step's cost is not in its tokens (on an oversubscribed CPU every graph node
///     waits for descheduled threads, whatever the batch), smaller pieces would only cost
///     throughput: the limit goes one grid step back up and stays there or above (the
///     "floor") until a step comes in within the bound;
///   * the limit doubles (one grid step per observed step, up to `full`) when a piece twice
///     as big would take at most half the bound at that rate: hysteresis, so the limit does
///     not flip between two sizes on noise. A step within the bound also lifts the floor.
class PieceSizer {
public:
    PieceSizer(double bound_ms, size_t full, size_t min_piece)
        : bound_ms_(bound_ms), full_(std::max<size_t>(full, 1)) {
        while ((full_ >> (max_shift_ + 1)) >= std::max<size_t>(min_piece, 1)) ++max_shift_;
        cap_ = max_shift_;
    }

    bool adaptive() const { return bound_ms_ > 0; }
    /// Most prompt tokens (over all generations) the next step may carry: full >> shift.
    size_t limit() const { return full_ >> shift_; }
    /// The smallest size the limit can take now (raised by a shrink that did not pay).
    size_t floor() const { return full_ >> cap_; }

    /// A whole step of `tokens` tokens, `prefill_tokens` of them prompt tokens, took `ms`.
    void observe(size_t prefill_tokens, size_t tokens, double ms) {
        if (!adaptive() || tokens == 0 || 2 * prefill_tokens < limit() || !(ms > 0)) return;
        const double per_token = ms / static_cast<double>(tokens);
        auto cost = [&](unsigned shift) { return per_token * static_cast<double>(full_ >> shift); };
        if (checking_) {  // the first step since a shrink: did it pay?
            checking_ = false;
            if (ms > promised_ms_) {
                shift_ = shift_ - 1;
                cap_ = shift_;
                return;
            }
        }
        if (ms > bound_ms_) {
            const unsigned from = shift_;
            while (shift_ < cap_ && cost(shift_) > bound_ms_) ++shift_;
            if (shift_ != from) {
                checking_ = true;
                const double ratio = static_cast<double>(full_ >> shift_) / static_cast<double>(full_ >> from);
                promised_ms_ = ms * (1.0 + ratio) / 2.0;  // at least half the proportional saving
            }
            return;
        }
        cap_ = max_shift_;
        if (shift_ > 0 && cost(shift_ - 1) <= bound_ms_ / 2) --shift_;
    }

private:
    double bound_ms_;
    size_t full_;
    unsigned shift_ = 0;
    unsigned max_shift_ = 0;
    unsigned cap_ = 0;          ///< the largest shift in use now (floor())
    bool checking_ = false;     ///< the next step at the limit tells whether the last shrink paid
    double promised_ms_ = 0;    ///< ... it did when that step takes at most this long
};

/// Most tokens plan_step() can put in one step: the engine's batch must hold this many.
inline size_t max_step_tokens(size_t budget, size_t capacity) { return std::max(budget, size_t(1)) + capacity; }

}  // namespace trioserve
