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
// Threading model: one loop thread does everything here, except the costly part of deferred
// samples (below). The cancel watcher thread
// (worker_process.h) touches only the CancelController, which sets a generation's atomic
// cancel flag and, for a generation whose prefill chunk is in the running step, calls
// Engine::request_abort(). An aborted step appends nothing (engine contract), so the loop
// retires the cancelled generation and redoes the step at once without it: the others still
// get this step's token.
//
// Grammar work off the shared step: sampling is Engine::begin_sample() on this
// thread (llama: the chain's pick and a one-token grammar check, microseconds) and, only when
// that cannot decide (the grammar refused the pick: the whole vocabulary must be masked,
// ~0.1-0.3 s for a 256-value enum on a 2-core CPU), Engine::finish_sample() on the sampler
// thread (sample_worker.h). Meanwhile that generation has no token to append, so it is left
// out of the step plan, like a generation waiting for a shared prefix, and the others keep
// stepping; its result is applied at the next step boundary (collect_samples(): token record,
// stop checks) and it rejoins the batch. Its sampler travels with the job, so a cancel or a
// shutdown retires the generation at once (the cancel within one step, as always) and the
// sampler dies with the job's result. When nothing else can step, the loop blocks on its
// input reader, which the result (or a cancel of a waiting generation) wakes: no spinning,
// and input is still read.
//
// Failure isolation: a generate that fails admission changes no table (two-phase admission);
// a step the engine fails is retried in halves so only the generation that makes it fail ends
// (run_batch). Lifetimes: the cancel controller shares each generation's flag; the loop
// unregisters a generation when it ends and every one still in flight when it shuts down or
// is destroyed.
//
// stdout rule: records go to a RecordSink, one complete line per write. Logs go to stderr.
// Nothing here throws past handle_line()/step(): every failure becomes an error record for the
// request concerned and the loop keeps serving.
#pragma once

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <poll.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "call_worker.h"
#include "cancel_controller.h"
#include "checkpoint_store.h"
#include "engine.h"
#include "generation.h"
#include "heartbeat.h"
#include "input_reader.h"
#include "json_out.h"
#include "prefill_plan.h"
#include "prefix_index.h"
#include "records.h"
#include "sample_worker.h"
#include "scheduler.h"
#include "slot_table.h"
#include "speculation.h"
#include "spill_store.h"
#include "state_buffer.h"
#include "utf8_assembler.h"

namespace trioserve {

struct WorkerOptions {
    size_t batch_tokens = 512;    ///< per-step token budget (decodes + prefill chunks)
    size_t prefill_chunk = 512;   ///< largest prefill chunk of one generation in one step
    bool supports_cancel = false; ///< a valid cancel fd was inherited (spec §7)
    uint64_t spill_budget_bytes = uint64_t(1) << 30;  ///< host bytes for evicted sessions (spec §6.1)
    double step_target_ms = 0;    ///< pace steps that carry decodes to about this long; 0 = off (StepPacer)
    json ready_extra = json::object();  ///< engine-specific ready-record fields (llama: kernel_path)
    /// Start a prompt from another slot's or a spilled session's state when it holds at least
    /// this many more prompt tokens than the generation's own slot (spec §6.2); 0 = off.
    size_t min_shared_prefix = 16;
    /// Checkpoints kept per slot for engines with a small sliding-window cache (spec §6.3,
    /// `--swa-checkpoints`); 0 = none. Ignored by engines without checkpoints.
    size_t checkpoints_per_slot = 4;
    /// Progress records (spec §4.4, heartbeat.h): while one step has been running this long,
    /// one every `heartbeat_ms`; 0 = none (a parent asks for them with --heartbeat-ms).
    double heartbeat_ms = 0;
    /// Keep a step that carries prefill within about this long by shrinking the prompt tokens
    /// per step on the grid batch_tokens >> k (PieceSizer, `--max-step-ms`); 0 = fixed pieces.
    double max_step_ms = 0;
    /// `--deterministic` (spec §4.5): prompts are prefilled in pieces on this grid of absolute
    /// positions and only prefixes computed in whole grid pieces are reused; 0 = off. The
    /// engine must compute each slot's items on their own (the llama engine does in that mode).
    size_t prefill_grid = 0;
    /// Self-speculative decoding (speculation.h, spec/worker-protocol.md §4.6): auto = drafts
    /// from the request's own tokens and the global index, verified in the shared step when the
    /// cost model says it pays; off = never.
    SpeculativeMode speculative = SpeculativeMode::off;
    size_t draft_max = 12;               ///< most draft tokens of one generation in one step
    size_t global_draft_tokens = 262144; ///< ids the global draft index keeps (0 = no global index)
    /// Step cost by token count; empty: measured by calibrate_speculation().
    std::vector<std::pair<size_t, double>> step_cost{};
    bool log_drafts = false;             ///< the chosen draft lengths to stderr (debug)
};

/// Test/fault-injection hooks (used by the fake worker only).
struct WorkerHooks {
    /// Called when a generate request line is handled (before validation), e.g. --garbage-line.
    std::function<void(uint64_t id, RecordSink&)> on_generate_start;
};

/// Serializes the records of two threads (the loop and the input reader's refusals) onto one
/// sink: each record stays one uninterrupted write (a pipe write over PIPE_BUF bytes is not
/// atomic between writers).
class LockedSink : public RecordSink {
public:
    explicit LockedSink(RecordSink& out) : out_(out) {}
    void write(std::string_view line) override {
        std::lock_guard<std::mutex> lock(mu_);
        out_.write(line);
    }

private:
    RecordSink& out_;
    std::mutex mu_;
};

class WorkerLoop {
public:
    WorkerLoop(Engine& engine, CancelController& cancel, RecordSink& out, WorkerOptions opts = {},
               WorkerHooks hooks = {})
        : engine_(engine), cancel_(cancel), locked_out_(out), out_(locked_out_), refusals_out_(locked_out_),
          opts_(opts), hooks_(std::move(hooks)),
          slots_(static_cast<size_t>(std::max<int64_t>(1, engine.info().capacity))),
          spill_(opts.spill_budget_bytes),
          checkpoints_(slots_.capacity(), engine.info().supports_checkpoints ? opts.checkpoints_per_slot : 0),
          rng_(std::random_device{}()),
          pacer_(opts.step_target_ms, kMinPacedPrefill, std::max<size_t>(opts.batch_tokens, 1)),
          samples_(engine, slots_.capacity(), [this] { wake_loop(); }),
          global_drafts_(opts.speculative == SpeculativeMode::off ? 0 : opts.global_draft_tokens),
          pieces_(opts.max_step_ms, std::max<size_t>(opts.batch_tokens, 1), kMinAdaptedPiece),
          heartbeat_(locked_out_, opts.heartbeat_ms, [&engine] { return engine.work_done(); }, slots_.capacity()) {
        if (opts_.batch_tokens == 0) opts_.batch_tokens = 1;
        if (opts_.prefill_chunk == 0) opts_.prefill_chunk = 1;
        active_.reserve(slots_.capacity());  // commit_admission's push_back never allocates
        step_parts_.reserve(slots_.capacity());
        waiters_.reserve(slots_.capacity());
        results_.reserve(slots_.capacity());
        // The hook also wakes a loop blocked while only deferred samples are out
        // (wait_for_samples(): those generations are "abortable" then), so their cancel is
        // seen at once.
        cancel_.set_abort_hook([this] {
            engine_.request_abort();
            wake_loop();
        });
    }

    /// CONTRACT: after the destructor the controller holds nothing of this loop: no abort hook
    /// (it refers to the engine) and no registration of a generation still in flight (a frame
    /// for one is stale from then on). The flags are shared, so even a frame racing with this
    /// destructor writes live memory. The process's watcher thread is stopped before the loop
    /// is destroyed (worker mains declare it after the loop). The sampler thread is joined
    /// (a running deferred sample finishes first; a mask is bounded) before the engine, which
    /// outlives the loop, goes away.
    ~WorkerLoop() {
        abandon_in_flight();
        cancel_.set_abort_hook(nullptr);
    }
    WorkerLoop(const WorkerLoop&) = delete;
    WorkerLoop& operator=(const WorkerLoop&) = delete;

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
                    {"n_ctx_train", in.n_ctx_train},
                    {"kv_cache_bytes", in.kv_cache_bytes},
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
                      {"unique_keys", in.supports_token_veto},
                      {"eviction", true},
                      {"prefix_sharing", opts_.min_shared_prefix > 0},
                      {"progress", heartbeat_.enabled()}}},
                    {"spill_budget_bytes", opts_.spill_budget_bytes},
                    {"min_shared_prefix", opts_.min_shared_prefix},
                    {"n_swa", in.n_swa},
                    {"swa_cache", in.swa_cache.empty() ? json(nullptr) : json(in.swa_cache)},
                    {"checkpoints_per_slot", checkpoints_.per_slot()},
                    {"heartbeat_ms", opts_.heartbeat_ms > 0 ? opts_.heartbeat_ms : 0.0},
                    {"max_step_ms", pieces_.adaptive() ? opts_.max_step_ms : 0.0},
                    {"deterministic", grid() > 0},
                    {"prefill_grid", grid()},
                    {"special_tokens",
                     {{"bos", opt_str(in.bos_text)}, {"eos", opt_str(in.eos_text)},
                      {"bos_id", opt_id(in.bos_id)}, {"eos_id", opt_id(in.eos_id)},
                      {"fim_pre_id", opt_id(in.fim_pre_id)}, {"fim_suf_id", opt_id(in.fim_suf_id)},
                      {"fim_mid_id", opt_id(in.fim_mid_id)},
                      {"control", in.control_texts}}},
                    {"chat_template", opt_str(in.chat_template)}};
    }

    void write_ready() {
        json r = ready_record();
        r["speculative"] = speculation_ready();
        for (const auto& [key, value] : opts_.ready_extra.items()) r[key] = value;
        out_.write_json(r);
    }

    /// Runs the event loop on `in_fd` (stdin) until EOF or shutdown. Returns the exit status
    /// (0). Generations still in flight then end without terminal records (spec §4.3) and are
    /// unregistered from the cancel controller.
    int run(int in_fd) {
        const int rc = serve(in_fd);
        abandon_in_flight();
        return rc;
    }

    /// Ends every generation in flight without a terminal record (stdin EOF or `shutdown`,
    /// spec §4.3): unregisters its cancel flag, frees its slot (dirty: its work is cut short).
    void abandon_in_flight() noexcept {
        for (auto& g : active_) {
            cancel_.finish(g->id());
            Slot& slot = slots_.at(g->slot());
            SlotTable::mark_dirty(slot);
            slots_.release(g->slot());
        }
        active_.clear();
    }

    /// Whether the state the loop keeps between generations is consistent; false while any
    /// generation is in flight. Asserted in debug builds whenever the loop is idle; the unit
    /// tests check it after every scenario. O(capacity + sessions): no slot busy; the cancel
    /// controller holds no registration; at most capacity - 1 sessions bound, each to one
    /// slot and none also spilled; every clean slot's resident ids are as many as the
    /// engine's position.
    bool idle_invariants_hold() const {
        if (!active_.empty() || cancel_.active_count() != 0) return false;
        if (slots_.busy_count() != 0 || slots_.bound_count() > slots_.max_named()) return false;
        for (size_t i = 0; i < slots_.capacity(); ++i) {
            const Slot& s = slots_.at(static_cast<int32_t>(i));
            if (!s.session.empty()) {
                if (spill_.contains(s.session)) return false;
                for (size_t j = 0; j < i; ++j)
                    if (slots_.at(static_cast<int32_t>(j)).session == s.session) return false;
            }
            if (!s.dirty && engine_.position(s.index) != static_cast<int64_t>(s.resident.size())) return false;
        }
        return true;
    }

private:
    /// Lines are read and prechecked by an InputReader thread (fast refusals, spec §4); this
    /// thread handles them in order between steps.
    int serve(int in_fd) {
        InputReader reader(in_fd, [this](InputLine& l) { precheck(l); });
        WakeTarget wake(*this, reader);
        std::deque<InputLine> lines;
        for (;;) {
            // Input first: block only when nothing is in flight (no busy waiting when idle);
            // while busy, take what is there (bounded, so steps keep their pace) and step.
            // Leaving idle, wait once, briefly, for more lines (gather_ms()): the requests of
            // a burst reach the parent milliseconds apart, and a generate read now is a
            // prompt prefilled in this step, not a whole step later.
            size_t taken = 0;
            bool gathered = busy();
            for (;;) {
                if (lines.empty()) {
                    collect_samples();  // finished deferred samples: their generations step again
                    int timeout_ms = 0;
                    // Nothing to step (idle, or every generation waits for its deferred
                    // sample): block; a sample's result or a cancel wakes the wait.
                    if (!steppable() && taken == 0) timeout_ms = -1;
                    else if (!gathered) { timeout_ms = gather_ms(); gathered = true; }
                    if (timeout_ms < 0 && !busy()) refill_spare(reader);
                    assert(busy() || idle_invariants_hold());
                    const bool any = timeout_ms < 0 && busy() ? wait_for_samples(reader) : reader.wait(timeout_ms);
                    if (!any) break;
                    reader.take(lines);
                }
                InputLine l = std::move(lines.front());
                lines.pop_front();
                if (l.kind == InputLine::Kind::eof) return 0;  // CONTRACT: stdin EOF = exit now (spec §1)
                if (handle_input(l) == Flow::stop) return 0;   // shutdown
                taken += l.text.size() + 1;
                if (busy() && taken >= kMaxInputPerTurn) break;
            }
            if (busy()) step();
        }
    }

    /// Blocks until input arrives, a deferred sample's result is ready, or one of the
    /// generations waiting for theirs is cancelled (they are marked abortable meanwhile, so
    /// the controller's abort hook runs, which wakes the reader). Returns whether lines came.
    bool wait_for_samples(InputReader& reader) {
        assert(busy() && !steppable());
        assert(awaiting_samples() <= samples_.pending());
        abortable_.clear();
        for (const auto& g : active_)
            if (g->awaiting_sample()) abortable_.push_back(g->id());
        cancel_.begin_step(abortable_);  // one already cancelled runs the hook at once
        const bool any = reader.wait(-1);
        cancel_.end_step();
        return any;
    }

    /// Wakes serve()'s blocking wait, if it is in one (sampler thread, cancel watcher).
    void wake_loop() {
        std::lock_guard<std::mutex> lock(wake_mu_);
        if (wake_reader_ != nullptr) wake_reader_->wake();
    }

    /// serve()'s input reader as wake_loop()'s target while it lives.
    struct WakeTarget {
        WorkerLoop& loop;
        WakeTarget(WorkerLoop& l, InputReader& r) : loop(l) {
            std::lock_guard<std::mutex> lock(loop.wake_mu_);
            loop.wake_reader_ = &r;
        }
        ~WakeTarget() {
            std::lock_guard<std::mutex> lock(loop.wake_mu_);
            loop.wake_reader_ = nullptr;
        }
    };

    /// Idle work before blocking on input: prepares the spare state buffer (state_buffer.h)
    /// a piece at a time, stopping as soon as a line is there. Out of memory only skips it.
    void refill_spare(InputReader& reader) {
        if (!spare_.needs_refill()) return;
        try {
            spare_.refill([&reader] { return reader.wait(0); });
        } catch (const std::bad_alloc&) {
        }
    }

public:
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
        const bool is_call = op_it != req.end() && op_it->is_string() &&
                             (*op_it == "tokenize" || *op_it == "detokenize");
        // A generate registers its id itself, and so does a call (submit_call()).
        if (id && !is_generate && !is_call) cancel_.saw(*id);
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
            } else if (is_call) {
                submit_call(std::move(req), *id, op == "tokenize" ? CallWorker::Op::tokenize : CallWorker::Op::detokenize);
            } else if (op == "ping") {
                out_.write_json(json{{"type", "pong"}, {"id", *id}});
            } else if (op == "session_open" || op == "session_close" || op == "session_reset") {
                handle_session_op(req, *id, op);
            } else if (op == "shutdown") {
                out_.write_json(json{{"type", "ack"}, {"id", *id}, {"op", "shutdown"}});
                abandon_in_flight();
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

    /// What precheck() leaves on a generate line for the loop thread.
    struct Prechecked {
        json req;                     ///< the parsed line
        uint64_t id = 0;
        bool refused = false;         ///< the reader answered it with an error record
        std::vector<TokenId> prompt;  ///< its tokens (not refused)
        /// A tokenize/detokenize call with a valid id, parsed by the reader (the loop only
        /// queues it for the call thread: a line of megabytes costs it no parse).
        std::optional<CallWorker::Op> call;
    };

    /// Reader thread (InputReader): the checks of a generate that depend on the request alone
    /// (spec §4: fields, unsupported_grammar, tokenization, context clamp, invalid_grammar).
    /// A failure is answered here at once, even while the loop thread is inside a step (fast
    /// refusals); the loop thread then only notes the id. A passing generate carries its
    /// parsed fields and tokens to the loop (tokenized once, off the decode path). Lines that
    /// are not generates, do not parse, or whose id is not above every id seen so far (stale:
    /// the loop answers that) are left to the loop untouched. Touches only thread-safe state:
    /// the immutable engine info, the tokenizer, validate_grammar(), refusals_out_ and
    /// precheck_highest_ (this thread's own). Never throws.
    void precheck(InputLine& l) noexcept {
        try {
            const std::string& line = l.text;
            // Cheap filters; the loop re-parses the rest. "tokenize\"" also finds "detokenize".
            if (line.find("\"generate\"") == std::string::npos && line.find("tokenize\"") == std::string::npos) {
                note_precheck_id(line);
                return;
            }
            json req = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
            if (req.is_discarded() || !req.is_object()) return;
            auto id_it = req.find("id");
            if (id_it == req.end() || !id_it->is_number_unsigned() || id_it->get<uint64_t>() < 1) return;
            const uint64_t id = id_it->get<uint64_t>();
            const uint64_t highest = precheck_highest_;
            precheck_highest_ = std::max(highest, id);
            auto op_it = req.find("op");
            if (op_it != req.end() && op_it->is_string() && (*op_it == "tokenize" || *op_it == "detokenize")) {
                auto p = std::make_shared<Prechecked>();
                p->id = id;
                p->call = *op_it == "tokenize" ? CallWorker::Op::tokenize : CallWorker::Op::detokenize;
                p->req = std::move(req);
                l.prechecked = std::move(p);
                return;
            }
            if (op_it == req.end() || !op_it->is_string() || *op_it != "generate" || id <= highest) return;
            auto p = std::make_shared<Prechecked>();
            p->id = id;
            try {
                check_intrinsic(req, id, p->prompt);
            } catch (const RequestError& e) {
                refusals_out_.write_error(id, e);
                p->refused = true;
                p->prompt.clear();
            }
            p->req = std::move(req);
            l.prechecked = std::move(p);
        } catch (...) {
            l.prechecked.reset();  // e.g. bad_alloc: the loop thread handles the line as usual
        }
    }

    /// The request-intrinsic checks of a generate, in spec order; fills `prompt`. Throws
    /// RequestError. Thread-safe (see precheck()).
    void check_intrinsic(const json& req, uint64_t id, std::vector<TokenId>& prompt) const {
        const GenerateRequest r = parse_generate(req, id);
        const EngineInfo& info = engine_.info();
        if (!r.grammar.empty() && !info.supports_grammar)
            throw RequestError{"unsupported_grammar", "this worker cannot constrain sampling with a grammar",
                               json::object()};
        if (r.unique_keys && !info.supports_token_veto)
            throw RequestError{"unsupported_grammar", "this worker cannot keep JSON keys unique (unique_keys)",
                               json::object()};
        refuse_if_cannot_fit(r, info);
        encode_segments(engine_, r.segments, prompt);
        if (prompt.empty()) throw RequestError{"empty_prompt", "the prompt tokenizes to nothing", json::object()};
        check_context(static_cast<int64_t>(prompt.size()), r.max_new_tokens);
        if (!r.grammar.empty()) {
            std::string error;
            if (!engine_.validate_grammar(r.grammar, error))
                throw RequestError{"invalid_grammar", "the grammar does not parse: " + error, json::object()};
        }
    }

    /// Throws context_length_exceeded when the prompt leaves no room; else the tokens it may
    /// generate (spec §4 "Context clamp").
    int64_t check_context(int64_t n_prompt, int64_t max_new_tokens) const {
        const int64_t n_ctx = engine_.info().n_ctx;
        const int64_t max_new = clamp_max_new(n_prompt, n_ctx, max_new_tokens);
        if (max_new < 0)
            throw RequestError{"context_length_exceeded",
                               "prompt has " + std::to_string(n_prompt) + " tokens; the context window is " +
                                   std::to_string(n_ctx) + " (no room to generate)",
                               json{{"prompt_tokens", n_prompt}, {"n_ctx", n_ctx}}};
        return max_new;
    }

    /// Reader thread: keeps precheck_highest_ up to date for a line that is not a generate.
    void note_precheck_id(const std::string& line) {
        json req = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
        if (req.is_discarded() || !req.is_object()) return;
        auto it = req.find("id");
        if (it != req.end() && it->is_number_unsigned()) precheck_highest_ = std::max(precheck_highest_, it->get<uint64_t>());
    }

    /// Loop thread: handles one line from the InputReader, in order.
    Flow handle_input(InputLine& l) {
        if (l.kind == InputLine::Kind::too_long) {
            out_.write_error(std::nullopt, {"line_too_long",
                                            "input line exceeds " + std::to_string(kMaxLineBytes) + " bytes",
                                            json::object()});
            return Flow::next;
        }
        auto* p = static_cast<Prechecked*>(l.prechecked.get());
        if (p == nullptr) return handle_line(l.text);
        if (p->call) {
            try {
                submit_call(std::move(p->req), p->id, *p->call);
            } catch (const std::exception& e) {
                out_.write_error(p->id, {"engine_error", std::string("internal error: ") + e.what(), json::object()});
            }
            return Flow::next;
        }
        if (hooks_.on_generate_start) hooks_.on_generate_start(p->id, out_.sink());
        if (p->refused) {  // answered by the reader: only note the id (spec §2, §7)
            cancel_.sync();
            cancel_.saw(p->id);
            return Flow::next;
        }
        try {
            handle_generate(p->req, p->id, l.t_read, &p->prompt);
        } catch (const RequestError& e) {
            out_.write_error(p->id, e);
        } catch (const std::exception& e) {
            out_.write_error(p->id, {"engine_error", std::string("internal error: ") + e.what(), json::object()});
        }
        return Flow::next;
    }

    /// Whether any generation is in flight.
    bool busy() const { return !active_.empty(); }
    /// Whether a step would advance anything: some generation in flight does not wait for a
    /// deferred sample.
    bool steppable() const {
        for (const auto& g : active_)
            if (!g->awaiting_sample()) return true;
        return false;
    }
    /// Generations whose deferred sample is out (they take no part in steps meanwhile).
    size_t awaiting_samples() const {
        size_t n = 0;
        for (const auto& g : active_) n += g->awaiting_sample();
        return n;
    }
    /// Deferred samples handed to the sampler thread and not yet collected (also those of
    /// generations that ended meanwhile).
    size_t samples_in_flight() const { return samples_.pending(); }
    size_t in_flight() const { return active_.size(); }
    const SlotTable& slots() const { return slots_; }
    const SpillStore& spill() const { return spill_; }

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
    void step() {
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
    void run_until_idle() {
        while (busy()) {
            if (!steppable() && !samples_.has_result()) samples_.wait_for_result();
            step();
        }
        calls_.wait_idle();
    }

    /// Tokenize/detokenize calls queued or running on the call thread (tests).
    size_t calls_pending() const { return calls_.pending(); }

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
    /// Fewest prompt tokens --max-step-ms shrinks a step to. WHY not less: where a machine is
    /// slow enough to need it (oversubscribed), a step's time is mostly per graph node, not per
    /// token (2-core host at load 13: 64-token steps 5-6 s, 32-token steps up to 36 s), so
    /// smaller pieces would only multiply the steps of a long prompt.
    static constexpr size_t kMinAdaptedPiece = 64;

    // -- steps -----------------------------------------------------------------------------

    enum class Outcome { done, aborted };

    /// Plans one step over every generation in flight and runs it (run_batch).
    Outcome run_planned_step() {
        resolve_waiters();
        compact();  // a waiter whose copy failed beyond repair ended
        const auto t_start = Clock::now();
        cands_.clear();
        size_t n_decode = 0;
        for (const auto& g : active_) {
            // A generation whose deferred sample is out has no token to append yet.
            const bool decoding = g->phase() == Generation::Phase::decode && !g->awaiting_sample();
            n_decode += decoding;
            // A generation waiting for another one's prefill (spec §6.2) gets nothing yet.
            cands_.push_back(StepCandidate{decoding, waiting(g->id()) ? 0 : g->prefill_remaining(),
                                           g->prompt().size() - g->prefill_remaining()});
        }
        n_decode += plan_drafts(n_decode);
        size_t budget = pacer_.budget(n_decode), chunk = opts_.prefill_chunk;
        if (pieces_.adaptive()) {  // a slowed-down machine: smaller pieces keep the step bounded
            budget = std::min(budget, n_decode + pieces_.limit());
            chunk = std::min(chunk, pieces_.limit());
        }
        plan_step(cands_, budget, chunk, planned_, grid());
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
    Outcome run_batch(const size_t* idx, size_t n, Clock::time_point t_start, bool whole_step) {
        if (n == 0) return Outcome::done;
        const Status st = call_engine(idx, n);
        if (st == Status::aborted) return Outcome::aborted;
        const auto t_end = Clock::now();
        if (st == Status::ok) {
            if (whole_step) {
                observe_pace(t_start, t_end);
                observe_step_cost(t_start, t_end);
            }
            commit(idx, n, t_end);
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
    Status call_engine(const size_t* idx, size_t n) {
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
    void observe_pace(Clock::time_point t_start, Clock::time_point t_end) {
        size_t tokens = 0, prefill_tokens = 0;
        bool prefill = false;
        for (const PlannedItem& p : planned_) {
            tokens += p.n;
            prefill |= p.prefill;
            if (p.prefill) prefill_tokens += p.n;
        }
        if (!prefill) return;
        const double ms = std::chrono::duration<double, std::milli>(t_end - t_start).count();
        pacer_.observe(tokens, ms);
        const size_t before = pieces_.limit();
        pieces_.observe(prefill_tokens, tokens, ms);
        if (pieces_.limit() != before)
            std::fprintf(stderr, "trioserve-worker: prompt tokens per step %s to %zu (a step of %zu tokens took %.0f ms; "
                         "--max-step-ms %.0f)\n", pieces_.limit() < before ? "lowered" : "raised", pieces_.limit(),
                         tokens, ms, opts_.max_step_ms);
    }

    /// Feeds the speculation cost model with a whole decode-only step (speculation.h: the
    /// live times at the current context depth replace the start-up estimate).
    void observe_step_cost(Clock::time_point t_start, Clock::time_point t_end) {
        if (!speculating()) return;
        size_t tokens = 0;
        for (const PlannedItem& p : planned_) {
            if (p.prefill) return;
            tokens += p.n;
        }
        step_cost_.observe(tokens, std::chrono::duration<double, std::milli>(t_end - t_start).count());
    }

    /// The engine appended the items `idx[0..n)`: record their tokens as resident, then sample
    /// where logits were computed (before any other engine call: logits last one call).
    void commit(const size_t* idx, size_t n, Clock::time_point t_end) {
        committed_ = true;
        for (size_t k = 0; k < n; ++k) {
            const PlannedItem& p = planned_[idx[k]];
            Generation& g = *active_[p.index];
            Slot& slot = slots_.at(g.slot());
            if (p.prefill) {
                slot.resident.insert(slot.resident.end(), g.prefill_cursor(), g.prefill_cursor() + p.n);
                g.prefilled(p.n, t_end);
                if (g.prefill_remaining() == 0) take_checkpoint(slot);  // a turn boundary (spec §6.3)
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
    bool hand_over(Generation& g) noexcept {
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
    void collect_samples() {
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
    bool roll_back(Generation& g) {
        const int64_t want = static_cast<int64_t>(slots_.at(g.slot()).resident.size());
        const int64_t pos = engine_.position(g.slot());
        if (pos == want) return true;
        return pos > want && engine_.truncate(g.slot(), want) == Status::ok && engine_.position(g.slot()) == want;
    }

    // -- speculative decoding (speculation.h, spec/worker-protocol.md §4.6) ------------------

    /// Whether generations are drafted. Not with a small sliding-window cache: its cells
    /// older than the window go as soon as a step passes them, so the rejected tail of a
    /// draft could not be removed (llama.cpp refuses the cut) — the full-size cache is fine.
    bool speculating() const {
        const EngineInfo& in = engine_.info();
        return opts_.speculative != SpeculativeMode::off && in.supports_speculation && in.supports_truncate &&
               (in.n_swa == 0 || in.swa_cache == "full");
    }

    /// Step planning: picks this step's draft of every decoding generation that speculates
    /// (cands_ is built, in active_ order) and sets cands_[i].draft and its SpecState::buf
    /// (pending token, then the draft). Returns the draft tokens added to the step. The
    /// lengths come from choose_draft_lengths(): all zero when drafting would not pay.
    size_t plan_drafts(size_t n_decode) {
        if (!speculating() || n_decode == 0) return 0;
        spec_idx_.clear();
        spec_alpha_.clear();
        spec_avail_.clear();
        const int64_t n_ctx = engine_.info().n_ctx;
        for (size_t i = 0; i < active_.size(); ++i) {
            Generation& g = *active_[i];
            SpecState* sp = g.spec();
            if (sp == nullptr || !cands_[i].decoding) continue;
            const std::vector<TokenId>& out = g.output();  // its last id is the pending token
            for (; sp->indexed_output < out.size(); ++sp->indexed_output) sp->index.append(out[sp->indexed_output]);
            const int64_t pos = engine_.position(g.slot());
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
        if (spec_idx_.empty()) return 0;
        // Room in the step: the engine's batch holds budget + capacity tokens (scheduler.h),
        // and a draft must not crowd out the step's prefill floor.
        const size_t room = opts_.batch_tokens > n_decode + kMinPacedPrefill ? opts_.batch_tokens - n_decode - kMinPacedPrefill : 0;
        size_t total = 0;
        for (size_t& a : spec_avail_) {
            a = std::min(a, room > total ? room - total : 0);
            total += a;
        }
        choose_draft_lengths(spec_alpha_, spec_avail_, n_decode, 0, step_cost_, kMinDraftGain, spec_k_);
        size_t added = 0;
        for (size_t j = 0; j < spec_idx_.size(); ++j) {
            Generation& g = *active_[spec_idx_[j]];
            SpecState& sp = *g.spec();
            const size_t k = spec_k_[j];
            if (k == 0) {
                sp.idle();
                continue;
            }
            sp.buf.assign(1, *g.pending());
            sp.buf.insert(sp.buf.end(), sp.candidate.tokens.begin(), sp.candidate.tokens.begin() + static_cast<std::ptrdiff_t>(k));
            cands_[spec_idx_[j]].draft = k;
            added += k;
        }
        if (opts_.log_drafts && added > 0) {
            std::fprintf(stderr, "trioserve-worker: drafts (streams %zu):", n_decode);
            for (size_t j = 0; j < spec_idx_.size(); ++j)
                std::fprintf(stderr, " id %llu k=%zu/%zu a=%.2f", static_cast<unsigned long long>(active_[spec_idx_[j]]->id()),
                             spec_k_[j], spec_avail_[j], spec_alpha_[j]);
            std::fprintf(stderr, "\n");
        }
        return added;
    }

    /// Verification of `g`'s draft after the step that carried it (commit(); the slot's
    /// resident ids already hold the pending token and the k draft tokens). Samples position
    /// by position through the generation's ordinary per-token path and stops at the first
    /// token that ends the generation, differs from the draft, or follows a cancel; then cuts
    /// the slot back so it holds exactly the tokens before the new pending one, as plain
    /// decoding would (the rejected cells are removed: Engine::truncate).
    void verify_draft(Generation& g, const PlannedItem& p) {
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
    void remember_output(Generation& g) noexcept {
        if (global_drafts_.capacity_tokens() == 0 || g.spec() == nullptr || g.cancelled()) return;
        const std::vector<TokenId>& out = g.output();
        global_drafts_.add_output(nullptr, 0, out.data(), out.size());
    }

public:
    /// Measures the step cost model (ms of a decode step of n tokens in one slot) on this
    /// machine and model, unless opts_.step_cost gave it; slot 0 is reset afterwards. Call
    /// once before write_ready() (the worker mains do), while no generation is in flight.
    void calibrate_speculation() {
        if (!speculating()) return;
        if (!opts_.step_cost.empty()) {
            step_cost_.set(opts_.step_cost, /*fixed=*/true);
            return;
        }
        // Up to the widest decode step drafting may make at full capacity (bounded by 64 and
        // the engine's batch): beyond the last point the model extrapolates in proportion.
        const size_t widest = slots_.capacity() * (opts_.draft_max + 1);
        const size_t max_n = std::min<size_t>(std::min<size_t>(widest, 64),
                                              static_cast<size_t>(std::max<int64_t>(1, engine_.info().max_step_tokens)));
        const size_t n_vocab = static_cast<size_t>(std::max<int64_t>(engine_.info().n_vocab, 1));
        std::vector<TokenId> ids(64 + max_n);
        for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<TokenId>((i * 7919 + 13) % n_vocab);
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
        step_cost_.set(std::move(pts));
    }

    /// The ready record's `speculative` object (spec §3).
    json speculation_ready() const {
        json cost = json::array();
        for (const auto& [n, ms] : step_cost_.points()) cost.push_back(json::array({n, ms}));
        return json{{"mode", speculating() ? "auto" : "off"},
                    {"draft_max", speculating() ? opts_.draft_max : 0},
                    {"sources", speculating() ? json::array({"request", "global"}) : json::array()},
                    {"global_index_tokens", global_drafts_.capacity_tokens()},
                    {"global_index_bytes", global_drafts_.bytes()},
                    {"step_cost_ms", cost}};
    }

private:
    /// A draft must promise this much more throughput than the plain step (cost-model noise).
    static constexpr double kMinDraftGain = 0.05;

    // -- admission -------------------------------------------------------------------------
    //
    // Two phases, so that a generate that fails changes nothing and one that succeeds cannot
    // be left half-applied:
    //   plan_admission()   validates, tokenizes, chooses the slot, makes the sampler, allocates
    //                      every object and container entry the commit needs, and prepares the
    //                      engine slot (save an eviction victim's state, load a spilled copy,
    //                      reset/truncate). It may fail at any point (RequestError, engine
    //                      error, bad_alloc); the slot and session tables, the spill store and
    //                      the cancel registrations are then exactly as before, except that a
    //                      slot whose engine state a failed engine call made unknown is marked
    //                      dirty (its next user prefills from scratch; a session bound to it
    //                      stays bound).
    //   commit_admission() applies the prepared pieces with moves and swaps only: unbind and
    //                      spill the victim, bind the session, drop the restored spill copy,
    //                      acquire the slot, register the cancel flag, queue the generation. It
    //                      cannot fail (noexcept: anything throwing there would terminate the
    //                      worker, which the parent restarts, rather than leak a busy slot).

    /// A generation that waits until another one's prefill holds its shared prefix.
    struct PendingPrefix {
        uint64_t id = 0;         ///< the waiting generation (set at commit)
        uint64_t source_id = 0;  ///< the generation whose prefill it waits for (0: none)
        int32_t source_slot = -1;
        size_t target = 0;       ///< prompt tokens the source will hold that it shares
    };

    /// A generate prepared by plan_admission(), applied by commit_admission().
    struct Admission {
        std::unique_ptr<Generation> gen;
        CancelController::Registration registration;
        int32_t slot = -1;
        bool evict = false;                ///< the slot's idle named session is evicted
        SpillStore::Prepared victim;       ///< its saved state (empty: not kept)
        std::string bind_session;          ///< non-empty: a new named session to bind
        bool named = false;                ///< a named session's generate (sets long_retention)
        bool long_retention = false;
        bool take_spilled = false;         ///< the session's spilled copy was used: drop it
        std::vector<TokenId> resident;     ///< the slot's resident ids once prepared
        PendingPrefix wait;                ///< source_id != 0: wait for that prefill (spec §6.2)
    };

    /// Validates, tokenizes, picks and prepares a slot, makes the sampler, and queues the
    /// generation (spec §4: checks in this order: id staleness, fields, tokenization, context
    /// clamp, grammar — precheck() ran those already for lines from the InputReader — then
    /// capacity and session admission, slot).
    void handle_generate(const json& req, uint64_t id, Clock::time_point t_read,
                         std::vector<TokenId>* pretokenized = nullptr) {
        cancel_.sync();  // CONTRACT: a cancel written before its generate line is latched (spec §7)
        // CONTRACT: ids strictly increase (spec §2). Checked before anything else so a stale
        // id can never disturb the cancel state of a newer request.
        const uint64_t highest = cancel_.highest_read();
        if (id <= highest)
            throw detail::invalid("stale or duplicate id " + std::to_string(id) + " (highest id read: " +
                                  std::to_string(highest) + ")");
        Admission a;
        try {
            a = plan_admission(req, id, t_read, pretokenized);
        } catch (...) {
            cancel_.saw(id);  // a generate that failed is finished: frames for it are stale
            throw;
        }
        commit_admission(a);
    }

    /// `pretokenized`: the prompt's tokens from precheck() (moved from), or null.
    Admission plan_admission(const json& req, uint64_t id, Clock::time_point t_read,
                             std::vector<TokenId>* pretokenized) {
        GenerateRequest r = parse_generate(req, id);
        const EngineInfo& info = engine_.info();
        const int64_t cap = static_cast<int64_t>(slots_.capacity());
        if (!r.grammar.empty() && !info.supports_grammar)
            throw RequestError{"unsupported_grammar", "this worker cannot constrain sampling with a grammar",
                               json::object()};
        if (r.unique_keys && !info.supports_token_veto)
            throw RequestError{"unsupported_grammar", "this worker cannot keep JSON keys unique (unique_keys)",
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

        refuse_if_cannot_fit(r, info);
        std::vector<TokenId> prompt;
        if (pretokenized != nullptr) prompt = std::move(*pretokenized);
        else encode_segments(engine_, r.segments, prompt);
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
                } else {  // prefill instead: the slot is reset below
                    std::fprintf(stderr, "trioserve-worker: restoring session state failed (%s); prefilling instead\n",
                                 status_name(st));
                    base_dirty = true;
                }
            }
            PrefillPlan plan = plan_prefill(*base, prompt, base_dirty, info.supports_truncate, grid());
            // Shared prefix (spec §6.2): another slot or a spilled session may hold more of
            // this prompt than the slot itself; then the slot starts from a copy of that state.
            SharedCopy copy = share_prefix(si, prompt, reachable_keep(si, *base, prompt, plan));
            if (copy.attempted) {
                touched = true;
                base = &copy.resident;  // empty when the copy failed (the engine slot was reset)
                base_dirty = copy.dirty;
                plan = plan_prefill(*base, prompt, base_dirty, info.supports_truncate, grid());
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
                        // it): start from a checkpoint at or before the divergence, if the
                        // slot has one (spec §6.3), else prefill from zero.
                        const size_t at = restore_checkpoint(si, prompt, plan.keep, checkpoint_ms);
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
            if (copy.ok && !plan.reset) {
                a.gen->set_extra("copied_prompt_tokens", static_cast<int64_t>(reused));
                a.gen->set_extra("copy_source", copy.from_slot ? "slot" : "spill");
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
    void commit_admission(Admission& a) noexcept {
        Slot& slot = slots_.at(a.slot);
        if (a.evict) {
            slots_.unbind(slot);
            if (!a.victim.empty()) spill_.put(std::move(a.victim));
        }
        if (!a.bind_session.empty()) {
            if (a.take_spilled) spill_.erase(a.bind_session);
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

    /// The idle named session bound to `slot` (an eviction victim), copied for the spill store
    /// (spec §6.1) when the engine can save it and the budget allows; empty otherwise (the
    /// session is then dropped at commit). Reads the slot only.
    SpillStore::Prepared save_victim(const Slot& slot) {
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
        e.long_retention = slot.long_retention;
        return spill_.prepare(slot.session, std::move(e));
    }

    bool waiting(uint64_t id) const {
        for (const PendingPrefix& w : waiters_)
            if (w.id == id) return true;
        return false;
    }

    Generation* find_active(uint64_t id) {
        for (auto& g : active_)
            if (g->id() == id && g->phase() != Generation::Phase::done) return g.get();
        return nullptr;
    }

    /// Among the generations in flight that still prefill (and do not wait themselves), the
    /// one whose prompt shares the most of `prompt` beyond what its slot already holds, when
    /// that beats `have` by opts_.min_shared_prefix (spec §6.2 "in-flight prefixes"). Only for
    /// engines that can cut any state back (the copy is trimmed to the shared prefix).
    PendingPrefix pending_prefix(const std::vector<TokenId>& prompt, int32_t own, size_t have) const {
        PendingPrefix best;
        if (opts_.min_shared_prefix == 0 || !engine_.info().trims_any_state) return best;
        for (const auto& g : active_) {
            if (g->slot() == own || g->prefill_remaining() == 0 || waiting(g->id())) continue;
            const size_t potential = usable_prefix(g->prompt(), prompt, grid());
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
    void resolve_waiters() {
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
    void copy_waited(Generation& g, int32_t src_slot) {
        Slot& own = slots_.at(g.slot());
        const Slot& src = slots_.at(src_slot);
        if (src.dirty || own.dirty) return;
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

    /// What share_prefix() did to an engine slot.
    struct SharedCopy {
        bool attempted = false;  ///< the engine slot's state was replaced (or reset by a failed copy)
        bool ok = false;         ///< it now holds exactly `resident` (else position 0, or dirty)
        bool dirty = false;      ///< a failed copy could not even reset the slot: state unknown
        bool from_slot = false;  ///< the source was a slot (else a spilled session)
        std::vector<TokenId> resident;  ///< the ids the engine slot now holds (ok) — before trimming
        double ms = 0;           ///< time the copy took
    };

    /// If another slot or a spilled session holds at least opts_.min_shared_prefix more tokens
    /// of `prompt` than engine slot `si` does (`own_keep`; 0 when the slot is dirty), replaces
    /// the engine slot's state by a copy of that one (prefix_index.h) and returns the ids it
    /// now holds; the caller then plans the prefill against those, so the copy is trimmed to
    /// the shared prefix like any resident state and nothing past the divergence stays.
    /// Changes no table (slot table, spill store): only the engine slot. The copy is complete
    /// on return (Engine::copy_state contract), so the source may be evicted, trimmed or
    /// reused by the very next request without affecting it. A spilled entry is copied, not
    /// taken: its session still restores it. A failed copy leaves the engine slot reset
    /// (`ok` false: full prefill, same output). Never throws except bad_alloc.
    SharedCopy share_prefix(int32_t si, const std::vector<TokenId>& prompt, size_t own_keep) {
        SharedCopy out;
        if (opts_.min_shared_prefix == 0) return out;
        const PrefixSource src = find_prefix_source(
            slots_, spill_, prompt, si, own_keep, opts_.min_shared_prefix,
            [this](int32_t s, size_t keep) { return engine_.can_truncate(s, static_cast<int64_t>(keep)); },
            engine_.info().trims_any_state, grid(), [this](int32_t s) { return exact_tokens(s); });
        if (src.kind == PrefixSource::Kind::none) return out;
        const auto t0 = Clock::now();
        const std::vector<TokenId>* ids = nullptr;
        Status st = Status::engine_error;
        if (src.kind == PrefixSource::Kind::slot) {
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

    // -- checkpoints (spec §6.3) -------------------------------------------------------------

    /// The prompt tokens engine slot `si` (holding `base`) can really provide under `plan`:
    /// plan.keep, unless the state cannot be cut back that far (a sliding window slid past it),
    /// then the newest usable checkpoint's position, else 0. The shared-prefix search compares
    /// other states with this, not with a trim that would fail.
    size_t reachable_keep(int32_t si, const std::vector<TokenId>& base, const std::vector<TokenId>& prompt,
                          const PrefillPlan& plan) const {
        if (plan.reset) return 0;
        if (plan.keep >= base.size() || engine_.can_truncate(si, static_cast<int64_t>(plan.keep))) return plan.keep;
        const SlotCheckpoint* c = checkpoints_.best(si, prompt, plan.keep);
        return c != nullptr ? c->tokens.size() : 0;
    }

    /// Saves a checkpoint of `slot` at its current position (its prompt just finished
    /// prefilling). A failure only means no checkpoint: it is a cache. With the prefill grid
    /// only at a grid position (the whole prompt then came in whole pieces, spec §4.5).
    void take_checkpoint(const Slot& slot) noexcept {
        if (checkpoints_.per_slot() == 0 || slot.resident.empty()) return;
        if (grid() > 0 && slot.resident.size() % grid() != 0) return;
        try {
            SlotCheckpoint c;
            if (engine_.save_checkpoint(slot.index, c.state) != Status::ok) return;
            c.tokens = slot.resident;
            checkpoints_.add(slot.index, std::move(c));
        } catch (const std::exception&) {  // bad_alloc: go on without it
        }
    }

    /// Brings engine slot `si` back to the newest checkpoint at a position <= `keep` whose ids
    /// are a prefix of `prompt` (the slot's resident ids share `keep` ids with it, so they hold
    /// the checkpoint's ids too). Returns that position, or 0 when there is none or the
    /// restore failed (the engine slot may then be reset; the caller resets it). `ms` gets the
    /// time the restore took when one was tried.
    size_t restore_checkpoint(int32_t si, const std::vector<TokenId>& prompt, size_t keep, double& ms) {
        const SlotCheckpoint* c = checkpoints_.best(si, prompt, keep);
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
    Status copy_slot_state(int32_t src, int32_t dst) {
        std::vector<uint8_t> scratch = spare_.take();
        const Status st = engine_.copy_state(src, dst, scratch);
        spare_.note_size(scratch.size());
        spare_.give(std::move(scratch));
        return st;
    }

    /// Unbinds the (idle) session bound to `slot`, keeping a copy of its state in the spill
    /// store when the engine can save it and the budget allows (spec §6.1). The slot keeps its
    /// tokens (the caller takes it next). A failed save just drops the session.
    void evict_session(Slot& slot) {
        SpillStore::Prepared victim = save_victim(slot);
        slots_.unbind(slot);
        if (!victim.empty()) spill_.put(std::move(victim));
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

    /// Resets engine slot `si` (admission); throws engine_error when the engine fails.
    void reset_engine_slot(int32_t si) {
        const Status st = engine_.reset(si);
        if (st != Status::ok)
            throw RequestError{"engine_error", std::string("slot reset failed: ") + status_name(st), json::object()};
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

    /// context_length_exceeded before tokenizing, when even the fewest tokens the prompt can
    /// be (its bytes over the longest token's) leave no room: a prompt of megabytes is
    /// refused in the time it takes to add up its length.
    static void refuse_if_cannot_fit(const GenerateRequest& r, const EngineInfo& info) {
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

    /// A tokenize or detokenize (worker protocol §5): queued for the call thread
    /// (call_worker.h), which answers it while this thread keeps stepping; `capacity_exhausted`
    /// (retryable) when CallWorker::kMaxQueued calls already wait. The id is registered for
    /// cancel frames (a frame the parent wrote before the line is synced first, as for a
    /// generate).
    void submit_call(json req, uint64_t id, CallWorker::Op op) {
        cancel_.sync();
        if (!calls_.submit(id, op, std::move(req)))
            out_.write_error(id, {"capacity_exhausted",
                                  std::to_string(CallWorker::kMaxQueued) +
                                      " tokenize/detokenize calls are already waiting",
                                  json::object()});
    }

    // -- terminal paths --------------------------------------------------------------------

    /// Ends every generation whose cancel flag is set (step boundary). Returns whether any did.
    bool retire_cancelled() {
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
    void end(Generation& g) {
        g.finish(out_, scratch_, Clock::now());
        Slot& slot = slots_.at(g.slot());
        // CONTRACT: a cancelled generation leaves its slot dirty; otherwise `resident` is
        // exactly the slot state (even after a stop-string cut).
        if (!g.leaves_slot_clean()) SlotTable::mark_dirty(slot);
        else if (grid() > 0) keep_whole_pieces(slot, g.prompt().size());
        // KV-cache use for routers' load scoring (spec §4.2), after this slot's own update.
        g.set_extra("resident_tokens", slots_.resident_tokens());
        out_.write_json(g.done_record());
        remember_output(g);
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

    /// The prefill grid (spec §4.5), 0 when off.
    size_t grid() const { return opts_.prefill_grid > 1 ? opts_.prefill_grid : 0; }

    /// With the prefill grid: how many leading tokens of slot `si` were computed in whole grid
    /// pieces of a prefill (the only ones reused, spec §4.5). An idle clean slot holds only
    /// such (keep_whole_pieces() cuts the rest when its generation ends; copies, restores and
    /// checkpoints are of such states); a busy one those of its prompt's whole pieces so far.
    /// SIZE_MAX without the grid.
    size_t exact_tokens(int32_t si) const {
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
    /// pieces). What the engine cannot cut (a sliding window slid past) is reset.
    void keep_whole_pieces(Slot& slot, size_t prompt_tokens) noexcept {
        const size_t keep = std::min(slot.resident.size(), prompt_tokens) / grid() * grid();
        if (keep == slot.resident.size()) return;
        if (keep > 0 && engine_.truncate(slot.index, static_cast<int64_t>(keep)) == Status::ok) {
            slot.resident.resize(keep);
        } else if (engine_.reset(slot.index) == Status::ok) {
            slot.resident.clear();
        } else {
            SlotTable::mark_dirty(slot);
        }
        checkpoints_.keep_prefixes_of(slot.index, slot.resident);
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
    LockedSink locked_out_;
    RecordWriter out_;            ///< the loop thread's records
    RecordWriter refusals_out_;   ///< the input reader thread's refusals (precheck())
    uint64_t precheck_highest_ = 0;  ///< reader thread only: the highest id precheck() has seen
    WorkerOptions opts_;
    WorkerHooks hooks_;
    SlotTable slots_;
    SpillStore spill_;
    CheckpointStore checkpoints_;  ///< per-slot window checkpoints (small sliding-window caches)
    SpareStateBuffer spare_;  ///< for state saves off fresh memory (state_buffer.h)
    std::mt19937_64 rng_;
    std::shared_ptr<const TokenTexts> token_texts_;  ///< for unique_keys (json_key_guard.h); lazy
    StepPacer pacer_;  ///< sizes the budget of steps that carry decodes (opts_.step_target_ms)
    std::vector<std::unique_ptr<Generation>> active_;  ///< in flight, admission (FIFO) order
    // Reused per step: the loop allocates nothing per step once these have grown.
    std::vector<StepCandidate> cands_;
    std::vector<PlannedItem> planned_;
    std::vector<StepItem> items_;
    std::vector<uint64_t> abortable_;
    std::vector<PendingPrefix> waiters_;  ///< generations waiting for another one's prefill
    std::vector<size_t> batch_;  ///< indices into planned_ of the step's engine call
    bool committed_ = false;     ///< some engine call of the current step() was committed
    TokenScratch scratch_;
    // Deferred samples. wake_mu_/wake_reader_ come before samples_: its thread calls
    // wake_loop() until it is joined (samples_ is destroyed first).
    std::mutex wake_mu_;
    InputReader* wake_reader_ = nullptr;  ///< serve()'s reader while it runs (wake_loop())
    SampleWorker samples_;                ///< the sampler thread (sample_worker.h)
    // Declared after the sink it writes to: destroyed (joined) first.
    CallWorker calls_{engine_, cancel_, locked_out_};  ///< tokenize/detokenize (call_worker.h)
    std::vector<SampleWorker::Result> results_;  ///< collect_samples()'s reused buffer
    // Speculative decoding (plan_drafts(), verify_draft()).
    GlobalDraftIndex global_drafts_;  ///< recent outputs of every generation (bounded)
    StepCostModel step_cost_;         ///< calibrate_speculation()
    std::vector<size_t> spec_idx_, spec_avail_, spec_k_;
    std::vector<double> spec_alpha_;
    // Liveness and step bounds (spec §4.4). The heartbeat is declared last: its thread, which
    // writes to locked_out_ and reads the engine's work counter, is joined first.
    PieceSizer pieces_;                   ///< prompt tokens per step under --max-step-ms
    std::vector<StepPart> step_parts_;    ///< the running step as the heartbeat reports it
    uint64_t steps_begun_ = 0;
    Heartbeat heartbeat_;
};

}  // namespace trioserve
