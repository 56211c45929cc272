// slot_table.h — slots ↔ engine sequences, named-session binding and slot choice (spec §6).
// Pure bookkeeping: no engine calls, so the choice rules are unit-tested alone.
//
// Slot i is engine slot i (llama.cpp sequence id i). Each slot tracks the exact token ids
// resident in it, whether that record can be trusted (dirty), the named session bound to it
// (if any), the generation using it (if any) and when it was last used.
//
// Rules:
//   * a named session binds one slot until session_close or eviction; at most capacity - 1
//     slots are bound (capacity 1: no named sessions at all);
//   * an anonymous generation takes an idle unbound slot: the one whose resident tokens share
//     the longest common prefix with its prompt (warm reuse), else the least recently used;
//   * when a generation needs a slot and no idle unbound one fits, the least recently used
//     idle bound session is evicted (pick_eviction) and its slot taken (loop/session_ops.h spills
//     the session's state first).
//
// Thread-safety: none; worker loop thread only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"

namespace trioserve {

struct Slot {
    int32_t index = 0;
    std::vector<TokenId> resident;  ///< ids in the engine slot; invariant when clean: size == position
    bool dirty = false;             ///< state no longer matches `resident`: reset before reuse
    std::string session;            ///< bound named session; empty = unbound
    bool long_retention = false;    ///< the bound session asked for long retention (spill priority)
    uint64_t busy = 0;              ///< id of the generation using it; 0 = idle
    uint64_t last_used = 0;         ///< LRU clock value of the last acquire
};

/// Length of the longest common prefix of `a` and `b`.
inline size_t common_prefix(const std::vector<TokenId>& a, const std::vector<TokenId>& b) {
    const size_t lim = std::min(a.size(), b.size());
    size_t k = 0;
    while (k < lim && a[k] == b[k]) ++k;
    return k;
}

class SlotTable {
public:
    explicit SlotTable(size_t capacity) : slots_(capacity) {
        for (size_t i = 0; i < capacity; ++i) slots_[i].index = static_cast<int32_t>(i);
    }

    size_t capacity() const { return slots_.size(); }
    Slot& at(int32_t i) { return slots_[static_cast<size_t>(i)]; }
    const Slot& at(int32_t i) const { return slots_[static_cast<size_t>(i)]; }

    /// Most named sessions that can be bound at once.
    size_t max_named() const { return slots_.empty() ? 0 : slots_.size() - 1; }

    /// The slot bound to `session`, or nullptr.
    Slot* find_session(const std::string& session) {
        for (Slot& s : slots_)
            if (!s.session.empty() && s.session == session) return &s;
        return nullptr;
    }

    size_t bound_count() const {
        size_t n = 0;
        for (const Slot& s : slots_) n += !s.session.empty();
        return n;
    }

    size_t busy_count() const {
        size_t n = 0;
        for (const Slot& s : slots_) n += s.busy != 0;
        return n;
    }

    /// An idle unbound slot for an anonymous generation with this prompt: longest common
    /// prefix of resident tokens first (ties: least recently used), else least recently used.
    /// Returns -1 when every unbound slot is busy.
    int32_t pick_anonymous(const std::vector<TokenId>& prompt) const {
        int32_t best = -1;
        size_t best_lcp = 0;
        for (const Slot& s : slots_) {
            if (!s.session.empty() || s.busy != 0) continue;
            const size_t lcp = s.dirty ? 0 : common_prefix(s.resident, prompt);
            if (best < 0 || lcp > best_lcp || (lcp == best_lcp && s.last_used < at(best).last_used)) {
                best = s.index;
                best_lcp = lcp;
            }
        }
        return best;
    }

    /// An idle unbound slot to bind a new named session to (least recently used), or -1 when
    /// none is idle or max_named() sessions are bound already.
    int32_t pick_for_binding() const {
        if (bound_count() >= max_named()) return -1;
        int32_t best = -1;
        for (const Slot& s : slots_) {
            if (!s.session.empty() || s.busy != 0) continue;
            if (best < 0 || s.last_used < at(best).last_used) best = s.index;
        }
        return best;
    }

    /// The least recently used idle bound slot (an eviction victim), or -1 when every bound
    /// slot is busy (or none is bound).
    int32_t pick_eviction() const {
        int32_t best = -1;
        for (const Slot& s : slots_) {
            if (s.session.empty() || s.busy != 0) continue;
            if (best < 0 || s.last_used < at(best).last_used) best = s.index;
        }
        return best;
    }

    void bind(int32_t i, const std::string& session) { at(i).session = session; }
    /// Binds without allocating (admission's commit phase, loop/admission.h).
    void bind(int32_t i, std::string&& session) noexcept { at(i).session = std::move(session); }

    /// Unbinds `session` (its slot keeps its tokens: an anonymous generation may reuse them).
    void unbind(Slot& s) {
        s.session.clear();
        s.long_retention = false;
    }

    /// Marks slot `i` used by generation `id` (stamps the LRU clock).
    void acquire(int32_t i, uint64_t id) {
        Slot& s = at(i);
        s.busy = id;
        s.last_used = ++clock_;
    }

    void release(int32_t i) { at(i).busy = 0; }

    /// Token ids resident over all slots: the KV cells in use (dirty slots hold none).
    int64_t resident_tokens() const {
        int64_t n = 0;
        for (const Slot& s : slots_) n += static_cast<int64_t>(s.resident.size());
        return n;
    }

    /// Forgets a slot's contents (after an engine failure or a cancel): the next user resets it.
    static void mark_dirty(Slot& s) {
        s.dirty = true;
        s.resident.clear();
    }

private:
    std::vector<Slot> slots_;
    uint64_t clock_ = 0;
};

}  // namespace trioserve
