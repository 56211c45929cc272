// loop/prefix_sharing.h — shared prefixes in WorkerLoop: a generation whose prompt another
// slot (or a spilled session) already holds starts from a copy of that state, or waits until
// a running prefill holds it; window checkpoints for small sliding-window caches decide how
// much of a slot's state is reachable.
// Implements spec/worker-protocol.md §6.2 (shared prefixes) and §6.3 (sliding-window
// checkpoints).
#pragma once

#include "loop/worker_loop.h"

namespace trioserve {

inline bool WorkerLoop::waiting(uint64_t id) const {
    for (const PendingPrefix& w : waiters_)
        if (w.id == id) return true;
    return false;
}

inline Generation* WorkerLoop::find_active(uint64_t id) {
    for (auto& g : active_)
        if (g->id() == id && g->phase() != Generation::Phase::done) return g.get();
    return nullptr;
}

/// Among the generations in flight that still prefill (and do not wait themselves), the
/// one whose prompt shares the most of `prompt` beyond what its slot already holds, when
/// that beats `have` by opts_.min_shared_prefix (spec §6.2 "in-flight prefixes"). Only for
/// engines that can cut any state back (the copy is trimmed to the shared prefix).
inline auto WorkerLoop::pending_prefix(const std::vector<TokenId>& prompt, int32_t own, size_t have) const -> PendingPrefix {
    PendingPrefix best;
    if (opts_.min_shared_prefix == 0) return best;
    // A state that cannot be cut back (recurrent, hybrid) is shared only through a checkpoint
    // (share_checkpoint): wait for the source to reach its last mark inside the shared prefix.
    const bool trims = engine_.info().trims_any_state;
    if (!trims && checkpoints_.per_slot() == 0) return best;
    for (const auto& g : active_) {
        if (g->slot() == own || g->prefill_remaining() == 0 || waiting(g->id())) continue;
        size_t potential = usable_prefix(g->prompt(), prompt, grid());
        if (!trims) {
            size_t mark = 0;
            for (size_t m : g->marks())
                if (m <= potential) mark = m;
            potential = mark;
        }
        const size_t now = usable_prefix(slots_.at(g->slot()).resident, prompt, grid(), exact_tokens(g->slot()));
        if (potential < have + opts_.min_shared_prefix || potential <= now || potential <= best.target) continue;
        best.source_id = g->id();
        best.source_slot = g->slot();
        best.target = potential;
    }
    return best;
}

/// Step boundary: every waiting generation whose source has prefilled the shared prefix
/// (or stopped prefilling: done, cancelled, failed, its slot taken or dirty) starts from
/// a copy of what the source slot holds (copy_waited()) and joins the plan. Waiters whose
/// generation ended are dropped.
inline void WorkerLoop::resolve_waiters() {
    for (size_t i = 0; i < waiters_.size();) {
        const PendingPrefix w = waiters_[i];
        Generation* g = find_active(w.id);
        if (g != nullptr) {
            const Slot& src = slots_.at(w.source_slot);
            Generation* h = src.busy == w.source_id ? find_active(w.source_id) : nullptr;
            if (h != nullptr && !src.dirty && h->prefill_remaining() > 0 && src.resident.size() < w.target) {
                ++i;  // still coming
                continue;
            }
        }
        waiters_.erase(waiters_.begin() + static_cast<std::ptrdiff_t>(i));
        if (g != nullptr) copy_waited(*g, w.source_slot);
    }
}

/// Copies what slot `src_slot` now shares with `g`'s prompt into `g`'s slot (g has not
/// stepped yet: its slot holds exactly its reused tokens), trimmed to the shared prefix,
/// when that beats what g has by opts_.min_shared_prefix. A failed copy resets g's slot
/// (full prefill); a failed reset fails g.
inline void WorkerLoop::copy_waited(Generation& g, int32_t src_slot) {
    Slot& own = slots_.at(g.slot());
    const Slot& src = slots_.at(src_slot);
    if (src.dirty || own.dirty) return;
    if (!engine_.info().trims_any_state) {
        copy_waited_checkpoint(g);
        return;
    }
    const size_t keep = usable_prefix(src.resident, g.prompt(), grid(), exact_tokens(src_slot));
    if (keep < own.resident.size() + opts_.min_shared_prefix) return;
    if (keep < src.resident.size() && !engine_.can_truncate(src_slot, static_cast<int64_t>(keep))) return;
    const auto t0 = Clock::now();
    Status st = copy_slot_state(src_slot, own.index);
    if (st == Status::unsupported) return;
    if (st == Status::ok && engine_.position(own.index) == static_cast<int64_t>(src.resident.size()))
        st = keep < src.resident.size() ? engine_.truncate(own.index, static_cast<int64_t>(keep)) : Status::ok;
    else if (st == Status::ok)
        st = Status::engine_error;
    if (st != Status::ok) {
        std::fprintf(stderr, "trioserve-worker: copying an in-flight prefix failed (%s); prefilling instead\n",
                     status_name(st));
        if (engine_.reset(own.index) != Status::ok) {
            fail(g, "slot reset failed after a failed prefix copy");
            return;
        }
        own.resident.clear();
        g.restart_prefill(0, "new");
        return;
    }
    own.resident.assign(src.resident.begin(), src.resident.begin() + static_cast<std::ptrdiff_t>(keep));
    g.restart_prefill(keep, "copied");
    g.set_extra("copied_prompt_tokens", static_cast<int64_t>(keep));
    g.set_extra("copy_source", "slot");
    g.set_extra("copy_ms", std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    g.set_extra("copy_waited", true);
}

/// If another slot, a spilled session or a stored state (spec §6.4; also with sharing off)
/// holds at least opts_.min_shared_prefix (at least 1) more tokens
/// of `prompt` than engine slot `si` does (`own_keep`; 0 when the slot is dirty), replaces
/// the engine slot's state by a copy of that one (prefix_index.h) and returns the ids it
/// now holds; the caller then plans the prefill against those, so the copy is trimmed to
/// the shared prefix like any resident state and nothing past the divergence stays.
/// Changes no table (slot table, spill store): only the engine slot. The copy is complete
/// on return (Engine::copy_state contract), so the source may be evicted, trimmed or
/// reused by the very next request without affecting it. A spilled entry is copied, not
/// taken: its session still restores it. A failed copy leaves the engine slot reset
/// (`ok` false: full prefill, same output). Never throws except bad_alloc.
inline auto WorkerLoop::share_prefix(int32_t si, const std::vector<TokenId>& prompt, size_t own_keep) -> SharedCopy {
    SharedCopy out;
    PrefixSource src;
    if (opts_.min_shared_prefix > 0)
        src = find_prefix_source(
            slots_, spill_, prompt, si, own_keep, opts_.min_shared_prefix,
            [this](int32_t s, size_t keep) { return engine_.can_truncate(s, static_cast<int64_t>(keep)); },
            engine_.info().trims_any_state, grid(), [this](int32_t s) { return exact_tokens(s); });
    // The persistent store (spec §6.4) is looked at last and wins only with more tokens:
    // memory sources cost no file read. Its files count as spilled states for trimming.
    StoredState stored;
    size_t stored_keep = 0;
    if (store_.enabled()) {
        store_.refresh();
        const size_t floor = std::max(own_keep + std::max<size_t>(opts_.min_shared_prefix, 1), src.keep + 1);
        stored_keep = store_.best(prompt, floor, engine_.info().trims_any_state, stored);
    }
    const auto t0 = Clock::now();
    std::vector<uint8_t> body;
    // A file that cannot be used is logged and forgotten (state_store.h): the memory source,
    // if any, or the slot as it is then (the engine slot is unchanged so far).
    if (stored_keep > 0 && !store_.load(stored, body)) stored_keep = 0;
    if (src.kind == PrefixSource::Kind::none && stored_keep == 0) return share_checkpoint(si, prompt, own_keep);
    const std::vector<TokenId>* ids = nullptr;
    Status st = Status::engine_error;
    if (stored_keep > 0) {
        out.from_disk = true;
        ids = &stored.tokens;
        st = engine_.load_state(si, body);
    } else if (src.kind == PrefixSource::Kind::slot) {
        out.from_slot = true;
        ids = &slots_.at(src.slot).resident;
        st = copy_slot_state(src.slot, si);
        if (st == Status::unsupported) return out;  // engine slot unchanged: plan as before
    } else {
        const SpilledSession* e = spill_.find(src.session);
        ids = &e->resident;
        st = engine_.load_state(si, e->state);
    }
    out.attempted = true;
    out.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (st == Status::ok && engine_.position(si) == static_cast<int64_t>(ids->size())) {
        out.ok = true;
        out.resident = *ids;
        return out;
    }
    std::fprintf(stderr, "trioserve-worker: copying a shared prefix failed (%s); prefilling instead\n",
                 status_name(st));
    out.dirty = engine_.reset(si) != Status::ok;
    return out;
}

/// Another slot's checkpoint as a shared prefix, for states that cannot be cut back to one
/// (spec §6.3: recurrent and hybrid models, small window caches), where share_prefix found
/// no source: the newest checkpoint of any other clean slot whose ids are a prefix of
/// `prompt` and at least opts_.min_shared_prefix more than `own_keep`. The source slot's
/// state is copied into `si` and brought back to the checkpoint there (the recurrent part
/// restored, the attention cells past it dropped), so two sessions of one agent share the
/// prefill of their system prompt, as on an attention model. Same contract as share_prefix:
/// only the engine slot changes; a failed copy leaves it reset (or dirty).
inline auto WorkerLoop::share_checkpoint(int32_t si, const std::vector<TokenId>& prompt, size_t own_keep) -> SharedCopy {
    SharedCopy out;
    if (checkpoints_.per_slot() == 0 || opts_.min_shared_prefix == 0) return out;
    int32_t from = -1;
    const SlotCheckpoint* best = nullptr;
    for (size_t i = 0; i < slots_.capacity(); ++i) {
        const Slot& s = slots_.at(static_cast<int32_t>(i));
        if (s.index == si || s.dirty) continue;
        const SlotCheckpoint* c = checkpoints_.best(s.index, prompt, prompt.size());
        if (c == nullptr || c->tokens.size() < own_keep + opts_.min_shared_prefix) continue;
        if (c->tokens.size() > s.resident.size() ||
            !std::equal(c->tokens.begin(), c->tokens.end(), s.resident.begin()))
            continue;  // the slot moved past it since (its next admission drops it)
        if (best == nullptr || c->tokens.size() > best->tokens.size()) {
            best = c;
            from = s.index;
        }
    }
    if (best == nullptr) return out;
    const auto t0 = Clock::now();
    Status st = copy_slot_state(from, si);
    if (st == Status::unsupported) return out;  // engine slot unchanged
    out.attempted = true;
    const size_t at = best->tokens.size();
    if (st == Status::ok) st = engine_.restore_checkpoint(si, static_cast<int64_t>(at), best->state);
    out.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (st == Status::ok && engine_.position(si) == static_cast<int64_t>(at)) {
        out.ok = out.from_slot = out.from_checkpoint = true;
        out.resident = best->tokens;
        return out;
    }
    std::fprintf(stderr, "trioserve-worker: starting from another slot's checkpoint failed (%s); prefilling instead\n",
                 status_name(st));
    out.dirty = engine_.reset(si) != Status::ok;
    return out;
}

/// The prompt tokens engine slot `si` (holding `base`) can really provide under `plan`:
/// plan.keep, unless the state cannot be cut back that far (a sliding window slid past it),
/// then the newest usable checkpoint's position, else 0. The shared-prefix search compares
/// other states with this, not with a trim that would fail.
inline size_t WorkerLoop::reachable_keep(int32_t si, const std::vector<TokenId>& base, const std::vector<TokenId>& prompt,
                      const PrefillPlan& plan) const {
    if (plan.reset) return 0;
    if (plan.keep >= base.size() || engine_.can_truncate(si, static_cast<int64_t>(plan.keep))) return plan.keep;
    const SlotCheckpoint* c = checkpoints_.best(si, prompt, plan.keep);
    return c != nullptr ? c->tokens.size() : 0;
}

/// The positions inside a prompt of `n_prompt` tokens where its prefill stops to save a
/// checkpoint (spec §6.3), from the control plane's `marks`: none without checkpoints; with
/// the prefill grid (--deterministic) each mark goes down to the grid, and the prompt's last
/// whole grid piece ends at one too, since that is where a generation cuts its slot back to
/// (§4.5); ascending, without duplicates, strictly inside the prompt.
inline std::vector<size_t> WorkerLoop::checkpoint_marks(std::vector<size_t> marks, size_t n_prompt) const {
    if (checkpoints_.per_slot() == 0) return {};
    if (grid() > 0) {
        for (size_t& m : marks) m = m / grid() * grid();
        marks.push_back(n_prompt / grid() * grid());
    }
    std::sort(marks.begin(), marks.end());
    marks.erase(std::unique(marks.begin(), marks.end()), marks.end());
    marks.erase(std::remove_if(marks.begin(), marks.end(), [&](size_t m) { return m == 0 || m >= n_prompt; }),
                marks.end());
    return marks;
}

/// copy_waited() for a state that cannot be cut back: from the checkpoint the source took at
/// its mark (or any slot's better one), through share_checkpoint().
inline void WorkerLoop::copy_waited_checkpoint(Generation& g) {
    Slot& own = slots_.at(g.slot());
    const SharedCopy c = share_checkpoint(own.index, g.prompt(), own.resident.size());
    if (!c.attempted) return;
    if (c.ok) {
        own.resident = c.resident;
        g.restart_prefill(own.resident.size(), "copied");
        g.set_extra("copied_prompt_tokens", static_cast<int64_t>(own.resident.size()));
        g.set_extra("copy_source", "checkpoint");
        g.set_extra("copy_ms", c.ms);
        g.set_extra("copy_waited", true);
        return;
    }
    if (c.dirty) {
        fail(g, "slot reset failed after a failed checkpoint copy");
        return;
    }
    own.resident.clear();
    g.restart_prefill(0, "new");
}

/// Saves a checkpoint of `slot` at its current position (its prompt just finished
/// prefilling). A failure only means no checkpoint: it is a cache. With the prefill grid
/// only at a grid position (the whole prompt then came in whole pieces, spec §4.5).
inline void WorkerLoop::take_checkpoint(const Slot& slot) noexcept {
    if (checkpoints_.per_slot() == 0 || slot.resident.empty()) return;
    if (grid() > 0 && slot.resident.size() % grid() != 0) return;
    try {
        SlotCheckpoint c;
        if (engine_.save_checkpoint(slot.index, c.state) != Status::ok) return;
        c.tokens = slot.resident;
        checkpoints_.add(slot.index, std::move(c));
        store_prefix_state(slot);
    } catch (const std::exception&) {  // bad_alloc: go on without it
    }
}

/// With the persistent store on (spec §6.4) and a state that cannot be cut back (recurrent,
/// hybrid), a stored state is usable only where a prompt extends all of it, and the end of a
/// turn is past where the next turn diverges (a thinking template drops the reasoning). The
/// checkpoint positions are where prompts diverge, so the slot's whole state is offered to
/// the store there too, once per prefix, as an anonymous prefix state: after a restart the
/// system prompt and the previous turn's prompt are warm. The save runs on the loop thread
/// (one per new prefix, the size of that prefix's state); the write on the writer thread.
inline void WorkerLoop::store_prefix_state(const Slot& slot) {
    if (!store_.enabled() || engine_.info().trims_any_state) return;
    if (slot.resident.size() <= std::max<size_t>(opts_.min_shared_prefix, 1)) return;
    if (store_.has("", slot.resident) || !store_.room()) return;
    std::vector<uint8_t> body;
    if (engine_.save_state(slot.index, body) == Status::ok) store_.offer("", slot.resident, std::move(body));
}

/// Brings engine slot `si` back to the newest checkpoint at a position <= `keep` whose ids
/// are a prefix of `prompt` (the slot's resident ids share `keep` ids with it, so they hold
/// the checkpoint's ids too), among the slot's and, when the slot was just loaded from a
/// spilled session, `restored` (that session's). Returns that position, or 0 when there is
/// none or the restore failed (the engine slot may then be reset; the caller resets it).
/// `ms` gets the time the restore took when one was tried.
inline size_t WorkerLoop::restore_checkpoint(int32_t si, const std::vector<TokenId>& prompt, size_t keep, double& ms,
                                             const std::vector<SlotCheckpoint>* restored) {
    const SlotCheckpoint* c = checkpoints_.best(si, prompt, keep);
    if (restored != nullptr) {
        const SlotCheckpoint* r = CheckpointStore::best_in(*restored, prompt, keep);
        if (r != nullptr && (c == nullptr || r->tokens.size() > c->tokens.size())) c = r;
    }
    if (c == nullptr) return 0;
    const auto t0 = Clock::now();
    const int64_t at = static_cast<int64_t>(c->tokens.size());
    const Status st = engine_.restore_checkpoint(si, at, c->state);
    ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (st == Status::ok && engine_.position(si) == at) return c->tokens.size();
    // No table change here (plan phase): the caller resets the slot, and the commit then
    // drops every checkpoint its empty resident ids no longer start with.
    std::fprintf(stderr, "trioserve-worker: restoring a checkpoint failed (%s); prefilling instead\n",
                 status_name(st));
    return 0;
}

/// Engine::copy_state through the spare buffer (state_buffer.h), which keeps the scratch:
/// a buffer touched before costs a few ms where fresh memory costs a page fault a page.
inline Status WorkerLoop::copy_slot_state(int32_t src, int32_t dst) {
    std::vector<uint8_t> scratch = spare_.take();
    const Status st = engine_.copy_state(src, dst, scratch);
    spare_.note_size(scratch.size());
    spare_.give(std::move(scratch));
    return st;
}

}  // namespace trioserve
