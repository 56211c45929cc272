// loop/admission.h — WorkerLoop's two-phase admission of a generate (see the class's
// admission comment): plan_admission() validates, tokenizes, chooses and prepares a slot (warm
// reuse, eviction victim, spilled session, shared prefix, sampler/grammar) and may fail
// without changing any table; commit_admission() applies it and cannot fail.
// Implements spec/worker-protocol.md §4 (generate validation, context clamp), §4.3 (queueing)
// and §6 (slot choice, named sessions, warm reuse).
#pragma once

#include "loop/worker_loop.h"

namespace trioserve {

/// Validates, tokenizes, picks and prepares a slot, makes the sampler, and queues the
/// generation (spec §4: checks in this order: id staleness, fields, tokenization, context
/// clamp, grammar — precheck() ran those already for lines from the InputReader — then
/// capacity and session admission, slot).
inline void WorkerLoop::handle_generate(const json& req, uint64_t id, Clock::time_point t_read,
                     std::vector<TokenId>* pretokenized, std::vector<size_t>* premarks) {
    cancel_.sync();  // CONTRACT: a cancel written before its generate line is latched (spec §7)
    // CONTRACT: ids strictly increase (spec §2). Checked before anything else so a stale
    // id can never disturb the cancel state of a newer request.
    const uint64_t highest = cancel_.highest_read();
    if (id <= highest)
        throw detail::invalid("stale or duplicate id " + std::to_string(id) + " (highest id read: " +
                              std::to_string(highest) + ")");
    Admission a;
    try {
        a = plan_admission(req, id, t_read, pretokenized, premarks);
    } catch (...) {
        cancel_.saw(id);  // a generate that failed is finished: frames for it are stale
        throw;
    }
    commit_admission(a);
}

/// `pretokenized`, `premarks`: the prompt's tokens and checkpoint marks from precheck()
/// (moved from), or null.
// long: one pass in the spec's order (§4 checks, session admission, slot choice, drafting,
// engine preparation); every stage may throw and none may change a table before commit, and
// split into helpers that order and that no-change rule would live in the reader's head.
inline auto WorkerLoop::plan_admission(const json& req, uint64_t id, Clock::time_point t_read,
                         std::vector<TokenId>* pretokenized, std::vector<size_t>* premarks) -> Admission {
    GenerateRequest r = parse_generate(req, id);
    const EngineInfo& info = engine_.info();
    const int64_t cap = static_cast<int64_t>(slots_.capacity());
    refuse_unsupported_sampling(r, info);
    if (static_cast<int64_t>(active_.size()) >= cap)
        throw RequestError{"capacity_exhausted",
                           "all " + std::to_string(cap) + " slots are running generations",
                           capacity_extra(r.session_id)};

    // Named session admission (before the expensive tokenization).
    Slot* named = nullptr;
    if (!r.session_id.empty()) {
        named = named_slot_for(r.session_id);
        if (named && named->busy != 0)
            throw RequestError{"session_busy",
                               "session '" + r.session_id + "' is running generation " + std::to_string(named->busy),
                               json{{"session_id", r.session_id}}};
    }

    refuse_if_cannot_fit(r, info);
    std::vector<TokenId> prompt;
    std::vector<size_t> marks;
    if (pretokenized != nullptr) {
        prompt = std::move(*pretokenized);
        if (premarks != nullptr) marks = std::move(*premarks);
    } else {
        encode_segments(engine_, r.segments, prompt, &marks);
    }
    if (prompt.empty()) throw RequestError{"empty_prompt", "the prompt tokenizes to nothing", json::object()};
    const int64_t max_new = check_context(static_cast<int64_t>(prompt.size()), r.max_new_tokens);

    // Slot choice; an eviction victim is only chosen here and evicted at commit.
    int32_t si = -1;
    bool evict = false;
    if (named) si = named->index;
    else if (!r.session_id.empty()) si = slots_.pick_for_binding();
    else si = slots_.pick_anonymous(prompt);
    if (si < 0 && named == nullptr) {
        si = slots_.pick_eviction();
        evict = si >= 0;
    }
    if (si < 0)
        throw RequestError{"capacity_exhausted",
                           r.session_id.empty() ? "no idle slot for an anonymous generation"
                                                : "no idle slot to bind the session to (every bound session is busy)",
                           capacity_extra(r.session_id)};

    if (!r.has_seed) r.sampling.seed = static_cast<uint32_t>(rng_() % 0xFFFFFFFFull);
    std::string grammar_error;
    std::unique_ptr<Sampler> sampler = engine_.new_sampler(r.sampling, r.grammar, grammar_error);
    if (!sampler) {
        if (!r.grammar.empty())
            throw RequestError{"invalid_grammar", "the grammar does not parse: " + grammar_error, json::object()};
        throw RequestError{"engine_error", "sampler setup failed: " + grammar_error, json::object()};
    }
    if (r.unique_keys) {
        // Every token's text, made once per worker on first use (one token_bytes per id).
        if (!token_texts_) token_texts_ = TokenTexts::of(engine_);
        sampler->set_veto(std::make_unique<JsonKeyVeto>(*r.unique_keys, token_texts_));
    }
    // Grammar-constrained and unique-keys generations are never drafted: their next token
    // depends on a mask the verification would have to replay per position (§4.6).
    std::unique_ptr<SpecState> spec;
    if (speculating() && r.grammar.empty() && !r.unique_keys) {
        spec = std::make_unique<SpecState>();
        spec->index.append(prompt.data(), prompt.size());
    }

    Admission a;
    a.slot = si;
    a.evict = evict;
    a.named = !r.session_id.empty();
    a.long_retention = r.long_retention;
    if (named == nullptr && a.named) a.bind_session = r.session_id;
    a.gen = std::make_unique<Generation>(id, t_read);
    a.registration = CancelController::prepare(id, a.gen->cancel_flag());

    // Engine preparation of the slot. Once an engine call may have changed the slot, a
    // failure leaves its state unknown: it is marked dirty (the only table change a
    // failed admission makes).
    Slot& slot = slots_.at(si);
    bool touched = false;
    try {
        if (evict) a.victim = save_victim(slot);  // reads the slot only
        const std::vector<TokenId>* base = &slot.resident;
        bool base_dirty = slot.dirty;
        size_t restored = 0;
        double restore_ms = 0, checkpoint_ms = -1;
        if (const SpilledSession* e = a.bind_session.empty() ? nullptr : spill_.find(a.bind_session)) {
            // The session comes back: load its spilled copy instead of prefilling it.
            a.take_spilled = true;
            touched = true;
            const auto t0 = Clock::now();
            const Status st = engine_.load_state(si, e->state);
            restore_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
            if (st == Status::ok && engine_.position(si) == static_cast<int64_t>(e->resident.size())) {
                base = &e->resident;
                base_dirty = false;
                restored = e->resident.size();
                a.restored_checkpoints = e->checkpoints;
            } else {  // prefill instead: the slot is reset below
                std::fprintf(stderr, "trioserve-worker: restoring session state failed (%s); prefilling instead\n",
                             status_name(st));
                base_dirty = true;
            }
        }
        // An engine whose states cannot be trimmed but have checkpoints (recurrent: spec §6.3)
        // plans a trim too: truncate() then reports unsupported and a checkpoint is tried.
        const bool trims = info.supports_truncate || info.supports_checkpoints;
        PrefillPlan plan = plan_prefill(*base, prompt, base_dirty, trims, grid());
        // Shared prefix (spec §6.2): another slot or a spilled session may hold more of
        // this prompt than the slot itself; then the slot starts from a copy of that state.
        SharedCopy copy = share_prefix(si, prompt, reachable_keep(si, *base, prompt, plan));
        if (copy.attempted) {
            touched = true;
            base = &copy.resident;  // empty when the copy failed (the engine slot was reset)
            base_dirty = copy.dirty;
            plan = plan_prefill(*base, prompt, base_dirty, trims, grid());
        }
        const char* reason = plan.reason;
        if (copy.ok && !plan.reset) reason = "copied";
        else if (restored > 0 && !plan.reset) reason = "restored";
        if (plan.reset) {
            touched = true;
            reset_engine_slot(si);
        } else {
            a.resident.assign(base->begin(), base->begin() + static_cast<std::ptrdiff_t>(plan.keep));
            if (plan.keep < base->size()) {
                touched = true;
                const Status st = engine_.truncate(si, static_cast<int64_t>(plan.keep));
                if (st == Status::unsupported) {
                    // The state cannot be cut back that far (a sliding window slid past
                    // it, a recurrent state): start from a checkpoint at or before the
                    // divergence, if the slot has one (spec §6.3), else prefill from zero.
                    const size_t at = restore_checkpoint(si, prompt, plan.keep, checkpoint_ms,
                                                         restored > 0 && !copy.attempted ? &a.restored_checkpoints
                                                                                         : nullptr);
                    if (at > 0) {
                        a.resident.resize(at);
                        reason = "checkpoint";
                    } else {
                        reset_engine_slot(si);
                        a.resident.clear();
                        reason = "mismatch";
                    }
                } else if (st != Status::ok) {
                    throw RequestError{"engine_error", std::string("slot truncate failed: ") + status_name(st),
                                       json::object()};
                }
            }
        }
        const size_t reused = a.resident.size();
        // A prompt whose shared prefix another generation is prefilling right now waits
        // for it and then copies it, instead of prefilling the same tokens beside it.
        a.wait = pending_prefix(prompt, si, reused);
        a.gen->configure(r.session_id, si, std::move(prompt), max_new, std::move(r.stop), std::move(sampler),
                         reused, reason);
        if (spec) a.gen->enable_speculation(std::move(spec));
        a.gen->set_checkpoint_marks(checkpoint_marks(std::move(marks), a.gen->prompt().size()));
        if (copy.ok && !plan.reset) {
            a.gen->set_extra("copied_prompt_tokens", static_cast<int64_t>(reused));
            a.gen->set_extra("copy_source", copy.from_checkpoint ? "checkpoint"
                                            : copy.from_slot ? "slot" : copy.from_disk ? "disk" : "spill");
            a.gen->set_extra("copy_ms", copy.ms);
        } else if (restored > 0) {
            a.gen->set_extra("restored_prompt_tokens", static_cast<int64_t>(plan.reset ? 0 : reused));
            a.gen->set_extra("restore_ms", restore_ms);
        }
        if (checkpoint_ms >= 0) a.gen->set_extra("checkpoint_ms", checkpoint_ms);
        // A router's spill counter (spec §4.2): this admission evicts a session and keeps
        // its state. Set here, not at commit: commit_admission must not allocate.
        if (evict && !a.victim.empty()) a.gen->set_extra("spilled_session", true);
    } catch (...) {
        if (touched) SlotTable::mark_dirty(slot);
        throw;
    }
    return a;
}

/// Applies a planned admission. Moves, swaps and container operations that allocate
/// nothing (the nodes were allocated by the plan; active_ has room for `capacity`).
inline void WorkerLoop::commit_admission(Admission& a) noexcept {
    Slot& slot = slots_.at(a.slot);
    persist_pending_[static_cast<size_t>(a.slot)] = 0;  // its next end sets it again
    if (a.evict) {
        slots_.unbind(slot);
        if (!a.victim.empty()) spill_.put(std::move(a.victim));
    }
    if (!a.bind_session.empty()) {
        if (a.take_spilled) spill_.erase(a.bind_session);
        // The session's checkpoints come back with its state; those past where this
        // prompt leaves it are dropped below with the slot's others.
        if (a.take_spilled && !a.restored_checkpoints.empty()) checkpoints_.swap_in(a.slot, a.restored_checkpoints);
        slots_.bind(a.slot, std::move(a.bind_session));
    }
    if (a.named) slot.long_retention = a.long_retention;
    slots_.acquire(a.slot, a.gen->id());
    slot.resident.swap(a.resident);
    slot.dirty = false;  // resident == the engine slot's tokens from here on
    checkpoints_.keep_prefixes_of(a.slot, slot.resident);  // the slot diverged before the others
    // A latched cancel just sets the flag: the next step boundary ends it, before any
    // prefill, like any cancelled generation.
    cancel_.admit(std::move(a.registration));
    assert(active_.size() < active_.capacity());
    if (a.wait.source_id != 0) {
        a.wait.id = a.gen->id();
        assert(waiters_.size() < waiters_.capacity());
        waiters_.push_back(a.wait);
    }
    active_.push_back(std::move(a.gen));
}

/// context_length_exceeded before tokenizing, when even the fewest tokens the prompt can
/// be (its bytes over the longest token's) leave no room: a prompt of megabytes is
/// refused in the time it takes to add up its length.
inline void WorkerLoop::refuse_if_cannot_fit(const GenerateRequest& r, const EngineInfo& info) {
    if (info.max_token_bytes <= 0) return;
    int64_t ids = 0, bytes = 0;
    for (const PromptSegment& seg : r.segments) {
        if (seg.is_ids) ids += static_cast<int64_t>(seg.ids.size());
        else bytes += static_cast<int64_t>(seg.text.size());
    }
    const int64_t at_least = ids + bytes / info.max_token_bytes;
    if (clamp_max_new(at_least, info.n_ctx, r.max_new_tokens) < 0)
        throw RequestError{"context_length_exceeded",
                           "prompt has at least " + std::to_string(at_least) + " tokens; the context window is " +
                               std::to_string(info.n_ctx) + " (no room to generate)",
                           json{{"prompt_tokens", at_least}, {"n_ctx", info.n_ctx}, {"lower_bound", true}}};
}

}  // namespace trioserve
