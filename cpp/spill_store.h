// spill_store.h — host-memory copies of evicted named sessions (spec §6.1).
//
// When a named session loses its slot (LRU eviction), the worker copies the slot's state to
// host memory here, within a byte budget, and restores it into a slot when the session comes
// back, instead of prefilling its tokens again. Entries are whole: a session's state is kept
// or dropped, never cut.
//
// Making room (put): entries are dropped least recently spilled first, those with `long`
// retention (prompt_cache_retention "24h") only after every `short` one (the default,
// "in_memory"). An entry larger than the whole budget is not kept. There is no time-based
// expiry: entries live until room is needed, their session is closed, or the process ends.
//
// Pure bookkeeping (no engine calls); thread-safety: none, worker loop thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_store.h"
#include "engine.h"

namespace trioserve {

struct SpilledSession {
    std::vector<TokenId> resident;  ///< the ids the state holds, in order
    std::vector<uint8_t> state;     ///< Engine::save_state() bytes
    /// The slot's checkpoints when it was spilled (recurrent, window: spec §6.3), so a
    /// returning turn that diverges inside the state resumes from one, as in its slot.
    std::vector<SlotCheckpoint> checkpoints;
    bool long_retention = false;    ///< dropped only after every short-retention entry
    uint64_t stamp = 0;             ///< spill order (LRU among entries)

    /// What the entry counts against the spill budget: its state and its checkpoints.
    uint64_t bytes() const {
        uint64_t n = state.size();
        for (const SlotCheckpoint& c : checkpoints) n += c.bytes();
        return n;
    }
};

class SpillStore {
    using Map = std::map<std::string, SpilledSession>;

public:
    explicit SpillStore(uint64_t budget_bytes) : budget_(budget_bytes) {}

    uint64_t budget() const { return budget_; }
    uint64_t used() const { return used_; }
    size_t size() const { return entries_.size(); }
    bool contains(const std::string& session) const { return entries_.count(session) != 0; }

    /// An entry allocated ahead of put() (two-phase admission, loop/admission.h): put(Prepared&&)
    /// then allocates nothing. Empty when the entry alone exceeds the budget (it is not kept).
    class Prepared {
    public:
        Prepared() = default;
        bool empty() const { return node_.empty(); }

    private:
        friend class SpillStore;
        explicit Prepared(Map::node_type node) : node_(std::move(node)) {}
        Map::node_type node_;
    };

    /// Allocates `session`'s entry without storing it (may throw bad_alloc; changes nothing).
    Prepared prepare(const std::string& session, SpilledSession entry) const {
        if (entry.bytes() > budget_) return {};
        Map scratch;
        scratch.emplace(session, std::move(entry));
        return Prepared(scratch.extract(scratch.begin()));
    }

    /// Keeps a prepared entry (replacing an older one of its session), dropping others to
    /// make room. Allocates nothing. Returns false (nothing kept) for an empty one.
    bool put(Prepared&& p) {
        if (p.node_.empty()) return false;
        erase(p.node_.key());
        const uint64_t need = p.node_.mapped().bytes();
        while (used_ + need > budget_) drop_one();
        p.node_.mapped().stamp = ++clock_;
        used_ += need;
        entries_.insert(std::move(p.node_));
        return true;
    }

    /// Keeps `entry` for `session` (replacing an older one), dropping others to make room.
    /// Returns false (nothing kept) when the entry alone exceeds the budget.
    bool put(const std::string& session, SpilledSession entry) { return put(prepare(session, std::move(entry))); }

    /// `session`'s entry, left in place (nullptr when none).
    const SpilledSession* find(const std::string& session) const {
        auto it = entries_.find(session);
        return it == entries_.end() ? nullptr : &it->second;
    }

    /// Calls `f(session, entry)` for every entry (prefix_index.h scans them).
    template <class F>
    void for_each(F&& f) const {
        for (const auto& [session, entry] : entries_) f(session, entry);
    }

    /// Removes and returns `session`'s entry, if any.
    std::optional<SpilledSession> take(const std::string& session) {
        auto it = entries_.find(session);
        if (it == entries_.end()) return std::nullopt;
        SpilledSession e = std::move(it->second);
        used_ -= e.bytes();
        entries_.erase(it);
        return e;
    }

    /// Drops `session`'s entry; whether there was one.
    bool erase(const std::string& session) {
        auto it = entries_.find(session);
        if (it == entries_.end()) return false;
        used_ -= it->second.bytes();
        entries_.erase(it);
        return true;
    }

private:
    /// Drops the least recently spilled short-retention entry, else the oldest long one.
    void drop_one() {
        auto victim = entries_.end();
        for (auto it = entries_.begin(); it != entries_.end(); ++it) {
            if (victim == entries_.end()) { victim = it; continue; }
            const bool a = it->second.long_retention, b = victim->second.long_retention;
            if ((a == b && it->second.stamp < victim->second.stamp) || (!a && b)) victim = it;
        }
        if (victim == entries_.end()) return;
        used_ -= victim->second.bytes();
        entries_.erase(victim);
    }

    uint64_t budget_;
    uint64_t used_ = 0;
    uint64_t clock_ = 0;
    Map entries_;
};

}  // namespace trioserve
