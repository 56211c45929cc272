// prefill_plan.h — pure decisions taken before prefill: context clamp and warm-resume plan
// (chunking is the scheduler's, scheduler.h). No engine calls here, so the rules are
// unit-tested in isolation (cpp/tests/test_prefill_plan.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace trioserve {

/// Context clamp (spec §4 "Context clamp"). Returns the number of tokens the request may
/// generate, or -1 when the prompt leaves no room (context_length_exceeded).
/// `max_new_tokens` == -1 means "until the context is full".
inline int64_t clamp_max_new(int64_t prompt_tokens, int64_t n_ctx, int64_t max_new_tokens) {
    const int64_t room = n_ctx - prompt_tokens;
    if (room <= 0) return -1;
    if (max_new_tokens < 0 || max_new_tokens > room) return room;
    return max_new_tokens;
}

/// What to do with a slot's resident tokens before prefilling `prompt`.
struct PrefillPlan {
    bool reset = false;   ///< clear the whole slot first
    size_t keep = 0;      ///< resident tokens kept (prompt[0, keep) reused); prefill prompt[keep, end)
    const char* reason = "new";  ///< new | dirty | exact_prefix | trimmed | mismatch
};

/// Plans a (warm) prefill of `prompt` into a slot holding `resident` (named session or
/// anonymous: both are reused warm, spec §6).
///   * dirty slots, or slots without resident tokens: full reset;
///   * otherwise keep the longest common prefix of resident and prompt, but always prefill at
///     least one token (its logits are needed to sample the first new token);
///   * keeping fewer tokens than are resident needs truncation; without it: full reset;
///   * `grid` > 1 (`--deterministic`): the kept prefix is cut back to a multiple of `grid`, so
///     the prefill resumes where a cold run's piece starts (spec/worker-protocol.md §4.5).
inline PrefillPlan plan_prefill(const std::vector<int32_t>& resident, const std::vector<int32_t>& prompt,
                                bool dirty, bool supports_truncate, size_t grid = 0) {
    PrefillPlan p;
    if (dirty) { p.reset = true; p.reason = "dirty"; return p; }
    if (resident.empty()) { p.reset = true; p.reason = "new"; return p; }
    size_t lcp = 0;
    const size_t lim = std::min(resident.size(), prompt.size());
    while (lcp < lim && resident[lcp] == prompt[lcp]) ++lcp;
    if (!prompt.empty() && lcp >= prompt.size()) lcp = prompt.size() - 1;
    if (grid > 1) lcp = lcp / grid * grid;
    if (lcp == resident.size()) { p.keep = lcp; p.reason = "exact_prefix"; return p; }
    if (lcp > 0 && supports_truncate) { p.keep = lcp; p.reason = "trimmed"; return p; }
    p.reset = true;
    p.reason = "mismatch";
    return p;
}

}  // namespace trioserve
