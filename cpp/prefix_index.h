// prefix_index.h — where the longest prefix of a prompt is held in the worker (spec §6.2).
//
// Every clean slot's resident ids and every spilled session's ids are candidates. A generate
// whose own slot holds less of its prompt than some other slot or spill entry starts from that
// other state instead (loop/prefix_sharing.h copies it into its slot, then trims it to the shared
// prefix), so a new session, an anonymous request or a returning session whose own state is
// gone does not prefill a system prompt the worker already holds.
//
// Isolation: only an identical token prefix is ever taken, and the copy is trimmed to it
// before anything is prefilled, so no state past the divergence reaches the new slot. A source
// that cannot be trimmed to the shared prefix (recurrent state, a sliding-window cache that
// dropped the cells needed) is taken only when ALL of it is a prefix of the prompt.
//
// The index is not a separate structure: slots (<= capacity) and spill entries (bounded by
// the spill budget) are scanned per admission. With a handful of slots and entries the scan
// is a few common-prefix walks, microseconds next to one prefill token; a radix tree would pay
// off only with thousands of resident states.
//
// Pure bookkeeping (no engine calls): the truncation test is passed in, so the choice is
// unit-tested alone (cpp/tests/test_prefix_index.cpp). Thread-safety: none, loop thread only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "slot_table.h"
#include "spill_store.h"

namespace trioserve {

/// The best state to start a prompt from, other than the generation's own slot.
struct PrefixSource {
    enum class Kind { none, slot, spill };
    Kind kind = Kind::none;
    int32_t slot = -1;    ///< Kind::slot: the source slot
    std::string session;  ///< Kind::spill: the spilled session whose entry is copied
    size_t keep = 0;      ///< prompt tokens the copy provides (the shared prefix, trimmed to)
};

/// Tokens of `prompt` a state holding `state` can provide: the common prefix, capped at
/// prompt.size() - 1 (one prompt token is always prefilled: its logits seed the first sample).
/// With `grid` > 1 (`--deterministic`) it is cut back to a multiple of the grid, and to
/// `limit` (the state's tokens computed in whole grid pieces; spec/worker-protocol.md §4.5).
inline size_t usable_prefix(const std::vector<TokenId>& state, const std::vector<TokenId>& prompt, size_t grid = 0,
                            size_t limit = SIZE_MAX) {
    size_t k = common_prefix(state, prompt);
    if (!prompt.empty() && k >= prompt.size()) k = prompt.size() - 1;
    if (grid > 1) k = std::min(k, limit) / grid * grid;
    return k;
}

/// Finds the state, other than slot `own`, that holds the longest prefix of `prompt` and
/// beats `own_keep` (what the generation's own slot provides) by at least `min_gain` tokens.
///
/// `can_trim_slot(slot, keep)` says whether a slot's state can be cut back to `keep` tokens
/// (after a copy the destination holds the same cells, so the source answers for it);
/// `spill_trimmable` whether a spilled state can be cut back at all once loaded. A source
/// usable only whole is taken when keep == its length. Dirty slots are skipped (their ids are
/// not trusted). Busy slots are candidates: between steps a busy slot's state is exactly its
/// resident ids. Ties prefer slots (no host-memory load) and then the lower index.
/// `grid` > 1: shared prefixes are multiples of it, and at most `slot_limit(slot)` of a slot's
/// tokens (those computed in whole grid pieces) are shared; spilled states hold only such.
inline PrefixSource find_prefix_source(const SlotTable& slots, const SpillStore& spill,
                                       const std::vector<TokenId>& prompt, int32_t own, size_t own_keep,
                                       size_t min_gain, const std::function<bool(int32_t, size_t)>& can_trim_slot,
                                       bool spill_trimmable, size_t grid = 0,
                                       const std::function<size_t(int32_t)>& slot_limit = {}) {
    PrefixSource best;
    size_t floor = own_keep + (min_gain > 0 ? min_gain : 1);  // a source must provide at least this
    auto better = [&](size_t keep) { return keep >= floor && keep > best.keep; };
    for (size_t i = 0; i < slots.capacity(); ++i) {
        const Slot& s = slots.at(static_cast<int32_t>(i));
        if (s.index == own || s.dirty || s.resident.empty()) continue;
        const size_t keep = usable_prefix(s.resident, prompt, grid, slot_limit ? slot_limit(s.index) : SIZE_MAX);
        if (!better(keep)) continue;
        if (keep < s.resident.size() && !can_trim_slot(s.index, keep)) continue;
        best.kind = PrefixSource::Kind::slot;
        best.slot = s.index;
        best.session.clear();
        best.keep = keep;
    }
    spill.for_each([&](const std::string& session, const SpilledSession& e) {
        const size_t keep = usable_prefix(e.resident, prompt, grid);
        if (!better(keep)) return;
        if (keep < e.resident.size() && !spill_trimmable) return;
        best.kind = PrefixSource::Kind::spill;
        best.slot = -1;
        best.session = session;
        best.keep = keep;
    });
    return best;
}

}  // namespace trioserve
