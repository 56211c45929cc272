// worker_loop.h — the protocol-2 worker loop shared by every trioserve worker: request
// dispatch, admission (slot choice, warm reuse, context clamp, sampler/grammar), and the
// continuous-batching scheduler that advances every in-flight generation one engine step at a
// time.
//
// Division of labour:
//   records.h          line framing, request validation, record writing (token hot path)
//   slot_table.h       slots ↔ engine sequences, named sessions, anonymous slot choice
//   generation.h       one generation's state machine (queued → prefill → decode → done)
//   scheduler.h        what one step contains (decodes first, then FIFO prefill chunks)
//   cancel_controller.h per-id cancel: latch, seal, stale, abort of the running step
//   this file          the event loop tying them together
//
// Event loop (run()): between steps the loop reads whatever stdin has (poll with timeout 0
// while generations are in flight; blocking poll when idle, so an idle worker uses no CPU),
// handles every complete line at once (ping, tokenize, session ops are answered between
// steps; generates are admitted and join at the next step), retires cancelled generations
// (the watcher thread reads the cancel pipe all the time), then runs one step. stdin EOF =
// exit now.
//
// Threading model: one loop thread does everything here. The cancel watcher thread
// (worker_process.h) touches only the CancelController, which sets a generation's atomic
// cancel flag and, for a generation whose prefill chunk is in the running step, calls
// Engine::request_abort(). An aborted step appends nothing (engine contract), so the loop
// simply retires the cancelled generation and redoes the step without it: the others are
// unaffected.
//
// stdout rule: records go to a RecordSink, one complete line per write. Logs go to stderr.
// Nothing here throws past handle_line()/step(): every failure becomes an error record for the
// request concerned and the loop keeps serving.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <poll.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "cancel_controller.h"
#include "engine.h"
#include "generation.h"
#include "json_out.h"
#include "prefill_plan.h"
#include "records.h"
#include "scheduler.h"
#include "slot_table.h"
#include "spill_store.h"

namespace trioserve {

struct WorkerOptions {
    size_t batch_tokens = 512;    ///< per-step token budget (decodes + prefill chunks)
    size_t prefill_chunk = 512;   ///< largest prefill chunk of one generation in one step
    bool supports_cancel = false; ///< a valid cancel fd was inherited (spec §7)
    uint64_t spill_budget_bytes = uint64_t(1) << 30;  ///< host bytes for evicted sessions (spec §6.1)
    double step_target_ms = 0;    ///< pace steps that carry decodes to about this long; 0 = off (StepPacer)
    json ready_extra = json::object();  ///< engine-specific ready-record fields (llama: kernel_path)
};

/// Test/fault-injection hooks (used by the fake worker only).
struct WorkerHooks {
    /// Called when a generate request line is handled (before validation), e.g. --garbage-line.
    std::function<void(uint64_t id, RecordSink&)> on_generate_start;
};

class WorkerLoop {
public:
    WorkerLoop(Engine& engine, CancelController& cancel, RecordSink& out, WorkerOptions opts = {},
               WorkerHooks hooks = {})
        : engine_(engine), cancel_(cancel), out_(out), opts_(opts), hooks_(std::move(hooks)),
          slots_(static_cast<size_t>(std::max<int64_t>(1, engine.info().capacity))),
          spill_(opts.spill_budget_bytes), rng_(std::random_device{}()),
          pacer_(opts.step_target_ms, kMinPacedPrefill, std::max<size_t>(opts.batch_tokens, 1)) {
        if (opts_.batch_tokens == 0) opts_.batch_tokens = 1;
        if (opts_.prefill_chunk == 0) opts_.prefill_chunk = 1;
        cancel_.set_abort_hook([&engine] { engine.request_abort(); });
    }

    ~WorkerLoop() { cancel_.set_abort_hook(nullptr); }

    /// The ready record (spec §3).
    json ready_record() const {
        const EngineInfo& in = engine_.info();
        auto opt_str = [](const std::optional<std::string>& s) { return s ? json(*s) : json(nullptr); };
        auto opt_id = [](const std::optional<TokenId>& s) { return s ? json(*s) : json(nullptr); };
        return json{{"type", "ready"},
                    {"protocol", kProtocolVersion},
                    {"engine", in.engine},
                    {"model", {{"name", in.model_name}, {"architecture", in.architecture}, {"path", in.model_path}}},
                    {"n_ctx", in.n_ctx},
                    {"capacity", static_cast<int64_t>(slots_.capacity())},
                    {"n_vocab", in.n_vocab},
                    {"max_line_bytes", kMaxLineBytes},
                    {"max_batch_tokens", opts_.batch_tokens},
                    {"capabilities",
                     {{"supports_cancel", opts_.supports_cancel},
                      {"supports_truncate", in.supports_truncate},
                      {"multiplexed", true},
                      {"special_segments", true},
                      {"grammar", in.supports_grammar},
                      {"eviction", true}}},
                    {"spill_budget_bytes", opts_.spill_budget_bytes},
                    {"special_tokens",
                     {{"bos", opt_str(in.bos_text)}, {"eos", opt_str(in.eos_text)},
                      {"bos_id", opt_id(in.bos_id)}, {"eos_id", opt_id(in.eos_id)}}},
                    {"chat_template", opt_str(in.chat_template)}};
    }

    void write_ready() {
        json r = ready_record();
        for (const auto& [key, value] : opts_.ready_extra.items()) r[key] = value;
        out_.write_json(r);
    }

    /// Runs the event loop on `in_fd` (stdin) until EOF or shutdown. Returns the exit status (0).
    int run(int in_fd) {
        LineSplitter splitter;
        std::vector<char> buf(256 * 1024);
        auto on_line = [this](LineSplitter::Kind k, std::string_view line) {
            if (k == LineSplitter::Kind::too_long) {
                out_.write_error(std::nullopt, {"line_too_long",
                                                "input line exceeds " + std::to_string(kMaxLineBytes) + " bytes",
                                                json::object()});
                return true;
            }
            return handle_line(line) == Flow::next;
        };
        for (;;) {
            // Input first: block only when nothing is in flight (no busy waiting when idle);
            // while busy, take what is there (bounded, so steps keep their pace) and step.
            // Leaving idle, wait once, briefly, for more lines (gather_ms()): the requests of
            // a burst reach the parent milliseconds apart, and a generate read now is a
            // prompt prefilled in this step, not a whole step later.
            size_t taken = 0;
            bool gathered = busy();
            for (;;) {
                int timeout_ms = 0;
                if (!busy() && taken == 0) timeout_ms = -1;
                else if (!gathered) { timeout_ms = gather_ms(); gathered = true; }
                pollfd p{in_fd, POLLIN, 0};
                const int r = ::poll(&p, 1, timeout_ms);
                if (r < 0) {
                    if (errno == EINTR) continue;
                    return 0;  // stdin unusable: nobody can talk to us
                }
                if (r == 0) break;
                const ssize_t n = ::read(in_fd, buf.data(), buf.size());
                if (n < 0) {
                    if (errno == EINTR || errno == EAGAIN) continue;
                    return 0;
                }
                if (n == 0) return 0;  // CONTRACT: stdin EOF = exit now (spec §1)
                if (!splitter.feed(buf.data(), static_cast<size_t>(n), on_line)) return 0;  // shutdown
                taken += static_cast<size_t>(n);
                if (busy() && taken >= kMaxInputPerTurn) break;
            }
            if (busy()) step();
        }
    }

    enum class Flow { next, stop };

    /// Handles one input line (without '\n'). Never throws.
    Flow handle_line(std::string_view line) {
        if (line.find_first_not_of(" \t\r") == std::string_view::npos) return Flow::next;  // blank
        const auto t_read = Clock::now();
        json req = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
        if (req.is_discarded()) {
            out_.write_error(std::nullopt, {"invalid_json", "input line is not valid JSON", json::object()});
            return Flow::next;
        }
        if (!req.is_object()) {
            out_.write_error(std::nullopt, detail::invalid("request must be a JSON object"));
            return Flow::next;
        }
        std::optional<uint64_t> id;
        if (auto it = req.find("id"); it != req.end() && it->is_number_unsigned() && it->get<uint64_t>() >= 1)
            id = it->get<uint64_t>();
        auto op_it = req.find("op");
        const bool is_generate = op_it != req.end() && op_it->is_string() && *op_it == "generate";
        if (id && !is_generate) cancel_.saw(*id);  // a generate registers its id itself
        if (op_it == req.end() || !op_it->is_string()) {
            out_.write_error(id, detail::invalid("missing or non-string 'op'"));
            return Flow::next;
        }
        const std::string& op = op_it->get_ref<const std::string&>();
        if (!id) {
            out_.write_error(std::nullopt, detail::invalid("'id' must be an integer in [1, 2^64)"));
            return Flow::next;
        }
        try {
            if (is_generate) {
                if (hooks_.on_generate_start) hooks_.on_generate_start(*id, out_.sink());
                handle_generate(req, *id, t_read);
            } else if (op == "tokenize") {
                handle_tokenize(req, *id);
            } else if (op == "ping") {
                out_.write_json(json{{"type", "pong"}, {"id", *id}});
            } else if (op == "session_open" || op == "session_close" || op == "session_reset") {
                handle_session_op(req, *id, op);
            } else if (op == "shutdown") {
                out_.write_json(json{{"type", "ack"}, {"id", *id}, {"op", "shutdown"}});
                return Flow::stop;
            } else {
                out_.write_error(id, detail::invalid("unknown op '" + op + "'"));
            }
        } catch (const RequestError& e) {
            out_.write_error(id, e);
        } catch (const std::exception& e) {
            out_.write_error(id, {"engine_error", std::string("internal error: ") + e.what(), json::object()});
        }
        return Flow::next;
    }

    /// Whether any generation is in flight.
    bool busy() const { return !active_.empty(); }
    size_t in_flight() const { return active_.size(); }
    const SlotTable& slots() const { return slots_; }
    const SpillStore& spill() const { return spill_; }

    /// Runs one scheduler step: retire cancelled generations, plan, one engine step, sample,
    /// emit. No-op when idle. Never throws.
    void step() {
        // Cancel frames reach the generations' flags from the watcher thread at any time (it
        // blocks on the pipe), so the step boundary only has to look at the flags.
        retire_cancelled();
        if (active_.empty()) return;

        const auto t_start = Clock::now();
        cands_.clear();
        size_t n_decode = 0;
        for (const auto& g : active_) {
            const bool decoding = g->phase() == Generation::Phase::decode;
            n_decode += decoding;
            cands_.push_back(StepCandidate{decoding, g->prefill_remaining()});
        }
        plan_step(cands_, pacer_.budget(n_decode), opts_.prefill_chunk, planned_);
        items_.clear();
        abortable_.clear();
        for (const PlannedItem& p : planned_) {
            Generation& g = *active_[p.index];
            if (p.prefill) {
                g.mark_stepped(t_start);
                abortable_.push_back(g.id());
                items_.push_back(StepItem{g.slot(), g.prefill_cursor(), p.n, p.logits, true});
            } else {
                items_.push_back(StepItem{g.slot(), g.pending(), 1, true, false});
            }
        }
        const bool has_prefill = !abortable_.empty();
        // A step that is one generation's decode alone is abortable too: aborting it wastes
        // nobody else's work, and the cancel frees the model at once instead of after the
        // step. (With others in the step, a decode cancel waits for the step boundary: at
        // most one step, and their tokens are not thrown away.)
        if (planned_.size() == 1 && !planned_[0].prefill) abortable_.push_back(active_[planned_[0].index]->id());

        // CONTRACT: a cancel of a generation whose prefill chunk is in this step (or whose
        // decode is the whole step) aborts the whole step; the engine then appends nothing,
        // and the next step() redoes it without the cancelled generation. clear_abort() comes
        // first so a cancel that arrives after it (even before begin_step) still aborts.
        engine_.clear_abort();
        if (!abortable_.empty()) cancel_.begin_step(abortable_);
        Status st = Status::engine_error;
        try {
            st = engine_.step(items_.data(), items_.size());
        } catch (const std::exception& e) {
            std::fprintf(stderr, "trioserve-worker: engine step threw: %s\n", e.what());
        }
        if (!abortable_.empty()) cancel_.end_step();
        if (st == Status::aborted) return;
        const auto t_end = Clock::now();
        if (has_prefill && st == Status::ok) {  // the step carried prefill: feed the pacer
            size_t tokens = 0;
            for (const PlannedItem& p : planned_) tokens += p.n;
            pacer_.observe(tokens, std::chrono::duration<double, std::milli>(t_end - t_start).count());
        }
        if (st != Status::ok) {
            for (const PlannedItem& p : planned_)
                fail(*active_[p.index], std::string("engine step failed: ") + status_name(st));
            compact();
            return;
        }

        // Every item's tokens are now resident; then sample where logits were computed.
        for (const PlannedItem& p : planned_) {
            Generation& g = *active_[p.index];
            Slot& slot = slots_.at(g.slot());
            if (p.prefill) {
                slot.resident.insert(slot.resident.end(), g.prefill_cursor(), g.prefill_cursor() + p.n);
                g.prefilled(p.n, t_end);
            } else {
                slot.resident.push_back(*g.pending());
            }
        }
        for (const PlannedItem& p : planned_) {
            if (!p.logits) continue;
            Generation& g = *active_[p.index];
            TokenId tok = 0;
            Status ss = Status::engine_error;
            std::string why;
            try {  // a grammar can make llama.cpp's sampler throw (e.g. no token can match)
                ss = engine_.sample(g.slot(), g.sampler(), &tok);
            } catch (const std::exception& e) {
                why = e.what();
            }
            if (ss != Status::ok) {
                fail(g, std::string("sampling failed: ") + (why.empty() ? status_name(ss) : why));
                continue;
            }
            if (g.on_sample(tok, engine_, cancel_, out_, scratch_)) end(g);
        }
        compact();
    }

    /// Steps until no generation is in flight (unit tests drive the loop this way).
    void run_until_idle() {
        while (busy()) step();
    }

private:
    /// Most stdin bytes taken between two steps while generations run.
    static constexpr size_t kMaxInputPerTurn = size_t(4) << 20;
    /// How long a worker leaving idle waits for more input before its first step (run()):
    /// 5% of what that step is expected to take (its prompt tokens at the measured rate,
    /// 1 ms a token before any measurement), at most kMaxGatherMs. So a lone request pays at
    /// most 5% of its own prefill: milliseconds on a CPU, next to nothing on a GPU.
    int gather_ms() const {
        size_t tokens = 0;
        for (const auto& g : active_) tokens += g->prefill_remaining();
        const double per_token = pacer_.ms_per_token() > 0 ? pacer_.ms_per_token() : 1.0;
        return static_cast<int>(std::min<double>(kMaxGatherMs, 0.05 * per_token * static_cast<double>(tokens)));
    }
    static constexpr int kMaxGatherMs = 5;
    /// Fewest prompt tokens a paced step carries: below this a chunk's fixed cost dominates
    /// and admission would crawl.
    static constexpr size_t kMinPacedPrefill = 16;

    // -- admission -------------------------------------------------------------------------

    /// Validates, tokenizes, picks and prepares a slot, makes the sampler, and queues the
    /// generation (spec §4: checks in this order: id staleness, fields, capacity and session
    /// admission, tokenization, context clamp, slot, grammar).
    void handle_generate(const json& req, uint64_t id, Clock::time_point t_read) {
        cancel_.sync();  // CONTRACT: a cancel written before its generate line is latched (spec §7)
        // CONTRACT: ids strictly increase (spec §2). Checked before anything else so a stale
        // id can never disturb the cancel state of a newer request.
        const uint64_t highest = cancel_.highest_read();
        if (id <= highest)
            throw detail::invalid("stale or duplicate id " + std::to_string(id) + " (highest id read: " +
                                  std::to_string(highest) + ")");
        try {
            admit(req, id, t_read);
        } catch (...) {
            cancel_.saw(id);  // a generate that failed is finished: frames for it are stale
            throw;
        }
    }

    void admit(const json& req, uint64_t id, Clock::time_point t_read) {
        GenerateRequest r = parse_generate(req, id);
        const EngineInfo& info = engine_.info();
        const int64_t cap = static_cast<int64_t>(slots_.capacity());
        if (!r.grammar.empty() && !info.supports_grammar)
            throw RequestError{"unsupported_grammar", "this worker cannot constrain sampling with a grammar",
                               json::object()};
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

        std::vector<TokenId> prompt;
        encode_segments(engine_, r.segments, prompt);
        if (prompt.empty()) throw RequestError{"empty_prompt", "the prompt tokenizes to nothing", json::object()};
        const int64_t n_prompt = static_cast<int64_t>(prompt.size());
        const int64_t max_new = clamp_max_new(n_prompt, info.n_ctx, r.max_new_tokens);
        if (max_new < 0)
            throw RequestError{"context_length_exceeded",
                               "prompt has " + std::to_string(n_prompt) + " tokens; the context window is " +
                                   std::to_string(info.n_ctx) + " (no room to generate)",
                               json{{"prompt_tokens", n_prompt}, {"n_ctx", info.n_ctx}}};

        // Slot choice; an eviction victim is only chosen here and evicted once nothing can
        // reject the request any more (a rejected request changes no slot and no session).
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

        // From here on nothing is rejected: the slot is taken and prepared.
        Slot& slot = slots_.at(si);
        if (evict) evict_session(slot);
        size_t restored = 0;
        double restore_ms = 0;
        if (named == nullptr && !r.session_id.empty()) {
            slots_.bind(si, r.session_id);
            restored = restore_session(slot, r.session_id, restore_ms);
        }
        if (!r.session_id.empty()) slot.long_retention = r.long_retention;
        slots_.acquire(si, id);
        const PrefillPlan plan = plan_prefill(slot.resident, prompt, slot.dirty, info.supports_truncate);
        const char* reason = plan.reason;
        if (restored > 0 && !plan.reset) reason = "restored";
        if (plan.reset) {
            reset_slot(slot);
        } else if (plan.keep < slot.resident.size()) {
            const Status st = engine_.truncate(si, static_cast<int64_t>(plan.keep));
            if (st == Status::unsupported) {  // fall back to a full prefill
                reset_slot(slot);
                reason = "mismatch";
            } else if (st != Status::ok) {
                SlotTable::mark_dirty(slot);
                slots_.release(si);
                throw RequestError{"engine_error", std::string("slot truncate failed: ") + status_name(st), json::object()};
            } else {
                slot.resident.resize(plan.keep);
            }
        }
        slot.dirty = false;  // resident == the engine slot's tokens from here on
        const size_t reused = slot.resident.size();

        auto g = std::make_unique<Generation>(id, t_read);
        g->configure(r.session_id, si, std::move(prompt), max_new, std::move(r.stop), std::move(sampler), reused,
                     reason);
        if (restored > 0) {
            g->set_extra("restored_prompt_tokens", static_cast<int64_t>(plan.reset ? 0 : reused));
            g->set_extra("restore_ms", restore_ms);
        }
        // A latched cancel just sets the flag: the next step boundary ends it, before any
        // prefill, like any cancelled generation.
        cancel_.admit(id, &g->cancel_flag());
        active_.push_back(std::move(g));
    }

    /// Unbinds the (idle) session bound to `slot`, keeping a copy of its state in the spill
    /// store when the engine can save it and the budget allows (spec §6.1). The slot keeps its
    /// tokens (the caller takes it next). Never throws: a failed save just drops the session.
    void evict_session(Slot& slot) {
        const std::string sid = slot.session;
        const bool long_retention = slot.long_retention;
        slots_.unbind(slot);
        if (slot.dirty || slot.resident.empty() || spill_.budget() == 0) return;
        SpilledSession e;
        if (engine_.save_state(slot.index, e.state) != Status::ok) return;
        e.resident = slot.resident;
        e.long_retention = long_retention;
        spill_.put(sid, std::move(e));
    }

    /// Loads `sid`'s spilled state (if any) into `slot`, just bound to it. Returns the tokens
    /// restored (0: nothing spilled, or the load failed and the slot is reset).
    size_t restore_session(Slot& slot, const std::string& sid, double& ms) {
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
        return slot.resident.size();
    }

    void reset_slot(Slot& slot) {
        const Status st = engine_.reset(slot.index);
        if (st != Status::ok) {
            SlotTable::mark_dirty(slot);
            slots_.release(slot.index);
            throw RequestError{"engine_error", std::string("slot reset failed: ") + status_name(st), json::object()};
        }
        slot.resident.clear();
    }

    json capacity_extra(const std::string& sid) const {
        json extra{{"capacity", static_cast<int64_t>(slots_.capacity())}};
        if (!sid.empty()) extra["session_id"] = sid;
        return extra;
    }

    /// The slot bound to named session `sid`, or nullptr when a new one can be bound. Throws
    /// unsupported_session (capacity 1) or capacity_exhausted (nothing to bind).
    Slot* named_slot_for(const std::string& sid) {
        const int64_t cap = static_cast<int64_t>(slots_.capacity());
        json extra{{"session_id", sid}, {"capacity", cap}};
        if (cap <= 1) throw RequestError{"unsupported_session", "this worker hosts no named sessions (capacity 1)", extra};
        if (Slot* s = slots_.find_session(sid)) return s;
        if (slots_.pick_for_binding() < 0 && slots_.pick_eviction() < 0)
            throw RequestError{"capacity_exhausted", "no idle slot to bind the session to (every bound session is busy)",
                               extra};
        return nullptr;
    }

    // -- other ops -------------------------------------------------------------------------

    static std::string session_id_field(const json& req) {
        auto it = req.find("session_id");
        if (it == req.end() || !it->is_string() || it->get_ref<const std::string&>().empty())
            throw detail::invalid("'session_id' must be a non-empty string");
        return it->get<std::string>();
    }

    void handle_session_op(const json& req, uint64_t id, const std::string& op) {
        const std::string sid = session_id_field(req);
        Slot* s = nullptr;
        bool found = true;
        if (op == "session_open") {
            s = named_slot_for(sid);
            if (!s) {
                int32_t si = slots_.pick_for_binding();
                if (si < 0) {
                    si = slots_.pick_eviction();
                    evict_session(slots_.at(si));
                }
                slots_.bind(si, sid);
                double ms = 0;
                restore_session(slots_.at(si), sid, ms);
            }
        } else if ((s = slots_.find_session(sid)) == nullptr) {  // close/reset: drop a spilled copy too
            found = spill_.erase(sid);
        } else {
            if (s->busy != 0)
                throw RequestError{"session_busy",
                                   "session '" + sid + "' is running generation " + std::to_string(s->busy),
                                   json{{"session_id", sid}}};
            spill_.erase(sid);
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

    void handle_tokenize(const json& req, uint64_t id) {
        const std::vector<PromptSegment> segments = parse_prompt(req, "text");
        std::vector<TokenId> ids;
        encode_segments(engine_, segments, ids);
        out_.write_json(json{{"type", "tokens"}, {"id", id}, {"ids", ids}});
    }

    // -- terminal paths --------------------------------------------------------------------

    /// Ends every generation whose cancel flag is set (step boundary).
    void retire_cancelled() {
        bool any = false;
        for (auto& g : active_) {
            if (g->phase() == Generation::Phase::done || !g->cancel_requested()) continue;
            g->cancel_now(cancel_);
            end(*g);
            any = true;
        }
        if (any) compact();
    }

    /// Writes the done record and frees the slot (at once: a queued generation may take it
    /// in the next step).
    void end(Generation& g) {
        g.finish(out_, scratch_, Clock::now());
        Slot& slot = slots_.at(g.slot());
        // CONTRACT: a cancelled generation leaves its slot dirty; otherwise `resident` is
        // exactly the slot state (even after a stop-string cut).
        if (!g.leaves_slot_clean()) SlotTable::mark_dirty(slot);
        out_.write_json(g.done_record());
        slots_.release(g.slot());
        cancel_.finish(g.id());
    }

    /// An engine failure ends `g` with an error record; its slot is dirty.
    void fail(Generation& g, const std::string& what) {
        if (g.phase() == Generation::Phase::done) return;
        g.cancel_now(cancel_);  // seals it: later frames are ignored
        g.finish_silently();
        SlotTable::mark_dirty(slots_.at(g.slot()));
        out_.write_error(g.id(), {"engine_error", what, json::object()});
        slots_.release(g.slot());
        cancel_.finish(g.id());
    }

    void compact() {
        active_.erase(std::remove_if(active_.begin(), active_.end(),
                                     [](const std::unique_ptr<Generation>& g) {
                                         return g->phase() == Generation::Phase::done;
                                     }),
                      active_.end());
    }

    Engine& engine_;
    CancelController& cancel_;
    RecordWriter out_;
    WorkerOptions opts_;
    WorkerHooks hooks_;
    SlotTable slots_;
    SpillStore spill_;
    std::mt19937_64 rng_;
    StepPacer pacer_;  ///< sizes the budget of steps that carry decodes (opts_.step_target_ms)
    std::vector<std::unique_ptr<Generation>> active_;  ///< in flight, admission (FIFO) order
    // Reused per step: the loop allocates nothing per step once these have grown.
    std::vector<StepCandidate> cands_;
    std::vector<PlannedItem> planned_;
    std::vector<StepItem> items_;
    std::vector<uint64_t> abortable_;
    TokenScratch scratch_;
};

}  // namespace trioserve
