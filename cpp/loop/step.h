// loop/step.h — one continuous-batching step of WorkerLoop and what follows it: the plan
// (scheduler.h), the engine call retried in halves so only a failing generation ends, the
// commit of each item's token (records, stop checks), pacing (--step-target, --max-step-ms),
// deferred samples collected at step boundaries, cancelled generations retired, and the
// terminal paths (end, fail) that free a slot and keep its reusable state.
// Implements spec/worker-protocol.md §4.1-§4.3 (token and done records, multiplexing and
// scheduling), §4.4 (progress records around a step), §4.5 (exact reuse under the prefill
// grid) and §7 (a cancel within one step).
#pragma once

#include "loop/worker_loop.h"

namespace trioserve {

/// Whether a step would advance anything: some generation in flight does not wait for a
/// deferred sample.
inline bool WorkerLoop::steppable() const {
    for (const auto& g : active_)
        if (!g->awaiting_sample()) return true;
    return false;
}

/// Generations whose deferred sample is out (they take no part in steps meanwhile).
inline size_t WorkerLoop::awaiting_samples() const {
    size_t n = 0;
    for (const auto& g : active_) n += g->awaiting_sample();
    return n;
}

/// Runs one scheduler step: retire cancelled generations, plan, run the engine step,
/// sample, emit. No-op when idle. Never throws.
///
/// CONTRACT (spec §4.3, §7): every generation still in flight after the cancelled ones
/// retire advances in this call, whatever happens to the others:
///   * a cancel that aborts the engine step (a prefill chunk of the cancelled generation is
///     in it, or its decode is the whole step) retires that generation and the step is
///     redone at once without it; so a client churning connections (admit, cancel
///     mid-prefill, again) costs the others a partial step, never a whole one. Each redo
///     follows the retirement of at least one generation: at most `capacity` redos;
///   * a failed engine step is retried in halves without committing anything of the
///     failed call (run_batch), so only the generation whose item makes the engine fail
///     ends with an error record.
///
/// A generation whose deferred sample is out takes no part (it has no token to append);
/// its result is applied first thing at the next boundary after it is ready.
inline void WorkerLoop::step() {
    collect_samples();
    // Cancel frames reach the generations' flags from the watcher thread at any time (it
    // blocks on the pipe), so the step boundary only has to look at the flags.
    retire_cancelled();
    while (!active_.empty()) {
        committed_ = false;
        if (run_planned_step() != Outcome::aborted) break;
        // Aborted by a cancel: redo now without it, unless part of this step was already
        // committed (an abort while retrying a failed step's halves; rare): then the next
        // step() picks the rest up, so nobody gets two tokens in one step.
        if (committed_ || !retire_cancelled()) break;
    }
    heartbeat_.end_step();
    compact();
    assert(busy() || idle_invariants_hold());
}

/// Steps until no generation is in flight (unit tests drive the loop this way); when every
/// generation waits for its deferred sample, waits for a result first.
inline void WorkerLoop::run_until_idle() {
    while (busy()) {
        if (!steppable() && !samples_.has_result()) samples_.wait_for_result();
        step();
        out_.flush_due();
    }
    out_.flush_held();
    calls_.wait_idle();
}

/// How long a worker leaving idle waits for more input before its first step (run()):
/// 5% of what that step is expected to take (its prompt tokens at the measured rate,
/// 1 ms a token before any measurement), at most kMaxGatherMs. So a lone request pays at
/// most 5% of its own prefill: milliseconds on a CPU, next to nothing on a GPU.
inline int WorkerLoop::gather_ms() const {
    size_t tokens = 0;
    for (const auto& g : active_) tokens += g->prefill_remaining();
    const double per_token = pacer_.ms_per_token() > 0 ? pacer_.ms_per_token() : 1.0;
    return static_cast<int>(std::min<double>(kMaxGatherMs, 0.05 * per_token * static_cast<double>(tokens)));
}

/// Plans one step over every generation in flight and runs it (run_batch).
inline auto WorkerLoop::run_planned_step() -> Outcome {
    resolve_waiters();
    compact();  // a waiter whose copy failed beyond repair ended
    const auto t_start = Clock::now();
    cands_.clear();
    size_t n_decode = 0;
    prefill_depth_ = 0;
    for (const auto& g : active_) {
        // A generation whose deferred sample is out has no token to append yet.
        const bool decoding = g->phase() == Generation::Phase::decode && !g->awaiting_sample();
        n_decode += decoding;
        // A generation waiting for another one's prefill (spec §6.2) gets nothing yet.
        const size_t at = g->prompt().size() - g->prefill_remaining();
        cands_.push_back(StepCandidate{decoding, waiting(g->id()) ? 0 : g->prefill_remaining(), at, 0,
                                       g->next_mark(at)});
        if (cands_.back().prefill_remaining > 0) prefill_depth_ = std::max(prefill_depth_, at);
    }
    n_decode += plan_drafts(n_decode);
    size_t budget = pacer_.budget(n_decode, prefill_depth_), chunk = opts_.prefill_chunk;
    if (pieces_.adaptive()) {  // a slowed-down machine: smaller pieces keep the step bounded
        budget = std::min(budget, n_decode + pieces_.limit());
        chunk = std::min(chunk, pieces_.limit());
    }
    plan_step(cands_, budget, chunk, planned_, grid(), opts_.efficient_prefill,
              pacer_.extension(n_decode, prefill_depth_, budget));
    batch_.clear();
    step_parts_.clear();
    for (size_t k = 0; k < planned_.size(); ++k) {
        batch_.push_back(k);
        Generation& g = *active_[planned_[k].index];
        if (planned_[k].prefill) g.mark_stepped(t_start);
        step_parts_.push_back(StepPart{g.id(), static_cast<uint32_t>(planned_[k].n), planned_[k].prefill});
    }
    heartbeat_.begin_step(++steps_begun_, step_parts_.data(), step_parts_.size());
    return run_batch(batch_.data(), batch_.size(), t_start, /*whole_step=*/true);
}

/// Runs the planned items `idx[0..n)` (indices into planned_) as one engine call and, when
/// it succeeds, commits them: their tokens become resident and every generation whose item
/// computed logits samples and emits. Returns aborted when a cancel aborted the call
/// (nothing of it was appended).
///
/// A call that fails otherwise commits nothing: the slots of its items are rolled back to
/// their pre-call positions (roll_back) and its items are retried in two halves, each on
/// its own; an item that fails alone fails its generation only (error record, slot dirty).
/// So a poisoned item costs about 2·log2(items) extra engine calls in its step, and
/// everyone else's tokens are exactly what they would have been.
inline auto WorkerLoop::run_batch(const size_t* idx, size_t n, Clock::time_point t_start, bool whole_step) -> Outcome {
    if (n == 0) return Outcome::done;
    const Status st = call_engine(idx, n);
    if (st == Status::aborted) return Outcome::aborted;
    const auto t_end = Clock::now();
    if (st == Status::ok) {
        if (whole_step) observe_pace(t_start, t_end);
        commit(idx, n, t_end);
        // After commit: a drafted step's cost includes its verification.
        if (whole_step) observe_step_cost(t_start, Clock::now());
        return Outcome::done;
    }
    std::vector<size_t> live;  // failure path only: allocating here is fine
    live.reserve(n);
    for (size_t k = 0; k < n; ++k) {
        Generation& g = *active_[planned_[idx[k]].index];
        if (roll_back(g)) live.push_back(idx[k]);
        else fail(g, std::string("engine step failed: ") + status_name(st) + " (its slot could not be rolled back)");
    }
    if (n == 1) {
        if (!live.empty()) fail(*active_[planned_[idx[0]].index], std::string("engine step failed: ") + status_name(st));
        return Outcome::done;
    }
    std::fprintf(stderr, "trioserve-worker: a step of %zu items failed (%s); retrying without the failing item\n",
                 n, status_name(st));
    const size_t half = live.size() / 2;
    if (run_batch(live.data(), half, t_start, false) == Outcome::aborted) return Outcome::aborted;
    return run_batch(live.data() + half, live.size() - half, t_start, false);
}

/// One engine step over the planned items `idx[0..n)`; the cancels of the abortable ones
/// abort it. Never throws.
inline Status WorkerLoop::call_engine(const size_t* idx, size_t n) {
    items_.clear();
    abortable_.clear();
    for (size_t k = 0; k < n; ++k) {
        const PlannedItem& p = planned_[idx[k]];
        Generation& g = *active_[p.index];
        if (p.prefill) {
            abortable_.push_back(g.id());
            items_.push_back(StepItem{g.slot(), g.prefill_cursor(), p.n, p.logits, true});
        } else if (p.draft > 0) {  // the pending token and its draft (speculation.h)
            items_.push_back(StepItem{g.slot(), g.spec()->buf.data(), p.n, true, false, true});
        } else {
            items_.push_back(StepItem{g.slot(), g.pending(), 1, true, false});
        }
    }
    // A call that is one generation's decode alone is abortable too: aborting it wastes
    // nobody else's work, and the cancel frees the model at once instead of after the
    // step. (With others in the call, a decode cancel waits for the step boundary: at
    // most one step, and their tokens are not thrown away.)
    if (n == 1 && !planned_[idx[0]].prefill) abortable_.push_back(active_[planned_[idx[0]].index]->id());

    // CONTRACT: a cancel of a generation whose prefill chunk is in this call (or whose
    // decode is the whole call) aborts the call; the engine then appends nothing, and
    // step() redoes it without the cancelled generation. clear_abort() comes first so a
    // cancel that arrives after it (even before begin_step) still aborts.
    engine_.clear_abort();
    if (!abortable_.empty()) cancel_.begin_step(abortable_);
    Status st = Status::engine_error;
    try {
        st = engine_.step(items_.data(), items_.size());
    } catch (const std::exception& e) {
        std::fprintf(stderr, "trioserve-worker: engine step threw: %s\n", e.what());
    }
    if (!abortable_.empty()) cancel_.end_step();
    return st;
}

/// Feeds the pacer and the piece sizer with a whole step that carried prefill.
inline void WorkerLoop::observe_pace(Clock::time_point t_start, Clock::time_point t_end) {
    size_t tokens = 0, prefill_tokens = 0;
    bool prefill = false;
    for (const PlannedItem& p : planned_) {
        tokens += p.n;
        prefill |= p.prefill;
        if (p.prefill) prefill_tokens += p.n;
    }
    if (!prefill) return;
    const double ms = std::chrono::duration<double, std::milli>(t_end - t_start).count();
    pacer_.observe(tokens, tokens - prefill_tokens, ms, prefill_depth_);
    const size_t before = pieces_.limit();
    pieces_.observe(prefill_tokens, tokens, ms);
    if (pieces_.limit() != before)
        std::fprintf(stderr, "trioserve-worker: prompt tokens per step %s to %zu (a step of %zu tokens took %.0f ms; "
                     "--max-step-ms %.0f)\n", pieces_.limit() < before ? "lowered" : "raised", pieces_.limit(),
                     tokens, ms, opts_.max_step_ms);
}

/// Feeds the speculation cost table with a whole decode-only step, keyed by the shape
/// plan_drafts() saw (step_cost.h: what drafting decides on is what was measured).
inline void WorkerLoop::observe_step_cost(Clock::time_point t_start, Clock::time_point t_end) {
    if (step_streams_ == 0) return;
    size_t tokens = 0;
    for (const PlannedItem& p : planned_) {
        if (p.prefill) return;
        tokens += p.n;
    }
    if (planned_.size() != step_streams_) return;  // not the shape that was planned
    step_cost_.observe(step_streams_, step_depth_, tokens,
                       std::chrono::duration<double, std::milli>(t_end - t_start).count());
}

/// The engine appended the items `idx[0..n)`: record their tokens as resident, then sample
/// where logits were computed (before any other engine call: logits last one call).
inline void WorkerLoop::commit(const size_t* idx, size_t n, Clock::time_point t_end) {
    committed_ = true;
    for (size_t k = 0; k < n; ++k) {
        const PlannedItem& p = planned_[idx[k]];
        Generation& g = *active_[p.index];
        Slot& slot = slots_.at(g.slot());
        if (p.prefill) {
            slot.resident.insert(slot.resident.end(), g.prefill_cursor(), g.prefill_cursor() + p.n);
            g.prefilled(p.n, t_end);
            // A turn boundary, or a place where later prompts leave this one (spec §6.3).
            if (g.prefill_remaining() == 0 || g.is_mark(slot.resident.size())) take_checkpoint(slot);
        } else if (p.draft > 0) {
            const std::vector<TokenId>& buf = g.spec()->buf;
            slot.resident.insert(slot.resident.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(p.n));
        } else {
            slot.resident.push_back(*g.pending());
        }
    }
    for (size_t k = 0; k < n; ++k) {
        const PlannedItem& p = planned_[idx[k]];
        if (!p.logits) continue;
        Generation& g = *active_[p.index];
        if (p.draft > 0) {
            verify_draft(g, p);
            continue;
        }
        TokenId tok = 0;
        Status ss = Status::engine_error;
        std::string why;
        try {  // a grammar can make llama.cpp's sampler throw (e.g. no token can match)
            bool deferred = false;
            ss = engine_.begin_sample(g.slot(), g.sampler(), &tok, &deferred);
            if (ss == Status::ok && deferred) {
                if (hand_over(g)) continue;  // its token comes at a later boundary (collect_samples)
                ss = engine_.finish_sample(g.sampler(), &tok);  // no sampler thread: here, as before
            }
        } catch (const std::exception& e) {
            why = e.what();
        }
        if (ss != Status::ok) {
            fail(g, std::string("sampling failed: ") + (why.empty() ? status_name(ss) : why));
            continue;
        }
        if (g.on_sample(tok, engine_, cancel_, out_, scratch_)) end(g);
    }
}

/// Gives `g`'s deferred sample, with its sampler, to the sampler thread. False (the sampler
/// back in `g`) when that cannot be done (no thread could be started): sample here then.
inline bool WorkerLoop::hand_over(Generation& g) noexcept {
    SampleWorker::Job job;
    job.id = g.id();
    job.sampler = g.lend_sampler();
    try {
        samples_.submit(job);
        return true;
    } catch (...) {
        g.return_sampler(std::move(job.sampler));
        return false;
    }
}

/// Step boundary: applies every finished deferred sample. Its generation gets its sampler
/// back and its token (record, stop strings, length: on_sample), then steps again; one
/// that was cancelled meanwhile just gets the sampler back (retire_cancelled() ends it;
/// the cancel came before the token); a failed sample fails it. A result whose generation
/// already ended (cancelled, shutdown) is dropped with its sampler, here on the loop
/// thread.
inline void WorkerLoop::collect_samples() {
    if (samples_.pending() == 0) return;
    samples_.take(results_);  // reserved to capacity: no allocation
    bool ended = false;
    for (SampleWorker::Result& r : results_) {
        Generation* g = find_active(r.id);
        if (g == nullptr || !g->awaiting_sample()) continue;
        g->return_sampler(std::move(r.sampler));
        g->note_deferred_sample(r.ms);
        if (g->cancel_requested()) continue;
        if (r.status != Status::ok) {
            fail(*g, std::string("sampling failed: ") + (r.error.empty() ? status_name(r.status) : r.error));
            ended = true;
            continue;
        }
        if (g->on_sample(r.token, engine_, cancel_, out_, scratch_)) {
            end(*g);
            ended = true;
        }
    }
    results_.clear();  // drops the samplers of generations that ended meanwhile
    if (ended) compact();
}

/// Puts `g`'s slot back at its resident tokens after a failed engine call (an engine may
/// leave a failed call's slots partly appended, engine.h). False when it cannot: the
/// generation's state is lost.
inline bool WorkerLoop::roll_back(Generation& g) {
    const int64_t want = static_cast<int64_t>(slots_.at(g.slot()).resident.size());
    const int64_t pos = engine_.position(g.slot());
    if (pos == want) return true;
    return pos > want && engine_.truncate(g.slot(), want) == Status::ok && engine_.position(g.slot()) == want;
}

/// Ends every generation whose cancel flag is set (step boundary). Returns whether any did.
inline bool WorkerLoop::retire_cancelled() {
    bool any = false;
    for (auto& g : active_) {
        if (g->phase() == Generation::Phase::done || !g->cancel_requested()) continue;
        g->cancel_now(cancel_);
        end(*g);
        any = true;
    }
    if (any) compact();
    return any;
}

/// Writes the done record and frees the slot (at once: a queued generation may take it
/// in the next step).
inline void WorkerLoop::end(Generation& g) {
    g.finish(out_, scratch_, Clock::now());
    Slot& slot = slots_.at(g.slot());
    // CONTRACT: `resident` is exactly the slot state (even after a stop-string cut, and after
    // a cancel: one retired at a step boundary took part in no step since, and a step its
    // cancel aborted was rolled back, spec §7). So the control plane may stop a generation
    // (its one tool call done, a stop string it matched) without losing the session's state.
    if (grid() > 0) keep_whole_pieces(slot, g.prompt().size());
    // KV-cache use for routers' load scoring (spec §4.2), after this slot's own update.
    g.set_extra("resident_tokens", slots_.resident_tokens());
    // Host memory of every slot's checkpoints now (spec §6.3), with checkpoints on.
    if (checkpoints_.per_slot() > 0) g.set_extra("checkpoint_bytes", checkpoints_.bytes());
    // The slot's new state goes to the persistent store at the next idle moment (spec §6.4).
    persist_pending_[static_cast<size_t>(g.slot())] = 1;
    if (store_.enabled()) g.set_extra("state_store", store_.stats());
    out_.write_json(g.done_record());
    remember_output(g);
    slots_.release(g.slot());
    cancel_.finish(g.id());
}

/// An engine failure ends `g` with an error record; its slot is dirty.
inline void WorkerLoop::fail(Generation& g, const std::string& what) {
    if (g.phase() == Generation::Phase::done) return;
    g.cancel_now(cancel_);  // seals it: later frames are ignored
    g.finish_silently();
    SlotTable::mark_dirty(slots_.at(g.slot()));
    out_.write_error(g.id(), {"engine_error", what, json::object()});
    slots_.release(g.slot());
    cancel_.finish(g.id());
}

/// With the prefill grid: how many leading tokens of slot `si` were computed in whole grid
/// pieces of a prefill (the only ones reused, spec §4.5). An idle clean slot holds only
/// such (keep_whole_pieces() cuts the rest when its generation ends; copies, restores and
/// checkpoints are of such states); a busy one those of its prompt's whole pieces so far.
/// SIZE_MAX without the grid.
inline size_t WorkerLoop::exact_tokens(int32_t si) const {
    if (grid() == 0) return SIZE_MAX;
    const Slot& slot = slots_.at(si);
    size_t n = slot.resident.size();
    if (slot.busy != 0)
        for (const auto& g : active_)
            if (g->id() == slot.busy) n = std::min(n, g->prompt().size());
    return n / grid() * grid();
}

/// A generation in `slot` ended cleanly with the prefill grid on: cut the slot back to the
/// prompt's whole grid pieces (its generated tokens were computed one at a time, its last
/// piece maybe short: a cold run of a longer prompt computes those positions in other
/// pieces). What the engine cannot cut (a sliding window slid past, a recurrent state) goes
/// back to its newest checkpoint at or before that position (spec §6.3: one at the prompt's
/// end when the prompt ended on the grid), else is reset.
inline void WorkerLoop::keep_whole_pieces(Slot& slot, size_t prompt_tokens) noexcept {
    const size_t keep = std::min(slot.resident.size(), prompt_tokens) / grid() * grid();
    if (keep == slot.resident.size()) return;
    const SlotCheckpoint* c = keep > 0 ? checkpoints_.best(slot.index, slot.resident, keep) : nullptr;
    if (keep > 0 && engine_.truncate(slot.index, static_cast<int64_t>(keep)) == Status::ok) {
        slot.resident.resize(keep);
    } else if (c != nullptr &&
               engine_.restore_checkpoint(slot.index, static_cast<int64_t>(c->tokens.size()), c->state) == Status::ok &&
               engine_.position(slot.index) == static_cast<int64_t>(c->tokens.size())) {
        slot.resident.resize(c->tokens.size());
    } else if (engine_.reset(slot.index) == Status::ok) {
        slot.resident.clear();
    } else {
        SlotTable::mark_dirty(slot);
    }
    checkpoints_.keep_prefixes_of(slot.index, slot.resident);
}

inline void WorkerLoop::compact() {
    active_.erase(std::remove_if(active_.begin(), active_.end(),
                                 [](const std::unique_ptr<Generation>& g) {
                                     return g->phase() == Generation::Phase::done;
                                 }),
                  active_.end());
}

}  // namespace trioserve
