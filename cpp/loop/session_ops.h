// loop/session_ops.h — named sessions in WorkerLoop: the session ops (spec §5), evicting an
// idle session's slot with its state spilled to host memory, restoring a spilled session into
// a slot, and the capacity fields of their replies.
// Implements spec/worker-protocol.md §5 (session operations), §6 (slots and sessions) and §6.1
// (spill and restore).
#pragma once

#include "loop/worker_loop.h"

namespace trioserve {

/// The idle named session bound to `slot` (an eviction victim), copied for the spill store
/// (spec §6.1) when the engine can save it and the budget allows; empty otherwise (the
/// session is then dropped at commit). Reads the slot only.
inline SpillStore::Prepared WorkerLoop::save_victim(const Slot& slot) {
    if (slot.dirty || slot.resident.empty() || spill_.budget() == 0) return {};
    SpilledSession e;
    // Into the spare (state_buffer.h): touched while idle, so the save does not fault in
    // fresh pages on the path of the request that evicts. The store counts state.size();
    // a spare much larger than this state is given back and the state copied to its size,
    // so an entry never holds more than 1/8 (+ the spare's MiB rounding) beyond its count.
    e.state = spare_.take();
    if (engine_.save_state(slot.index, e.state) != Status::ok) {
        spare_.give(std::move(e.state));
        return {};
    }
    spare_.note_size(e.state.size());
    if (e.state.capacity() > e.state.size() + e.state.size() / 8 + SpareStateBuffer::kMinBytes) {
        std::vector<uint8_t> exact(e.state.begin(), e.state.end());
        spare_.give(std::move(e.state));
        e.state = std::move(exact);
    }
    e.resident = slot.resident;
    e.checkpoints = checkpoints_.copy_of(slot.index);
    e.long_retention = slot.long_retention;
    return spill_.prepare(slot.session, std::move(e));
}

/// Unbinds the (idle) session bound to `slot`, keeping a copy of its state in the spill
/// store when the engine can save it and the budget allows (spec §6.1). The slot keeps its
/// tokens (the caller takes it next). A failed save just drops the session.
inline void WorkerLoop::evict_session(Slot& slot) {
    SpillStore::Prepared victim = save_victim(slot);
    slots_.unbind(slot);
    if (!victim.empty()) spill_.put(std::move(victim));
}

/// Loads `sid`'s spilled state (if any) into `slot`, just bound to it. Returns the tokens
/// restored (0: nothing spilled, or the load failed and the slot is reset).
inline size_t WorkerLoop::restore_session(Slot& slot, const std::string& sid, double& ms) {
    std::optional<SpilledSession> e = spill_.take(sid);
    if (!e) return 0;
    const auto t0 = Clock::now();
    const Status st = engine_.load_state(slot.index, e->state);
    ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (st != Status::ok || engine_.position(slot.index) != static_cast<int64_t>(e->resident.size())) {
        std::fprintf(stderr, "trioserve-worker: restoring session state failed (%s); prefilling instead\n",
                     status_name(st));
        if (engine_.reset(slot.index) != Status::ok) {
            SlotTable::mark_dirty(slot);
            return 0;
        }
        slot.resident.clear();
        slot.dirty = false;
        return 0;
    }
    slot.resident = std::move(e->resident);
    slot.dirty = false;
    checkpoints_.swap_in(slot.index, e->checkpoints);  // its own come back with its state
    return slot.resident.size();
}

/// Offers the persistent store (spec §6.4) every state it lacks: idle clean slots whose
/// generation ended since their last offer, and spilled sessions. Runs while the loop is idle
/// (`reader`: stops as soon as input waits, which goes first) and at drain (`reader` null:
/// waits for room in the writer's queue). The save runs here, on the loop thread (the engine
/// is not thread-safe); the write on the store's writer thread. A failed save only means the
/// state is not stored.
inline void WorkerLoop::persist_idle(InputReader* reader) noexcept {
    if (!store_.enabled()) return;
    const size_t min_tokens = std::max<size_t>(opts_.min_shared_prefix, 1) + 1;  // usable by a lookup
    auto make_room = [&] {
        if (store_.room()) return true;
        if (reader != nullptr) return false;  // the next idle moment
        store_.flush();
        return true;
    };
    try {
        for (size_t i = 0; i < slots_.capacity(); ++i) {
            if (persist_pending_[i] == 0) continue;
            if (reader != nullptr && reader->wait(0)) return;
            const Slot& s = slots_.at(static_cast<int32_t>(i));
            if (!s.dirty && s.busy == 0 && s.resident.size() >= min_tokens && !store_.has(s.session, s.resident)) {
                if (!make_room()) return;
                std::vector<uint8_t> body;
                if (engine_.save_state(s.index, body) == Status::ok) store_.offer(s.session, s.resident, std::move(body));
            }
            persist_pending_[i] = 0;
        }
        if (spill_offered_.size() >= kMaxOfferedSpills) spill_offered_.clear();
        std::vector<std::pair<std::string, const SpilledSession*>> spilled;
        spill_.for_each([&](const std::string& sid, const SpilledSession& e) {
            if (e.resident.size() >= min_tokens && spill_offered_.count(store_.key_of(sid, e.resident)) == 0 &&
                !store_.has(sid, e.resident))
                spilled.emplace_back(sid, &e);
        });
        for (const auto& [sid, e] : spilled) {
            if (reader != nullptr && reader->wait(0)) return;
            if (!make_room()) return;
            if (store_.offer(sid, e->resident, e->state)) spill_offered_.insert(store_.key_of(sid, e->resident));
        }
    } catch (const std::exception&) {  // bad_alloc: not stored this time
    }
}

/// Resets engine slot `si` (admission); throws engine_error when the engine fails.
inline void WorkerLoop::reset_engine_slot(int32_t si) {
    const Status st = engine_.reset(si);
    if (st != Status::ok)
        throw RequestError{"engine_error", std::string("slot reset failed: ") + status_name(st), json::object()};
}

inline json WorkerLoop::capacity_extra(const std::string& sid) const {
    json extra{{"capacity", static_cast<int64_t>(slots_.capacity())}};
    if (!sid.empty()) extra["session_id"] = sid;
    return extra;
}

/// The slot bound to named session `sid`, or nullptr when a new one can be bound. Throws
/// unsupported_session (capacity 1) or capacity_exhausted (nothing to bind).
inline Slot* WorkerLoop::named_slot_for(const std::string& sid) {
    const int64_t cap = static_cast<int64_t>(slots_.capacity());
    json extra{{"session_id", sid}, {"capacity", cap}};
    if (cap <= 1) throw RequestError{"unsupported_session", "this worker hosts no named sessions (capacity 1)", extra};
    if (Slot* s = slots_.find_session(sid)) return s;
    if (slots_.pick_for_binding() < 0 && slots_.pick_eviction() < 0)
        throw RequestError{"capacity_exhausted", "no idle slot to bind the session to (every bound session is busy)",
                           extra};
    return nullptr;
}

inline std::string WorkerLoop::session_id_field(const json& req) {
    auto it = req.find("session_id");
    if (it == req.end() || !it->is_string() || it->get_ref<const std::string&>().empty())
        throw detail::invalid("'session_id' must be a non-empty string");
    return it->get<std::string>();
}

inline void WorkerLoop::handle_session_op(const json& req, uint64_t id, const std::string& op) {
    const std::string sid = session_id_field(req);
    Slot* s = nullptr;
    bool found = true;
    if (op == "session_open") {
        s = named_slot_for(sid);
        if (!s) {
            int32_t si = slots_.pick_for_binding();
            std::string name = sid;  // allocated before anything changes
            if (si < 0) {
                si = slots_.pick_eviction();
                evict_session(slots_.at(si));
            }
            slots_.bind(si, std::move(name));
            double ms = 0;
            restore_session(slots_.at(si), sid, ms);
        }
    } else if ((s = slots_.find_session(sid)) == nullptr) {  // close/reset: drop a spilled copy too
        found = spill_.erase(sid);
        found = store_.erase_session(sid) > 0 || found;  // and its stored states (spec §6.4)
    } else {
        if (s->busy != 0)
            throw RequestError{"session_busy",
                               "session '" + sid + "' is running generation " + std::to_string(s->busy),
                               json{{"session_id", sid}}};
        spill_.erase(sid);
        store_.erase_session(sid);
        persist_pending_[static_cast<size_t>(s->index)] = 0;  // never stored under no name
        if (op == "session_close") {
            slots_.unbind(*s);
        } else {  // session_reset
            const Status st = engine_.reset(s->index);
            if (st != Status::ok) {
                SlotTable::mark_dirty(*s);
                throw RequestError{"engine_error", std::string("session reset failed: ") + status_name(st),
                                   json{{"session_id", sid}}};
            }
            s->resident.clear();
            s->dirty = false;
        }
    }
    out_.write_json(json{{"type", "ack"}, {"id", id}, {"op", op}, {"session_id", sid}, {"found", found}});
}

}  // namespace trioserve
