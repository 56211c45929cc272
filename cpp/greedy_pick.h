// greedy_pick.h — the llama engine's greedy fast path: the index of the first maximum of a
// logits row, the token llama.cpp's greedy sampler picks from a candidates array in id order.
//
// WHY vectorized: it is the only per-token work of the worker besides llama_decode that grows
// with the vocabulary. The scalar loop costs ~8 instructions per entry (393k per token over
// SmolLM2's 49,152 entries, callgrind: 0.37 % of a token's instructions, about as much as the
// rest of the worker loop 100 times over); four lanes of SSE2, always present on x86-64, cut it
// to ~3.5 (173k, callgrind). Other architectures keep the scalar loop.
//
// Semantics, kept exactly (cpp/tests/test_greedy_pick.cpp checks both paths against llama.cpp's
// sampler): a strictly greater logit replaces, so the first of equal maxima wins (+0 and -0 are
// equal); NaN never compares greater, so NaN entries are skipped, except a NaN at index 0,
// which stays the pick (the scalar loop starts from row[0]); a row of -inf picks 0.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace trioserve {

/// The scalar definition: `row[from..n)` scanned after (`best`, `top`) = (index, its value).
inline int32_t greedy_pick_scalar(const float* row, int32_t n, int32_t from = 1, int32_t best = 0) {
    float top = row[best];
    for (int32_t t = from; t < n; ++t)
        if (row[t] > top) { top = row[t]; best = t; }
    return best;
}

/// The index of the first maximum of `row[0..n)` (n >= 1), as defined above.
inline int32_t greedy_pick(const float* row, int32_t n) {
#if defined(__SSE2__)
    if (n < 8 || std::isnan(row[0])) return greedy_pick_scalar(row, n);
    // Lane j sees entries 4k+j; each lane keeps its first strictly greater value (from -inf,
    // so a lane of -inf and NaN keeps index -1) and where it was.
    __m128 top = _mm_set1_ps(-INFINITY);
    __m128i best = _mm_set1_epi32(-1);
    __m128i at = _mm_set_epi32(3, 2, 1, 0);
    const __m128i step = _mm_set1_epi32(4);
    const int32_t n4 = n & ~3;
    for (int32_t t = 0; t < n4; t += 4) {
        const __m128 x = _mm_loadu_ps(row + t);
        const __m128i gt = _mm_castps_si128(_mm_cmpgt_ps(x, top));  // false for a NaN x
        top = _mm_max_ps(x, top);  // maxps returns its second operand for a NaN: top stays
        best = _mm_or_si128(_mm_and_si128(gt, at), _mm_andnot_si128(gt, best));
        at = _mm_add_epi32(at, step);
    }
    alignas(16) float lane_top[4];
    alignas(16) int32_t lane_best[4];
    _mm_store_ps(lane_top, top);
    _mm_store_si128(reinterpret_cast<__m128i*>(lane_best), best);
    // The row's maximum, then the smallest index holding it: each lane's index is its first.
    int32_t pick = 0;  // row[0] is not NaN: a row of -inf (and NaN) picks 0
    float value = row[0];
    for (int j = 0; j < 4; ++j) {
        if (lane_best[j] < 0) continue;
        if (lane_top[j] > value || (lane_top[j] == value && lane_best[j] < pick)) {
            value = lane_top[j];
            pick = lane_best[j];
        }
    }
    // The tail: later indices, so only a strictly greater value replaces.
    for (int32_t t = n4; t < n; ++t)
        if (row[t] > value) { value = row[t]; pick = t; }
    return pick;
#else
    return greedy_pick_scalar(row, n);
#endif
}

}  // namespace trioserve
