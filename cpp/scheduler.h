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
#include <limits>
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
///
/// `efficient` > 0 (no grid): a piece of at least that many tokens does not leave a smaller
/// last piece (before the prompt's end or its next checkpoint mark) when it can help it: it
/// takes that tail too when that puts at most `max_extend` tokens over the budget and the
/// step's prefill stays within `max_chunk`; else, when the piece is cut by `max_chunk` (not
/// by the budget), it leaves exactly `efficient` tokens for the last piece. WHY: below 64
/// queries llama.cpp's CPU flash attention runs a query at a time; deep into a 17k prompt
/// (synthetic Qwen3 1.5B, 2 cores) its 34-token last piece took 11.9 s where steps of 65
/// took 5.2 s, and every decoding stream waited for it.
inline void plan_step(const std::vector<StepCandidate>& cands, size_t budget, size_t max_chunk,
                      std::vector<PlannedItem>& out, size_t grid = 0, size_t efficient = 0,
                      size_t max_extend = 0) {
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
    size_t prefill = 0;  // planned prompt tokens so far
    for (size_t i = 0; i < cands.size() && left > 0; ++i) {
        const StepCandidate& c = cands[i];
        if (c.decoding || c.prefill_remaining == 0) continue;
        size_t until = c.prefill_remaining;  // the end of this stretch: the prompt's, or its mark
        if (c.stop_at > c.prefill_start) until = std::min(until, c.stop_at - c.prefill_start);  // marks are on the grid
        size_t n = std::min({until, max_chunk, left});
        if (efficient > 0 && grid <= 1 && n >= efficient && until - n > 0 && until - n < efficient) {
            if (prefill + until <= max_chunk && (until > left ? until - left : 0) <= max_extend) n = until;  // the tail too
            else if (n == max_chunk && n - (efficient - (until - n)) >= efficient) n -= efficient - (until - n);
        }
        if (grid > 1 && n < c.prefill_remaining) {
            const size_t end = (c.prefill_start + n) / grid * grid;  // back to the grid
            n = end > c.prefill_start ? end - c.prefill_start : 0;
            if (n == 0) continue;  // not a whole piece left in this step's budget
        }
        out.push_back(PlannedItem{i, n, n == c.prefill_remaining, true});
        left -= std::min(left, n);
        prefill += n;
    }
}

/// Sizes the budget of a step that carries running decodes so that the step lasts about
/// `target_ms` (`--step-target-ms`). WHY: on a CPU backend a 512-token prefill chunk takes
/// seconds, and every decoding stream waits for the whole step: without pacing, admitting a
/// long prompt stalls the running streams for that long on every chunk. On a GPU the same
/// chunk takes milliseconds and the cap (`max_budget`) binds, so pacing changes nothing there.
///
/// Pure: the worker loop reports each paced step's tokens, duration and prompt depth
/// (observe(), which learns from the paced ones only). The estimates are exponential averages
/// of milliseconds per token, which include each step's fixed cost and so err towards shorter
/// steps. Contract of budget():
///   * pacing off (target <= 0) or no decoding stream: `max_budget` (nobody is kept waiting,
///     so the prompt gets the most efficient batch);
///   * otherwise decodes + at least `min_prefill` prompt tokens, at most `max_budget`; before
///     the first measurement exactly that minimum (a small first step measures the rate);
///     without an efficient size, where that minimum was measured over the target at this
///     depth or shallower, what fits the target, at least half as many (floor_at_depth);
///   * an engine whose kernels take longer per token below some batch (`efficient_prefill`,
///     0 = none) gets at least that many prompt tokens whenever they fit in kStretch times the
///     target at the rate measured on such steps, at this depth of prompt or less; and, where
///     the smallest small step already takes longer than the target, whenever they fit in
///     kProbeStretch times what that step takes. Steps below that size keep an estimate of
///     their own. WHY: a small step can cost nearly as much as an efficient one (synthetic
///     Qwen3 1.5B, 2 cores: at 4k, 20 prompt tokens ~0.9 s and 65 ~0.9-1.3 s; at 7k, 16
///     tokens 2-2.9 s and 65 2.5-3.4 s), so one averaged rate let one slow step talk the
///     pacer into smaller steps, each as slow as the last: a 4k prompt beside a decoding
///     stream fell from ~75 to 26 tok/s, and deep into a 16k prompt the minimum step made 4
///     prompt tokens a second while the stream waited 2-6 s all the same;
///   * when the efficient size does not fit, one step of it is still tried (a probe) when
///     predicted within kProbeStretch targets: after kReprobe small steps (a noisy step must
///     not exile the prompt to small steps for good), or at once when no efficient step has
///     been measured at this depth or less (a new prompt, or new tokens after a reused
///     prefix) and the small steps' rate (which overstates it) says so, or small steps
///     cannot keep the target anyway. Otherwise the step takes what fits the target at the
///     small steps' rate (the minimum when that was measured over kStaleDepth positions
///     shallower).
class StepPacer {
public:
    StepPacer(double target_ms, size_t min_prefill, size_t max_budget, size_t efficient_prefill = 0)
        : target_ms_(target_ms), min_prefill_(std::max<size_t>(min_prefill, 1)),
          max_budget_(std::max<size_t>(max_budget, 1)), efficient_prefill_(efficient_prefill) {}

    /// The token budget of the next step, which carries `n_decode` decodes (drafts included)
    /// and prefills prompts from position `depth` on (the deepest of them).
    size_t budget(size_t n_decode, size_t depth = 0) const {
        if (target_ms_ <= 0 || n_decode == 0) return max_budget_;
        const size_t floor = floor_tokens(n_decode);
        const double small_rate = depth <= small_depth_ + kStaleDepth ? small_rate_ : 0;  // to size a small step
        if (efficient_prefill_ > 0) {
            const size_t efficient = std::min(max_budget_, n_decode + efficient_prefill_);
            const double n = static_cast<double>(efficient_prefill_);
            if (efficient_rate_ > 0 && depth >= efficient_depth_) {
                const double cost = n * efficient_rate_;
                if (cost <= efficient_bound_ms(n_decode, depth)) return std::max(efficient, fit(efficient_rate_));
                if (small_steps_ >= kReprobe && cost <= kProbeStretch * target_ms_) return efficient;
            } else if (small_rate > 0 && (n * small_rate <= kProbeStretch * target_ms_ || floor_ms(n_decode, depth) > target_ms_)) {
                return efficient;  // a probe: the small steps' rate overstates it, or cannot keep the target anyway
            }
        }
        return small_rate > 0 ? std::max(floor_at_depth(n_decode, depth), fit(small_rate)) : floor;
    }

    /// How many tokens a step of `budget` (from budget()) may carry over it to take the small
    /// last piece of a prompt with it (plan_step's `max_extend`): what still fits the bound an
    /// efficient step is held to, at the efficient rate; no limit when nobody decodes, 0 while
    /// that rate is unknown at this depth (the small last piece then goes in small steps).
    size_t extension(size_t n_decode, size_t depth, size_t budget) const {
        if (target_ms_ <= 0 || n_decode == 0) return std::numeric_limits<size_t>::max();
        if (efficient_prefill_ == 0 || efficient_rate_ <= 0 || depth < efficient_depth_) return 0;
        const double most = efficient_bound_ms(n_decode, depth) / efficient_rate_;
        return most > static_cast<double>(budget) ? static_cast<size_t>(most) - budget : 0;
    }

    /// A step of `tokens` tokens, `decodes` of them decodes (drafts included), that carried
    /// prefill from position `depth` on took `ms`. Only a step that carried decodes counts: it
    /// is the kind budget() sizes. WHY: a step with nobody decoding takes the whole budget, the
    /// most efficient batch, and its ms per token is a fraction of a paced step's (on an MoE
    /// model every expert is read for any batch): learnt from it, the first paced step after a
    /// prompt prefilled alone ran 2.3 s against a 1 s target (synthetic Qwen3.5-MoE 3B, 2 cores).
    void observe(size_t tokens, size_t decodes, double ms, size_t depth = 0) {
        if (tokens == 0 || decodes == 0 || decodes > tokens || !(ms > 0)) return;
        const double x = ms / static_cast<double>(tokens);
        if (efficient_prefill_ > 0 && tokens - decodes >= efficient_prefill_) {
            // Measured deeper than this step: that prompt's cost per token does not apply here.
            const bool fresh = efficient_rate_ <= 0 || depth < efficient_depth_;
            efficient_rate_ = fresh ? x : blend(efficient_rate_, x);
            efficient_depth_ = depth;
            small_steps_ = 0;
        } else {
            small_rate_ = depth > small_depth_ + kStaleDepth ? x : blend(small_rate_, x);
            small_depth_ = depth;
            ++small_steps_;
        }
    }

    /// The measured milliseconds per token of paced steps (efficient ones first); 0 before any.
    double ms_per_token() const { return efficient_rate_ > 0 ? efficient_rate_ : small_rate_; }

private:
    static constexpr double kWeight = 0.5;      ///< of the newest step: adapts within a few steps
    static constexpr double kStretch = 1.2;     ///< the longest step, in targets, efficient_prefill may ask
    static constexpr double kProbeStretch = 1.6;  ///< ... and a probe of it (margin under 2 s for noise)
    static constexpr size_t kReprobe = 4;       ///< small steps between probes of the efficient size
    /// A small steps' rate measured this many prompt positions shallower is not used (the
    /// minimum measures it again). WHY: the first paced step of a prompt is small and cheap;
    /// its rate sized the first small step 3,000 tokens deeper to 2 s (1.5B at 4k).
    static constexpr size_t kStaleDepth = 512;
    static double blend(double avg, double x) { return avg <= 0 ? x : (1.0 - kWeight) * avg + kWeight * x; }
    /// What the smallest small step costs at least: at a rate measured no deeper (a prompt
    /// token costs more the deeper it goes); 0 when unknown. The streams wait that long anyway.
    double floor_ms(size_t n_decode, size_t depth) const {
        return small_rate_ > 0 && small_depth_ <= depth ? static_cast<double>(floor_tokens(n_decode)) * small_rate_ : 0;
    }
    /// The smallest paced step: the decodes and min_prefill prompt tokens, at most max_budget.
    size_t floor_tokens(size_t n_decode) const { return std::min(max_budget_, n_decode + min_prefill_); }
    /// The smallest small step at this depth: floor_tokens(), or, without an efficient size,
    /// what fits the target at the small steps' rate, down to half of min_prefill prompt
    /// tokens, where floor_tokens() was measured longer. WHY: deep into a prompt every prompt
    /// token attends to all before it, so a fixed minimum outgrows any target (dense 1.5B,
    /// flash attention off, 2 cores: 17 tokens ~1.3 s at 17k deep, and the stream waited up
    /// to 2.2 s). Where small steps cost as much a token as large ones, a smaller step costs
    /// the prompt only the decodes' share of it. Only half: where a step's cost is in its
    /// decodes (many streams, a slow machine), fewer prompt tokens do not shorten it, and the
    /// prompt must still progress. With an efficient size a small step costs the prompt
    /// several times over, and the efficient step's bound (efficient_bound_ms) is the
    /// compromise instead.
    size_t floor_at_depth(size_t n_decode, size_t depth) const {
        const size_t floor = floor_tokens(n_decode);
        if (efficient_prefill_ > 0 || floor_ms(n_decode, depth) <= target_ms_) return floor;
        return std::min(floor, std::max(fit(small_rate_), n_decode + std::max<size_t>(min_prefill_ / 2, 1)));
    }
    /// The longest an efficient step may take: kStretch targets, or kProbeStretch times the
    /// smallest step where that already takes longer than the target.
    double efficient_bound_ms(size_t n_decode, size_t depth) const {
        const double f = floor_ms(n_decode, depth);
        return f > target_ms_ ? kProbeStretch * f : kStretch * target_ms_;
    }
    size_t fit(double rate) const {
        const double n = target_ms_ / rate;
        return n >= static_cast<double>(max_budget_) ? max_budget_ : static_cast<size_t>(n);
    }
    double target_ms_;
    size_t min_prefill_;
    size_t max_budget_;
    size_t efficient_prefill_;
    double efficient_rate_ = 0;  ///< ms per token of steps with >= efficient_prefill prompt tokens
    size_t efficient_depth_ = 0; ///< ... the prompt position of the last one
    double small_rate_ = 0;      ///< ms per token of smaller paced steps (all of them when no efficient size)
    size_t small_depth_ = 0;     ///< ... the prompt position of the last one
    size_t small_steps_ = 0;     ///< small paced steps since the last efficient one
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
