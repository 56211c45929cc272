// loop/dispatch.h — WorkerLoop's input side: serve() reads stdin between steps through the
// InputReader thread (input_reader.h), which prechecks each line (parse, id, fast refusals) off
// the loop thread; handle_line()/handle_input() then answer or route each line in order
// (ping, shutdown, tokenize/detokenize to the call thread, session ops, generate to
// admission). Also the loop's wake-up for deferred samples and the spare state buffer's refill.
// Implements spec/worker-protocol.md §1 (transport, line limit), §2 (request ids), §5 (other
// operations: routing) and §8 (error records for bad lines).
#pragma once

#include "loop/worker_loop.h"

namespace trioserve {

/// Lines are read and prechecked by an InputReader thread (fast refusals, spec §4); this
/// thread handles them in order between steps.
inline int WorkerLoop::serve(int in_fd) {
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
                if (timeout_ms < 0) out_.flush_held();  // nothing held waits through a block
                if (timeout_ms < 0 && !busy()) refill_spare(reader);
                if (timeout_ms < 0 && !busy()) persist_idle(&reader);
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
        if (busy()) {
            step();
            out_.flush_due();  // coalesced tokens whose interval is up (--stream-interval-ms)
        }
    }
}

/// Blocks until input arrives, a deferred sample's result is ready, or one of the
/// generations waiting for theirs is cancelled (they are marked abortable meanwhile, so
/// the controller's abort hook runs, which wakes the reader). Returns whether lines came.
inline bool WorkerLoop::wait_for_samples(InputReader& reader) {
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
inline void WorkerLoop::wake_loop() {
    std::lock_guard<std::mutex> lock(wake_mu_);
    if (wake_reader_ != nullptr) wake_reader_->wake();
}

/// Idle work before blocking on input: prepares the spare state buffer (state_buffer.h)
/// a piece at a time, stopping as soon as a line is there. Out of memory only skips it.
inline void WorkerLoop::refill_spare(InputReader& reader) {
    if (!spare_.needs_refill()) return;
    try {
        spare_.refill([&reader] { return reader.wait(0); });
    } catch (const std::bad_alloc&) {
    }
}

/// Handles one input line (without '\n'). Never throws.
inline auto WorkerLoop::handle_line(std::string_view line) -> Flow {
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

/// Reader thread (InputReader): the checks of a generate that depend on the request alone
/// (spec §4: fields, unsupported_grammar, tokenization, context clamp, invalid_grammar).
/// A failure is answered here at once, even while the loop thread is inside a step (fast
/// refusals); the loop thread then only notes the id. A passing generate carries its
/// parsed fields and tokens to the loop (tokenized once, off the decode path). Lines that
/// are not generates, do not parse, or whose id is not above every id seen so far (stale:
/// the loop answers that) are left to the loop untouched. Touches only thread-safe state:
/// the immutable engine info, the tokenizer, validate_grammar(), refusals_out_ and
/// precheck_highest_ (this thread's own). Never throws.
inline void WorkerLoop::precheck(InputLine& l) noexcept {
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
            check_intrinsic(req, id, p->prompt, p->marks);
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

/// A grammar or unique keys asked of an engine that cannot apply them (spec §4,
/// `unsupported_grammar`), or a logit bias it cannot apply or with an id outside the
/// vocabulary (`invalid_request`): refused, never ignored.
inline void WorkerLoop::refuse_unsupported_sampling(const GenerateRequest& r, const EngineInfo& info) {
    if (!r.grammar.empty() && !info.supports_grammar)
        throw RequestError{"unsupported_grammar", "this worker cannot constrain sampling with a grammar",
                           json::object()};
    if (r.unique_keys && !info.supports_token_veto)
        throw RequestError{"unsupported_grammar", "this worker cannot keep JSON keys unique (unique_keys)",
                           json::object()};
    if (!r.sampling.logit_bias.empty() && !info.supports_logit_bias)
        throw RequestError{"invalid_request", "the " + info.engine + " engine cannot apply 'logit_bias'",
                           json::object()};
    for (const auto& [id, bias] : r.sampling.logit_bias)
        if (id >= info.n_vocab)
            throw RequestError{"invalid_request",
                               "'logit_bias' token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                   std::to_string(info.n_vocab) + ")",
                               json::object()};
}

/// The request-intrinsic checks of a generate, in spec order; fills `prompt`. Throws
/// RequestError. Thread-safe (see precheck()).
inline void WorkerLoop::check_intrinsic(const json& req, uint64_t id, std::vector<TokenId>& prompt,
                                        std::vector<size_t>& marks) const {
    const GenerateRequest r = parse_generate(req, id);
    const EngineInfo& info = engine_.info();
    refuse_unsupported_sampling(r, info);
    refuse_if_cannot_fit(r, info);
    encode_segments(engine_, r.segments, prompt, &marks);
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
inline int64_t WorkerLoop::check_context(int64_t n_prompt, int64_t max_new_tokens) const {
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
inline void WorkerLoop::note_precheck_id(const std::string& line) {
    json req = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    if (req.is_discarded() || !req.is_object()) return;
    auto it = req.find("id");
    if (it != req.end() && it->is_number_unsigned()) precheck_highest_ = std::max(precheck_highest_, it->get<uint64_t>());
}

/// Loop thread: handles one line from the InputReader, in order.
inline auto WorkerLoop::handle_input(InputLine& l) -> Flow {
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
        handle_generate(p->req, p->id, l.t_read, &p->prompt, &p->marks);
    } catch (const RequestError& e) {
        out_.write_error(p->id, e);
    } catch (const std::exception& e) {
        out_.write_error(p->id, {"engine_error", std::string("internal error: ") + e.what(), json::object()});
    }
    return Flow::next;
}

/// A tokenize or detokenize (worker protocol §5): queued for the call thread
/// (call_worker.h), which answers it while this thread keeps stepping; `capacity_exhausted`
/// (retryable) when CallWorker::kMaxQueued calls already wait. The id is registered for
/// cancel frames (a frame the parent wrote before the line is synced first, as for a
/// generate).
inline void WorkerLoop::submit_call(json req, uint64_t id, CallWorker::Op op) {
    cancel_.sync();
    if (!calls_.submit(id, op, std::move(req)))
        out_.write_error(id, {"capacity_exhausted",
                              std::to_string(CallWorker::kMaxQueued) +
                                  " tokenize/detokenize calls are already waiting",
                              json::object()});
}

}  // namespace trioserve
