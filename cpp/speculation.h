// speculation.h — exact self-speculative decoding: the pure parts (unit-tested in
// cpp/tests/test_speculation.cpp). Spec: spec/worker-protocol.md §4.6.
//
// A decoding generation with a draft d1..dk (draft_index.h) appends its pending token and the
// k draft tokens in ONE item of the shared engine step, with logits at every position
// (StepItem::all_logits). Then, position by position, the engine samples the token that
// follows (Engine::sample_draft) exactly as plain decoding samples it: the same sampler chain,
// the same RNG stream, one draw per emitted token, in order. Each sampled token goes through
// the generation's ordinary
// per-token path (EOS, UTF-8, stop strings, length): the first that ends the generation
// ends it, and the first that differs from the draft ends the verification (it becomes the
// pending token). The KV cells of rejected draft tokens are removed (Engine::truncate), so
// the slot holds exactly what plain decoding would have appended.
//
// Why this is the exact rule for a deterministic draft (a point mass on x): the rule is
// "accept x with probability p(x), else draw from p with x removed, renormalised". Drawing
// y ~ p and accepting iff y == x realises it: P(accept) = p(x), and given a rejection y is
// distributed as p without x, renormalised. Realised this way (a coupling) the emitted tokens
// do not depend on the draft at all: with the same seed, the output with drafting is token
// for token the output without it, at any temperature (spec §9.3 "same seed, same output"
// holds), and only the number of steps changes. Rejected positions are never sampled, so the
// RNG stream advances exactly as in plain decoding.
//
// Adaptivity (never a loss): per generation an acceptance estimate; per step a choice of
// draft lengths that maximises expected tokens per unit of cost under the costs of the steps
// that actually ran at this shape (streams, context depth: step_cost.h), against the same
// step without drafts. When drafting would not pay (many streams, prose, low acceptance) or
// its cost at this shape is unknown, every length is zero and the step is exactly a plain one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "draft_index.h"
#include "engine.h"
#include "step_cost.h"

namespace trioserve {

/// `--speculative`: auto (adaptive drafting) or off.
enum class SpeculativeMode { off, automatic };

/// One generation's speculation state (owned by its Generation; loop thread only).
struct SpecState {
    RequestDraftIndex index;     ///< prompt + output so far
    size_t indexed_output = 0;   ///< output ids already appended to `index`
    std::vector<TokenId> buf;    ///< the step item: pending token, then the draft
    Draft candidate;             ///< this step's draft before the length choice
    // Acceptance: a geometric model, P(draft token j accepted | j-1 were) = alpha, counted per
    // match length (a suffix of 8 ids matched again is mostly a copy; of 2, often chance) with
    // exponential forgetting, so a generation that moves from copying to writing adapts. Before
    // it has evidence, a prior by match length (kPrior*) decides, so the first drafts of a
    // copy are taken on a machine where only a confident draft pays.
    double acc = 0, rej = 0;                 ///< all match lengths together (diagnostics)
    double acc_by[3] = {0, 0, 0}, rej_by[3] = {0, 0, 0};  ///< match 8 / 4 / 2
    int64_t drafted = 0, accepted = 0, verify_steps = 0;
    int64_t skipped = 0;  ///< steps with a candidate draft that was not used (cost model said no)

    static constexpr double kPriorAlpha[3] = {0.85, 0.6, 0.35};  ///< match 8 / 4 / 2
    static constexpr double kPriorWeight = 2.0;  ///< the prior counts as this many verifications
    static constexpr double kForget = 0.9;

    static size_t bucket(size_t match) { return match >= 8 ? 0 : match >= 4 ? 1 : 2; }

    /// The acceptance estimate for a draft whose suffix matched `match` ids.
    double alpha(size_t match) const {
        const size_t b = bucket(match);
        const double p = kPriorAlpha[b] * kPriorWeight;
        return (acc_by[b] + p) / (acc_by[b] + rej_by[b] + kPriorWeight);
    }
    /// Over all match lengths (no prior): diagnostics and tests.
    double alpha() const { return acc + rej > 0 ? acc / (acc + rej) : 0.5; }

    /// A verification of `k` draft tokens (suffix match `match`) accepted `a` of them.
    void observe(size_t k, size_t a, size_t match = 8) {
        if (k == 0) return;
        const size_t b = bucket(match);
        const double r = a < k ? 1.0 : 0.0;
        acc = acc * kForget + static_cast<double>(a);
        rej = rej * kForget + r;
        acc_by[b] = acc_by[b] * kForget + static_cast<double>(a);
        rej_by[b] = rej_by[b] * kForget + r;
        drafted += static_cast<int64_t>(k);
        accepted += static_cast<int64_t>(a);
        ++verify_steps;
    }
    // Probing: the prior caps what a draft is expected to yield at 1/(1 - alpha) tokens (6.7 at
    // 0.85) however long it is, so on a machine where a many-token step costs several one-token
    // steps the cost model declines every draft and the estimate never meets evidence, even
    // for an output that copies its context verbatim (where n-gram drafting pays most). A
    // single stream whose confident candidate (a suffix match of 8+ ids) was declined
    // kProbeEvery steps in a row verifies one draft of up to kProbeLen tokens anyway; its
    // outcome (observe()) sets the estimate, and the cost model decides from then on. Worst
    // case (every probe rejected outright) about one extra kProbeLen-token step per
    // kProbeEvery tokens; not with several streams, whose steps carry other generations, and
    // not where the measured cost says even a fully accepted kProbeLen draft would not pay
    // (the caller passes n_decode 0 then). This is the acceptance probe; the cost of a shape
    // never drafted is measured by the table's own probe (StepCostTable::probe_due).
    static constexpr size_t kProbeEvery = 64;
    static constexpr size_t kProbeLen = 8;
    static constexpr size_t kProbeMatch = 8;
    size_t declined = 0;  ///< consecutive steps whose confident candidate the cost model declined

    /// The draft length to verify anyway in a step whose chosen length is 0 (a probe), or 0;
    /// `match` and `avail` describe the candidate, `n_decode` the step's decoding streams.
    /// Counts the declined steps (a probe restarts the count).
    size_t probe_length(size_t match, size_t avail, size_t n_decode) {
        if (n_decode != 1 || match < kProbeMatch || avail == 0) {
            declined = 0;
            return 0;
        }
        if (++declined < kProbeEvery) return 0;
        declined = 0;
        return std::min(avail, kProbeLen);
    }

    /// A step where a draft was there but not taken: the evidence fades toward the prior, so a
    /// generation whose text turns copyable again gets probed again.
    void idle() {
        ++skipped;
        for (size_t b = 0; b < 3; ++b) {
            acc_by[b] *= 0.95;
            rej_by[b] *= 0.95;
        }
    }
};

}  // namespace trioserve
