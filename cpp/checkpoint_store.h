// checkpoint_store.h — per-slot context checkpoints for sliding-window models (spec §6.3).
//
// With a small sliding-window cache (llama.cpp swa_full = false) a slot keeps only the last
// window of cells of its sliding-window layers, so it cannot be cut back to a position more
// than a window behind its end: a prompt that diverges there would prefill from zero. A
// checkpoint is the window part of a slot's state saved at a position P (the end of a prompt's
// prefill: a turn boundary); restoring it into a slot that still holds the same first P ids
// (full-attention cells are never dropped) and cutting the rest brings the slot back to P.
//
// Validity is by token ids: a checkpoint records the ids [0, P) it was taken over, and is used
// only for a slot whose resident ids and whose new prompt both start with them. The cells of a
// position depend only on the ids up to it, so how the slot came to hold those ids (prefill,
// restore, copy) does not matter; a slot that lost them (reset, diverged) simply stops
// matching. Checkpoints belong to the slot, not to a session: they are not spilled with an
// evicted session (a spilled state is restored whole, spec §6.2).
//
// Bounded: at most `per_slot` a slot (the oldest is dropped first), each the size of one
// window of cells. Pure bookkeeping, no engine calls (unit-tested alone:
// cpp/tests/test_checkpoint_store.cpp). Thread-safety: none, loop thread only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine.h"

namespace trioserve {

struct SlotCheckpoint {
    std::vector<TokenId> tokens;  ///< the slot's ids when it was taken: its position is tokens.size()
    std::vector<uint8_t> state;   ///< Engine::save_checkpoint() bytes
    uint64_t bytes() const { return state.size() + tokens.size() * sizeof(TokenId); }
};

class CheckpointStore {
public:
    CheckpointStore(size_t slots, size_t per_slot) : per_slot_(per_slot), by_slot_(slots) {}

    size_t per_slot() const { return per_slot_; }
    size_t count(int32_t slot) const { return by_slot_.at(idx(slot)).size(); }

    /// Host memory held by every checkpoint (state bytes and ids).
    uint64_t bytes() const {
        uint64_t n = 0;
        for (const auto& list : by_slot_)
            for (const SlotCheckpoint& c : list) n += c.bytes();
        return n;
    }

    /// The checkpoints of `slot`, copied (a spilled session keeps them: spill_store.h).
    std::vector<SlotCheckpoint> copy_of(int32_t slot) const { return by_slot_.at(idx(slot)); }

    /// Gives `slot` the checkpoints in `list` and `list` the slot's old ones (a restored
    /// session's come back with its state). Allocates nothing (admission commit).
    void swap_in(int32_t slot, std::vector<SlotCheckpoint>& list) noexcept { by_slot_[idx(slot)].swap(list); }

    /// The checkpoint in `list` at the highest position <= `limit` (and > 0) whose ids are
    /// a prefix of `prompt`, or null.
    static const SlotCheckpoint* best_in(const std::vector<SlotCheckpoint>& list, const std::vector<TokenId>& prompt,
                                         size_t limit) {
        const SlotCheckpoint* out = nullptr;
        for (const SlotCheckpoint& c : list) {
            const size_t p = c.tokens.size();
            if (p == 0 || p > limit || p > prompt.size() || (out != nullptr && p <= out->tokens.size())) continue;
            if (std::equal(c.tokens.begin(), c.tokens.end(), prompt.begin())) out = &c;
        }
        return out;
    }

    /// The checkpoint of `slot` at the highest position <= `limit` (and > 0) whose ids are a
    /// prefix of `prompt`, or null.
    const SlotCheckpoint* best(int32_t slot, const std::vector<TokenId>& prompt, size_t limit) const {
        return best_in(by_slot_.at(idx(slot)), prompt, limit);
    }

    /// Adds a checkpoint of `slot` (newest). One over the same ids replaces the older one;
    /// beyond `per_slot` the oldest is dropped — except the slot's shortest one while another
    /// is left to drop. WHY: the shortest is usually the end of the system prompt and tools
    /// (the control plane's first mark, spec §6.3), the one other sessions and sub-agents
    /// start from; a long conversation's turns would otherwise push it out by its third turn.
    /// per_slot 0 keeps nothing.
    void add(int32_t slot, SlotCheckpoint c) {
        if (per_slot_ == 0) return;
        auto& list = by_slot_.at(idx(slot));
        list.erase(std::remove_if(list.begin(), list.end(),
                                  [&](const SlotCheckpoint& o) { return o.tokens == c.tokens; }),
                   list.end());
        while (!list.empty() && list.size() >= per_slot_) {
            auto shortest = std::min_element(list.begin(), list.end(), [](const SlotCheckpoint& a, const SlotCheckpoint& b) {
                return a.tokens.size() < b.tokens.size();
            });
            const bool keep_shortest = list.size() > 1 && c.tokens.size() > shortest->tokens.size();
            list.erase(keep_shortest && shortest == list.begin() ? list.begin() + 1 : list.begin());
        }
        list.push_back(std::move(c));
    }

    /// Drops the checkpoints of `slot` whose ids are not a prefix of `resident` (the slot
    /// diverged before them, or holds something else now). Allocates nothing (admission commit).
    void keep_prefixes_of(int32_t slot, const std::vector<TokenId>& resident) noexcept {
        auto& list = by_slot_[idx(slot)];
        list.erase(std::remove_if(list.begin(), list.end(),
                                  [&](const SlotCheckpoint& c) {
                                      return c.tokens.size() > resident.size() ||
                                             !std::equal(c.tokens.begin(), c.tokens.end(), resident.begin());
                                  }),
                   list.end());
    }

    void clear(int32_t slot) noexcept { by_slot_[idx(slot)].clear(); }

private:
    static size_t idx(int32_t slot) { return static_cast<size_t>(slot); }

    size_t per_slot_;
    std::vector<std::vector<SlotCheckpoint>> by_slot_;  ///< per slot, oldest first
};

}  // namespace trioserve
