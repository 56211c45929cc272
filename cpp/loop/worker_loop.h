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
//   this file          the loop's options, state and public surface (ready record, run,
//                      idle invariants); the class declaration every part below defines
//                      member functions of
//   loop/dispatch.h         stdin between steps, prechecks, one line → one handler (§1, §2, §5)
//   loop/step.h             one continuous-batching step, commits, terminal paths (§4.1-§4.5, §7)
//   loop/speculation_glue.h drafts planned into the step and verified after it (§4.6)
//   loop/admission.h        two-phase admission of a generate (§4, §4.3, §6)
//   loop/prefix_sharing.h   shared prefixes: waits, slot/spill copies, checkpoints (§6.2, §6.3)
//   loop/session_ops.h      session ops, eviction spill and restore (§5, §6, §6.1)
// Include this file; it includes the parts at its end. This file itself implements
// spec/worker-protocol.md §3 (the ready record) and §4.3's end of service (stdin EOF or
// `shutdown`: generations in flight end without terminal records).
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
#include <set>
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
#include "state_store.h"
#include "utf8_assembler.h"

namespace trioserve {

struct WorkerOptions {
    size_t batch_tokens = 512;    ///< per-step token budget (decodes + prefill chunks)
    size_t prefill_chunk = 512;   ///< largest prefill chunk of one generation in one step
    bool supports_cancel = false; ///< a valid cancel fd was inherited (spec §7)
    uint64_t spill_budget_bytes = uint64_t(1) << 30;  ///< host bytes for evicted sessions (spec §6.1)
    double step_target_ms = 0;    ///< pace steps that carry decodes to about this long; 0 = off (StepPacer)
    /// Fewest prompt tokens of a step at which the engine's kernels run at their full rate per
    /// token; a paced step carries that many when they fit in 1.2 times the target (StepPacer).
    /// 0 = no such size (the llama worker on the CPU: 65, llama_worker_main.cpp).
    size_t efficient_prefill = 0;
    json ready_extra = json::object();  ///< engine-specific ready-record fields (llama: kernel_path)
    /// Start a prompt from another slot's or a spilled session's state when it holds at least
    /// this many more prompt tokens than the generation's own slot (spec §6.2); 0 = off.
    size_t min_shared_prefix = 16;
    /// Checkpoints kept per slot for engines with a small sliding-window cache or a recurrent
    /// state (spec §6.3, `--checkpoints` / `--swa-checkpoints`); 0 = none. Ignored by engines
    /// without checkpoints.
    size_t checkpoints_per_slot = 4;
    /// Progress records (spec §4.4, heartbeat.h): while one step has been running this long,
    /// one every `heartbeat_ms`; 0 = none (a parent asks for them with --heartbeat-ms).
    double heartbeat_ms = 0;
    /// Token records of the loop are coalesced into one write at most every this many ms
    /// (RecordWriter::set_token_interval(), `--stream-interval-ms`); 0 = one write per record.
    double stream_interval_ms = 0;
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
    /// Measure the start-up step costs also when speculation is off (benchmarks: the
    /// ready record's step_cost_ms then says what a verify step would cost here).
    bool measure_step_cost = false;
    /// The persistent state store (state_store.h, spec §6.4): its directory (empty: off) and
    /// byte bound. Off also with the prefill grid and for engines without a state fingerprint.
    std::string state_dir{};
    uint64_t state_dir_bytes = uint64_t(8) << 30;
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
          pacer_(opts.step_target_ms, kMinPacedPrefill, std::max<size_t>(opts.batch_tokens, 1), opts.efficient_prefill),
          samples_(engine, slots_.capacity(), [this] { wake_loop(); }),
          global_drafts_(opts.speculative == SpeculativeMode::off ? 0 : opts.global_draft_tokens),
          pieces_(opts.max_step_ms, std::max<size_t>(opts.batch_tokens, 1), kMinAdaptedPiece),
          heartbeat_(locked_out_, opts.heartbeat_ms, [&engine] { return engine.work_done(); }, slots_.capacity()),
          store_(opts.state_dir, opts.state_dir_bytes, opts.prefill_grid > 1 ? std::string() : engine.state_fingerprint(),
                 engine.info().trims_any_state),
          persist_pending_(slots_.capacity(), 0) {
        if (opts_.batch_tokens == 0) opts_.batch_tokens = 1;
        if (opts_.prefill_chunk == 0) opts_.prefill_chunk = 1;
        active_.reserve(slots_.capacity());  // commit_admission's push_back never allocates
        step_parts_.reserve(slots_.capacity());
        waiters_.reserve(slots_.capacity());
        results_.reserve(slots_.capacity());
        out_.set_token_interval(std::chrono::duration_cast<RecordWriter::Clock::duration>(
            std::chrono::duration<double, std::milli>(std::max(0.0, opts_.stream_interval_ms))));
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

    // defined below the class
    json ready_record() const;
    void write_ready();
    int run(int in_fd);
    void abandon_in_flight() noexcept;
    bool idle_invariants_hold() const;

private:
    // defined in loop/dispatch.h
    int serve(int in_fd);
    bool wait_for_samples(InputReader& reader);
    void wake_loop();

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

    void refill_spare(InputReader& reader);
    // defined in loop/session_ops.h
    void persist_idle(InputReader* reader) noexcept;

public:
    enum class Flow { next, stop };

    // defined in loop/dispatch.h
    Flow handle_line(std::string_view line);

    /// What precheck() leaves on a generate line for the loop thread.
    struct Prechecked {
        json req;                     ///< the parsed line
        uint64_t id = 0;
        bool refused = false;         ///< the reader answered it with an error record
        std::vector<TokenId> prompt;  ///< its tokens (not refused)
        std::vector<size_t> marks;    ///< its checkpoint marks (encode_segments)
        /// A tokenize/detokenize call with a valid id, parsed by the reader (the loop only
        /// queues it for the call thread: a line of megabytes costs it no parse).
        std::optional<CallWorker::Op> call;
    };

    void precheck(InputLine& l) noexcept;
    void check_intrinsic(const json& req, uint64_t id, std::vector<TokenId>& prompt, std::vector<size_t>& marks) const;
    static void refuse_unsupported_sampling(const GenerateRequest& r, const EngineInfo& info);
    int64_t check_context(int64_t n_prompt, int64_t max_new_tokens) const;
    void note_precheck_id(const std::string& line);
    Flow handle_input(InputLine& l);

    /// Whether any generation is in flight.
    bool busy() const { return !active_.empty(); }
    // defined in loop/step.h
    bool steppable() const;
    size_t awaiting_samples() const;
    /// Deferred samples handed to the sampler thread and not yet collected (also those of
    /// generations that ended meanwhile).
    size_t samples_in_flight() const { return samples_.pending(); }
    size_t in_flight() const { return active_.size(); }
    const SlotTable& slots() const { return slots_; }
    const SpillStore& spill() const { return spill_; }

    void step();
    void run_until_idle();

    /// Tokenize/detokenize calls queued or running on the call thread (tests).
    size_t calls_pending() const { return calls_.pending(); }

private:
    /// Most stdin bytes taken between two steps while generations run.
    static constexpr size_t kMaxInputPerTurn = size_t(4) << 20;
    // defined in loop/step.h
    int gather_ms() const;
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

    Outcome run_planned_step();
    Outcome run_batch(const size_t* idx, size_t n, Clock::time_point t_start, bool whole_step);
    Status call_engine(const size_t* idx, size_t n);
    void observe_pace(Clock::time_point t_start, Clock::time_point t_end);
    void observe_step_cost(Clock::time_point t_start, Clock::time_point t_end);
    void commit(const size_t* idx, size_t n, Clock::time_point t_end);
    bool hand_over(Generation& g) noexcept;
    void collect_samples();
    bool roll_back(Generation& g);

    // -- speculative decoding (speculation.h, spec/worker-protocol.md §4.6) ------------------

    // defined in loop/speculation_glue.h
    bool speculating() const;
    std::string speculation_off_reason() const;
    void check_speculation_exact();
    size_t plan_drafts(size_t n_decode);
    size_t shape_probe(size_t size) const;
    void log_drafts(size_t n_decode, int64_t depth, bool probe) const;
    void verify_draft(Generation& g, const PlannedItem& p);
    void remember_output(Generation& g) noexcept;

public:
    // defined in loop/speculation_glue.h
    void calibrate_speculation();
    json speculation_ready() const;

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
        std::vector<SlotCheckpoint> restored_checkpoints;  ///< that copy's checkpoints, for the slot
        std::vector<TokenId> resident;     ///< the slot's resident ids once prepared
        PendingPrefix wait;                ///< source_id != 0: wait for that prefill (spec §6.2)
    };

    // defined in loop/admission.h
    void handle_generate(const json& req, uint64_t id, Clock::time_point t_read,
                         std::vector<TokenId>* pretokenized = nullptr, std::vector<size_t>* premarks = nullptr);
    Admission plan_admission(const json& req, uint64_t id, Clock::time_point t_read,
                             std::vector<TokenId>* pretokenized, std::vector<size_t>* premarks);
    std::vector<size_t> checkpoint_marks(std::vector<size_t> marks, size_t n_prompt) const;
    void commit_admission(Admission& a) noexcept;

    // defined in loop/session_ops.h
    SpillStore::Prepared save_victim(const Slot& slot);

    // defined in loop/prefix_sharing.h
    bool waiting(uint64_t id) const;
    Generation* find_active(uint64_t id);
    PendingPrefix pending_prefix(const std::vector<TokenId>& prompt, int32_t own, size_t have) const;
    void resolve_waiters();
    void copy_waited(Generation& g, int32_t src_slot);

    /// What share_prefix() did to an engine slot.
    struct SharedCopy {
        bool attempted = false;  ///< the engine slot's state was replaced (or reset by a failed copy)
        bool ok = false;         ///< it now holds exactly `resident` (else position 0, or dirty)
        bool dirty = false;      ///< a failed copy could not even reset the slot: state unknown
        bool from_slot = false;  ///< the source was a slot (else a spilled session or a stored state)
        bool from_disk = false;  ///< the source was the persistent state store (spec §6.4)
        bool from_checkpoint = false;  ///< the source was another slot's checkpoint (spec §6.3)
        std::vector<TokenId> resident;  ///< the ids the engine slot now holds (ok) — before trimming
        double ms = 0;           ///< time the copy took
    };

    SharedCopy share_prefix(int32_t si, const std::vector<TokenId>& prompt, size_t own_keep);
    SharedCopy share_checkpoint(int32_t si, const std::vector<TokenId>& prompt, size_t own_keep);

    // -- checkpoints (spec §6.3) -------------------------------------------------------------

    size_t reachable_keep(int32_t si, const std::vector<TokenId>& base, const std::vector<TokenId>& prompt,
                          const PrefillPlan& plan) const;
    void take_checkpoint(const Slot& slot) noexcept;
    void copy_waited_checkpoint(Generation& g);
    void store_prefix_state(const Slot& slot);
    size_t restore_checkpoint(int32_t si, const std::vector<TokenId>& prompt, size_t keep, double& ms,
                              const std::vector<SlotCheckpoint>* restored = nullptr);
    Status copy_slot_state(int32_t src, int32_t dst);

    // defined in loop/session_ops.h
    void evict_session(Slot& slot);
    size_t restore_session(Slot& slot, const std::string& sid, double& ms);
    void reset_engine_slot(int32_t si);
    json capacity_extra(const std::string& sid) const;
    Slot* named_slot_for(const std::string& sid);

    // -- other ops -------------------------------------------------------------------------

    static std::string session_id_field(const json& req);
    void handle_session_op(const json& req, uint64_t id, const std::string& op);

    // defined in loop/admission.h
    static void refuse_if_cannot_fit(const GenerateRequest& r, const EngineInfo& info);

    // defined in loop/dispatch.h
    void submit_call(json req, uint64_t id, CallWorker::Op op);

    // -- terminal paths --------------------------------------------------------------------

    // defined in loop/step.h
    bool retire_cancelled();
    void end(Generation& g);
    void fail(Generation& g, const std::string& what);

    /// The prefill grid (spec §4.5), 0 when off.
    size_t grid() const { return opts_.prefill_grid > 1 ? opts_.prefill_grid : 0; }

    size_t exact_tokens(int32_t si) const;
    void keep_whole_pieces(Slot& slot, size_t prompt_tokens) noexcept;
    void compact();

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
    CheckpointStore checkpoints_;  ///< per-slot checkpoints (small sliding-window caches, recurrent states)
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
    StepCostModel start_cost_;        ///< calibrate_speculation(): the ready record's points
    /// Why drafting is off although asked for: the start-up self-check found verification not
    /// bit-identical to plain decoding (check_speculation_exact()). Empty: no such finding.
    std::string spec_inexact_;
    StepCostTable step_cost_;         ///< the steps that ran, by shape (step_cost.h)
    size_t step_streams_ = 0;         ///< this step's shape (plan_drafts()); 0: not drafting
    int64_t step_depth_ = 0;
    size_t prefill_depth_ = 0;        ///< this step's deepest prompt position to prefill from (StepPacer)
    std::vector<size_t> spec_idx_, spec_avail_, spec_k_;
    std::vector<double> spec_alpha_;
    // Liveness and step bounds (spec §4.4). The heartbeat is declared last: its thread, which
    // writes to locked_out_ and reads the engine's work counter, is joined first.
    PieceSizer pieces_;                   ///< prompt tokens per step under --max-step-ms
    std::vector<StepPart> step_parts_;    ///< the running step as the heartbeat reports it
    uint64_t steps_begun_ = 0;
    Heartbeat heartbeat_;
    /// The persistent state store (spec §6.4); its writer thread touches only the store.
    StateStore store_;
    /// Per slot: its clean state changed since it was last offered to the store (set when a
    /// generation ends, cleared when persist_idle() offers it).
    std::vector<char> persist_pending_;
    /// Spilled states already offered to the store (their store keys): offered once, so a
    /// directory that refuses writes does not cost a copy of every spilled state per idle
    /// moment. Cleared when it reaches kMaxOfferedSpills (then each is offered once more).
    std::set<std::string> spill_offered_;
    static constexpr size_t kMaxOfferedSpills = 4096;
};

/// The ready record (spec §3).
inline json WorkerLoop::ready_record() const {
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
                {"recurrent_state_bytes", in.recurrent_state_bytes},
                {"attention_matrix_bytes", in.attention_matrix_bytes},
                {"kv_cache_type", in.kv_cache_type.empty() ? json(nullptr) : json(in.kv_cache_type)},
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
                  {"logit_bias", in.supports_logit_bias},
                  {"eviction", true},
                  {"prefix_sharing", opts_.min_shared_prefix > 0},
                  {"progress", heartbeat_.enabled()}}},
                {"spill_budget_bytes", opts_.spill_budget_bytes},
                {"min_shared_prefix", opts_.min_shared_prefix},
                {"n_swa", in.n_swa},
                {"swa_cache", in.swa_cache.empty() ? json(nullptr) : json(in.swa_cache)},
                {"checkpoints_per_slot", checkpoints_.per_slot()},
                {"checkpoint_kind", checkpoints_.per_slot() > 0 && !in.checkpoint_kind.empty()
                                        ? json(in.checkpoint_kind) : json(nullptr)},
                {"heartbeat_ms", opts_.heartbeat_ms > 0 ? opts_.heartbeat_ms : 0.0},
                {"stream_interval_ms", std::max(0.0, opts_.stream_interval_ms)},
                {"step_target_ms", std::max(0.0, opts_.step_target_ms)},
                {"efficient_prefill", opts_.step_target_ms > 0 ? opts_.efficient_prefill : 0},
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

inline void WorkerLoop::write_ready() {
    json r = ready_record();
    r["speculative"] = speculation_ready();
    r["state_store"] = store_.ready();
    for (const auto& [key, value] : opts_.ready_extra.items()) r[key] = value;
    out_.write_json(r);
}

/// Runs the event loop on `in_fd` (stdin) until EOF or shutdown. Returns the exit status
/// (0). Generations still in flight then end without terminal records (spec §4.3) and are
/// unregistered from the cancel controller.
inline int WorkerLoop::run(int in_fd) {
    const int rc = serve(in_fd);
    abandon_in_flight();
    persist_idle(nullptr);  // drain: every clean state not yet offered; ~StateStore writes them
    return rc;
}

/// Ends every generation in flight without a terminal record (stdin EOF or `shutdown`,
/// spec §4.3): unregisters its cancel flag, frees its slot (dirty: its work is cut short).
inline void WorkerLoop::abandon_in_flight() noexcept {
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
inline bool WorkerLoop::idle_invariants_hold() const {
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

}  // namespace trioserve

// The member functions of WorkerLoop, by responsibility (each part includes this file).
#include "loop/dispatch.h"
#include "loop/step.h"
#include "loop/speculation_glue.h"
#include "loop/admission.h"
#include "loop/prefix_sharing.h"
#include "loop/session_ops.h"
