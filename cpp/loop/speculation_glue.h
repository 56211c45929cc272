// loop/speculation_glue.h — self-speculative decoding inside WorkerLoop's step: choose draft
// lengths per generation from the measured step costs (step_cost.h, speculation.h,
// draft_index.h), verify the drafted tokens after the step, remember outputs for the global
// draft index, calibrate the first cost estimate at startup and report it in the ready record.
// Implements spec/worker-protocol.md §4.6.
#pragma once

#include "loop/worker_loop.h"

namespace trioserve {

/// Whether generations are drafted: asked for, and nothing stands against it
/// (speculation_off_reason()).
inline bool WorkerLoop::speculating() const {
    return opts_.speculative != SpeculativeMode::off && speculation_off_reason().empty();
}

/// Why a worker asked for `--speculative auto` does not draft ("" when nothing stands against
/// it): the ready record's `off_reason` (spec §3), so the setting is never silently void. A
/// small sliding-window cache drops cells older than the window as soon as a step passes them,
/// so a draft's rejected tail could not be removed (llama.cpp refuses the cut); the full-size
/// cache is fine.
inline std::string WorkerLoop::speculation_off_reason() const {
    const EngineInfo& in = engine_.info();
    if (!in.supports_speculation || !in.supports_truncate) return "this engine cannot verify drafts";
    // Drafts are verified as extra tokens in a slot's item, off the prefill grid (spec §4.5).
    if (grid() > 0) return "--deterministic: a verify step's pieces are not on the prefill grid";
    if (in.n_swa != 0 && in.swa_cache != "full")
        return "a small sliding-window cache cannot take back a rejected draft (use the full-size window cache)";
    return spec_inexact_;
}

/// `count` token ids spread over the vocabulary (a fixed stride): start-up measurements need
/// a context and steps of real tokens, not any particular text.
inline std::vector<TokenId> spread_ids(size_t count, int64_t n_vocab) {
    const size_t n = static_cast<size_t>(std::max<int64_t>(n_vocab, 1));
    std::vector<TokenId> ids(count);
    for (size_t i = 0; i < count; ++i) ids[i] = static_cast<TokenId>((i * 7919 + 13) % n);
    return ids;
}

/// The exactness self-check (Engine::check_verify_exact), once at start-up: a verify step
/// over draft_max + 1 positions against plain decoding of the same tokens, at a context of 300
/// tokens. WHY 300: llama.cpp pads a sequence's KV view to 256 cells, so past 256 used cells
/// the view is 512, the size from which its CPU flash attention splits a lone query's KV range
/// across threads (a verify step's several queries are not split): at two or more threads the
/// two then round differently and a near tie's argmax can flip. Any other kernel that computes
/// one query unlike several shows here too. When the logits differ, drafting stays off for this
/// worker's life, and the ready record says why: an exact server must not let timing-driven
/// draft choices change a greedy output.
inline void WorkerLoop::check_speculation_exact() {
    const EngineInfo& info = engine_.info();
    const size_t n = std::min<size_t>(opts_.draft_max + 1, static_cast<size_t>(std::max<int64_t>(1, info.max_step_tokens)));
    const int64_t room = info.n_ctx - static_cast<int64_t>(n) - 1;
    if (room <= 0) return;
    const size_t depth = static_cast<size_t>(std::min<int64_t>(300, room));
    const std::vector<TokenId> ids = spread_ids(depth + n, info.n_vocab);
    bool same = true;
    std::string detail;
    const Status st = engine_.check_verify_exact(0, ids, depth, n, &same, detail);
    if (st != Status::ok && st != Status::unsupported)
        spec_inexact_ = std::string("the start-up exactness check could not run (") + status_name(st) + ")";
    else if (!same)
        spec_inexact_ = "a verify step's logits are not bit-identical to plain decoding here (" + detail +
                        "), so drafts could change outputs; whether llama.cpp's CPU kernels keep it exact depends "
                        "on the model, the thread count and the KV cache type (spec §4.6 lists the cases measured)";
}

/// Step planning: picks this step's draft of every decoding generation that speculates
/// (cands_ is built, in active_ order) and sets cands_[i].draft and its SpecState::buf
/// (pending token, then the draft). Returns the draft tokens added to the step. The
/// lengths come from choose_draft_lengths() over the measured cost of this step's shape
/// (step_cost.h): all zero when drafting would not pay or its cost there is unknown, except
/// for a probe (one confident candidate verified anyway, to measure the shape or acceptance).
inline size_t WorkerLoop::plan_drafts(size_t n_decode) {
    step_streams_ = 0;
    if (!speculating() || n_decode == 0) return 0;
    spec_idx_.clear();
    spec_alpha_.clear();
    spec_avail_.clear();
    const int64_t n_ctx = engine_.info().n_ctx;
    int64_t depth = 0;  // the deepest decoding stream: what every item of the step attends over
    for (size_t i = 0; i < active_.size(); ++i) {
        Generation& g = *active_[i];
        if (!cands_[i].decoding) continue;
        const int64_t pos = engine_.position(g.slot());
        depth = std::max(depth, pos);
        SpecState* sp = g.spec();
        if (sp == nullptr) continue;
        const std::vector<TokenId>& out = g.output();  // its last id is the pending token
        for (; sp->indexed_output < out.size(); ++sp->indexed_output) sp->index.append(out[sp->indexed_output]);
        const int64_t room = std::min<int64_t>(g.remaining() - 1, n_ctx - pos - 1);
        if (room <= 0) continue;
        const size_t max = std::min<size_t>(opts_.draft_max, static_cast<size_t>(room));
        sp->candidate = sp->index.draft(max);
        if (sp->candidate.match < kDraftNgrams[0] && global_drafts_.capacity_tokens() > 0) {
            size_t got = 0;
            const TokenId* tail = sp->index.tail(kDraftNgrams[0], got);
            Draft d = global_drafts_.draft(tail, got, max);
            if (d.match > sp->candidate.match) sp->candidate = std::move(d);
        }
        if (sp->candidate.tokens.empty()) continue;
        spec_idx_.push_back(i);
        spec_alpha_.push_back(sp->alpha(sp->candidate.match));
        spec_avail_.push_back(sp->candidate.tokens.size());
    }
    step_streams_ = n_decode;  // observe_step_cost() keys the step's time by this shape
    step_depth_ = depth;
    if (spec_idx_.empty()) return 0;
    // Room in the step: the engine's batch holds budget + capacity tokens (scheduler.h),
    // and a draft must not crowd out the step's prefill floor.
    const size_t room = opts_.batch_tokens > n_decode + kMinPacedPrefill ? opts_.batch_tokens - n_decode - kMinPacedPrefill : 0;
    size_t total = 0;
    for (size_t& a : spec_avail_) {
        a = std::min(a, room > total ? room - total : 0);
        total += a;
    }
    const StepCurve curve = step_cost_.curve(n_decode, depth);
    choose_draft_lengths(spec_alpha_, spec_avail_, n_decode, curve, kMinDraftGain, spec_k_);
    const bool chosen = std::any_of(spec_k_.begin(), spec_k_.end(), [](size_t k) { return k > 0; });
    // A shape probe is due when nothing was chosen, or when a size was never measured here
    // (StepCostTable::probe_size); then the probe drafts alone in this step, so that the
    // step's time is filed under the probe's size.
    const size_t probe_size = step_cost_.probe_size(n_decode, depth, /*unmeasured_only=*/chosen);
    const size_t probe = probe_size > 0 ? shape_probe(probe_size) : spec_idx_.size();
    if (probe < spec_idx_.size()) std::fill(spec_k_.begin(), spec_k_.end(), size_t{0});
    // Whether a fully accepted acceptance probe could pay at this shape (speculation.h).
    const double full = static_cast<double>(n_decode + SpecState::kProbeLen);
    const bool could_pay = full / curve.rel(SpecState::kProbeLen) > static_cast<double>(n_decode) * (1 + kMinDraftGain);
    size_t added = 0;
    for (size_t j = 0; j < spec_idx_.size(); ++j) {
        Generation& g = *active_[spec_idx_[j]];
        SpecState& sp = *g.spec();
        size_t k = spec_k_[j];
        if (j == probe) {
            k = std::min(spec_avail_[j], probe_size);
            sp.declined = 0;
        } else if (k == 0) {
            k = sp.probe_length(sp.candidate.match, spec_avail_[j], could_pay ? n_decode : 0);
            if (k == 0) {
                sp.idle();
                continue;
            }
        } else {
            sp.declined = 0;
        }
        spec_k_[j] = k;
        sp.buf.assign(1, *g.pending());
        sp.buf.insert(sp.buf.end(), sp.candidate.tokens.begin(), sp.candidate.tokens.begin() + static_cast<std::ptrdiff_t>(k));
        cands_[spec_idx_[j]].draft = k;
        added += k;
    }
    if (opts_.log_drafts && added > 0) log_drafts(n_decode, depth, probe < spec_idx_.size());
    return added;
}

/// `--log-drafts`: this step's shape and chosen lengths (k chosen / available, acceptance).
inline void WorkerLoop::log_drafts(size_t n_decode, int64_t depth, bool probe) const {
    std::fprintf(stderr, "trioserve-worker: drafts (streams %zu, depth %lld%s):", n_decode,
                 static_cast<long long>(depth), probe ? ", shape probe" : "");
    for (size_t j = 0; j < spec_idx_.size(); ++j)
        std::fprintf(stderr, " id %llu k=%zu/%zu a=%.2f", static_cast<unsigned long long>(active_[spec_idx_[j]]->id()),
                     spec_k_[j], spec_avail_[j], spec_alpha_[j]);
    std::fprintf(stderr, "\n");
}

/// The candidate (index into spec_idx_) that measures a shape whose drafted cost is unknown
/// or stale (StepCostTable::probe_size): the confident one (a suffix match of
/// SpecState::kProbeMatch+ ids, `size` draft tokens at least) most likely accepted;
/// spec_idx_.size() when there is none.
inline size_t WorkerLoop::shape_probe(size_t size) const {
    size_t best = spec_idx_.size();
    for (size_t j = 0; j < spec_idx_.size(); ++j) {
        const SpecState& sp = *active_[spec_idx_[j]]->spec();
        if (sp.candidate.match < SpecState::kProbeMatch || spec_avail_[j] < size) continue;
        if (best == spec_idx_.size() || spec_alpha_[j] > spec_alpha_[best]) best = j;
    }
    return best;
}

/// Verification of `g`'s draft after the step that carried it (commit(); the slot's
/// resident ids already hold the pending token and the k draft tokens). Samples position
/// by position through the generation's ordinary per-token path and stops at the first
/// token that ends the generation, differs from the draft, or follows a cancel; then cuts
/// the slot back so it holds exactly the tokens before the new pending one, as plain
/// decoding would (the rejected cells are removed: Engine::truncate).
inline void WorkerLoop::verify_draft(Generation& g, const PlannedItem& p) {
    SpecState& sp = *g.spec();
    Slot& slot = slots_.at(g.slot());
    const size_t k = p.draft;
    const size_t base = slot.resident.size() - (k + 1);  // position of the pending token
    size_t last = 0, accepted = 0;
    bool ended = false;
    for (size_t j = 0; j <= k; ++j) {
        last = j;
        const TokenId draft = j < k ? sp.buf[1 + j] : TokenId(-1);
        TokenId tok = 0;
        Status st = Status::engine_error;
        std::string why;
        try {  // accepted iff it equals the draft token: the exact rule (speculation.h)
            st = engine_.sample_draft(g.slot(), j, g.sampler(), &tok);
        } catch (const std::exception& e) {
            why = e.what();
        }
        if (st != Status::ok) {
            fail(g, std::string("sampling failed: ") + (why.empty() ? status_name(st) : why));
            return;
        }
        if (g.on_sample(tok, engine_, cancel_, out_, scratch_)) {
            ended = true;
            break;
        }
        if (j == k || tok != draft) break;
        ++accepted;
        if (g.cancel_requested()) break;  // the next boundary retires it: emit no more
    }
    sp.observe(k, accepted, sp.candidate.match);
    const size_t keep = base + 1 + last;
    if (keep < slot.resident.size()) {
        const Status st = engine_.truncate(g.slot(), static_cast<int64_t>(keep));
        if (st != Status::ok || engine_.position(g.slot()) != static_cast<int64_t>(keep)) {
            if (!ended) {
                fail(g, std::string("removing rejected draft tokens failed: ") + status_name(st));
                return;
            }
            SlotTable::mark_dirty(slot);  // ended anyway: its slot state is just unknown
        }
        slot.resident.resize(keep);
    }
    if (ended) end(g);
}

/// A finished generation's output goes into the global draft index (not a cancelled one:
/// its text was cut short by the client, not the model).
inline void WorkerLoop::remember_output(Generation& g) noexcept {
    if (global_drafts_.capacity_tokens() == 0 || g.spec() == nullptr || g.cancelled()) return;
    const std::vector<TokenId>& out = g.output();
    global_drafts_.add_output(nullptr, 0, out.data(), out.size());
}

/// Measures the start-up step cost (ms of a decode step of n tokens in one slot at a short
/// context: the first estimate of that one shape, step_cost.h) on this machine and model,
/// unless opts_.step_cost fixed the model; slot 0 is reset afterwards. With speculation off
/// only when opts_.measure_step_cost asks (a benchmark's table; it costs start-up time). Call
/// once before write_ready() (the worker mains do), while no generation is in flight.
inline void WorkerLoop::calibrate_speculation() {
    if (speculating()) check_speculation_exact();
    if (!speculating() && !opts_.measure_step_cost) return;
    if (!opts_.step_cost.empty()) {
        start_cost_.set(opts_.step_cost);
        step_cost_.fix(opts_.step_cost);
        return;
    }
    // Up to the widest decode step drafting may make at full capacity (bounded by 64 and
    // the engine's batch): beyond the last point the model extrapolates in proportion.
    const size_t widest = slots_.capacity() * (opts_.draft_max + 1);
    const size_t max_n = std::min<size_t>(std::min<size_t>(widest, 64),
                                          static_cast<size_t>(std::max<int64_t>(1, engine_.info().max_step_tokens)));
    const std::vector<TokenId> ids = spread_ids(64 + max_n, engine_.info().n_vocab);
    // A context of 64 tokens first, so a decode step attends to something, as in service;
    // each measured step is then cut back off (truncate), four times per size, best of
    // the last three (the first warms that shape up).
    constexpr size_t kContext = 64;
    if (engine_.reset(0) != Status::ok) return;
    StepItem ctx{0, ids.data(), kContext, false, true};
    if (engine_.step(&ctx, 1) != Status::ok) {
        engine_.reset(0);
        return;
    }
    std::vector<std::pair<size_t, double>> pts;
    for (size_t n = 1; n <= max_n; n = n < 4 ? n + 1 : n * 2) {
        double best = 0;
        for (int rep = 0; rep < 4; ++rep) {
            StepItem it{0, ids.data() + kContext, n, true, false, n > 1};
            const auto t0 = Clock::now();
            if (engine_.step(&it, 1) != Status::ok) break;
            const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
            if (engine_.truncate(0, static_cast<int64_t>(kContext)) != Status::ok) break;
            if (rep > 0 && (best == 0 || ms < best)) best = ms;
        }
        if (best > 0) pts.emplace_back(n, best);
    }
    engine_.reset(0);
    start_cost_.set(std::move(pts));
    step_cost_.seed(start_cost_);
}

/// The ready record's `speculative` object (spec §3).
inline json WorkerLoop::speculation_ready() const {
    json cost = json::array();
    for (const auto& [n, ms] : start_cost_.points()) cost.push_back(json::array({n, ms}));
    json r{{"mode", speculating() ? "auto" : "off"},
           {"draft_max", speculating() ? opts_.draft_max : 0},
           {"sources", speculating() ? json::array({"request", "global"}) : json::array()},
           {"global_index_tokens", global_drafts_.capacity_tokens()},
           {"global_index_bytes", global_drafts_.bytes()},
           {"step_cost_ms", cost}};
    if (opts_.speculative != SpeculativeMode::off && !speculating()) r["off_reason"] = speculation_off_reason();
    return r;
}

}  // namespace trioserve
