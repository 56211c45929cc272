// call_worker.h — the tokenize and detokenize ops (worker protocol §5) on a thread of their
// own, so they never hold the step loop or the answer to a ping.
//
// Why a thread: a tokenize of megabytes (a conversation of 110,000 empty messages rendered,
// 4 MB of spaces sent to /tokenize) takes the tokenizer seconds. Answered between steps on the
// loop thread, that time froze every stream and queued the parent's liveness ping behind it,
// so a healthy worker was killed as silent. Here the loop thread only queues the parsed
// line; the call thread tokenizes and writes the reply, while the loop keeps stepping and
// answering pings.
//
// Thread safety: the call thread touches the engine only through Engine::tokenize(),
// tokenize_cancellable() and token_bytes() and reads its immutable info(): all THREAD-SAFE by
// the Engine contract (they read the vocabulary loaded at startup; llama.cpp's tokenizer
// keeps per-call state on the stack, and the reader thread already tokenizes prompts the same
// way while the loop steps). Records go through its own RecordWriter over the loop's
// LockedSink, one whole line per write.
//
// Bounds: one call runs at a time; at most kMaxQueued wait behind it, beyond that submit()
// refuses (the loop answers `capacity_exhausted`, retryable). Each call is bounded by its line
// (16 MiB at most). The parent's admission (trioserve/tokenize_gate.py) keeps far fewer
// outstanding and shares them between clients.
//
// Cancellation: each call is registered with the CancelController (admit_call), so the
// parent's cancel frame for its id (worker protocol §7) sets its flag. A waiting call is then
// answered without being run, a running one stops at its next check (between segments,
// between the tokenizer's special-text pieces, every few thousand ids); both get an error
// record `cancelled`, so the parent's bookkeeping of the id ends. Destruction (stdin EOF,
// shutdown) drops the waiting calls without records (like generations, spec §4.3), stops
// the running one at its next check and joins the thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cancel_controller.h"
#include "engine.h"
#include "records.h"
#include "utf8_assembler.h"

namespace trioserve {

/// Thrown inside a call when its cancel flag was seen; answered as `cancelled`.
struct CallCancelled {};

/// `{"op": "tokenize", "prompt_segments" | "text", "count_only": bool}` → the tokens record:
/// `{"type": "tokens", "id", "ids": [...]}`, or with `count_only` `{"type": "tokens", "id",
/// "count": N}` (a count of millions of tokens needs no list of them). Checks `stop` between
/// segments and inside the tokenizer (Engine::tokenize_cancellable). Throws RequestError
/// (bad fields, ids outside the vocabulary, engine failure) or CallCancelled.
inline json tokenize_reply(const Engine& engine, const json& req, uint64_t id, const std::atomic<bool>& stop) {
    bool count_only = false;
    if (auto it = req.find("count_only"); it != req.end()) {
        if (!it->is_boolean()) throw detail::invalid("'count_only' must be a boolean");
        count_only = it->get<bool>();
    }
    const std::vector<PromptSegment> segments = parse_prompt(req, "text");
    const int64_t n_vocab = engine.info().n_vocab;
    std::vector<TokenId> ids;
    for (const PromptSegment& seg : segments) {
        if (stop.load(std::memory_order_acquire)) throw CallCancelled{};
        if (seg.is_ids) {
            for (TokenId t : seg.ids)
                if (t < 0 || t >= n_vocab)
                    throw RequestError{"invalid_token_id",
                                       "token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                           std::to_string(n_vocab) + ")",
                                       json{{"token_id", t}}};
            ids.insert(ids.end(), seg.ids.begin(), seg.ids.end());
            continue;
        }
        const Status s = engine.tokenize_cancellable(seg.text, seg.special, ids, stop);
        if (s == Status::aborted) throw CallCancelled{};
        if (s != Status::ok) throw RequestError{"engine_error", "tokenization failed", json::object()};
    }
    if (count_only) return json{{"type", "tokens"}, {"id", id}, {"count", ids.size()}};
    return json{{"type", "tokens"}, {"id", id}, {"ids", std::move(ids)}};
}

/// `{"op": "detokenize", "ids": [...], "pieces": bool}` → `{"type": "text", "text": str}`
/// (the ids' bytes concatenated, invalid UTF-8 as U+FFFD) and, with `pieces`, each id's raw
/// bytes as a list of byte values (a piece may be a partial character). Checks `stop` every
/// kStopCheckIds ids. Throws RequestError or CallCancelled.
inline json detokenize_reply(const Engine& engine, const json& req, uint64_t id, const std::atomic<bool>& stop) {
    constexpr size_t kStopCheckIds = 4096;
    auto it = req.find("ids");
    if (it == req.end() || !it->is_array()) throw detail::invalid("'ids' must be a list of integers");
    const bool with_pieces = req.contains("pieces") && req["pieces"].is_boolean() && req["pieces"].get<bool>();
    const int64_t n_vocab = engine.info().n_vocab;
    std::string bytes, piece;
    json pieces = json::array();
    size_t seen = 0;
    for (const json& v : *it) {
        if (++seen % kStopCheckIds == 0 && stop.load(std::memory_order_acquire)) throw CallCancelled{};
        if (!detail::is_int(v)) throw detail::invalid("'ids' must be a list of integers");
        const bool in_range = !v.is_number_unsigned() ? (v.get<int64_t>() >= 0 && v.get<int64_t>() < n_vocab)
                                                      : v.get<uint64_t>() < static_cast<uint64_t>(n_vocab);
        if (!in_range)
            throw RequestError{"invalid_token_id", "token id " + v.dump() + " is outside the vocabulary [0, " +
                               std::to_string(n_vocab) + ")", json{{"token_id", v}}};
        piece.clear();
        engine.token_bytes(static_cast<TokenId>(v.get<int64_t>()), piece);
        bytes += piece;
        if (with_pieces) {
            json b = json::array();
            for (unsigned char c : piece) b.push_back(static_cast<int>(c));
            pieces.push_back(std::move(b));
        }
    }
    std::string text;
    Utf8Assembler utf8;
    utf8.push(bytes, text);
    utf8.flush(text);
    json rec{{"type", "text"}, {"id", id}, {"text", text}};
    if (with_pieces) rec["pieces"] = std::move(pieces);
    return rec;
}

class CallWorker {
public:
    /// Calls that may wait behind the running one; submit() refuses more.
    static constexpr size_t kMaxQueued = 16;

    enum class Op { tokenize, detokenize };

    struct Job {
        uint64_t id = 0;
        Op op = Op::tokenize;
        json req;          ///< the parsed line
        CancelFlag flag;   ///< registered with the controller (admit_call) by submit()
    };

    CallWorker(const Engine& engine, CancelController& cancel, RecordSink& out)
        : engine_(engine), cancel_(cancel), out_(out) {
        thread_ = std::thread([this] { run(); });
    }

    /// Drops the waiting calls (no records; unregistered), stops the running one at its next
    /// check and joins the thread.
    ~CallWorker() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_ = true;
            for (Job& j : queue_) cancel_.finish_call(j.id);
            queue_.clear();
            if (running_) running_->store(true, std::memory_order_release);
        }
        wake_.notify_all();
        idle_.notify_all();
        if (thread_.joinable()) thread_.join();
    }

    CallWorker(const CallWorker&) = delete;
    CallWorker& operator=(const CallWorker&) = delete;

    /// Loop thread: queues call `id` (registering it for cancel frames). Returns false, and
    /// registers nothing, when kMaxQueued calls already wait: the caller answers it. May
    /// throw bad_alloc (then nothing is registered or queued).
    bool submit(uint64_t id, Op op, json req) {
        Job job{id, op, std::move(req), make_cancel_flag()};
        std::unique_lock<std::mutex> lock(mu_);
        if (queue_.size() >= kMaxQueued) {
            lock.unlock();
            cancel_.saw(id);  // frames for it are stale from now on, as for any answered op
            return false;
        }
        cancel_.admit_call(id, job.flag);  // a frame latched before the line sets the flag
        try {
            queue_.push_back(std::move(job));
        } catch (...) {
            cancel_.finish_call(id);
            throw;
        }
        lock.unlock();
        wake_.notify_one();
        return true;
    }

    /// Calls queued or running (tests, diagnostics).
    size_t pending() const {
        std::lock_guard<std::mutex> lock(mu_);
        return queue_.size() + (running_ ? 1 : 0);
    }

    /// Blocks until no call is queued or running: every reply submitted so far is written
    /// (tests; a cancelled or stopped call ends at its next check).
    void wait_idle() {
        std::unique_lock<std::mutex> lock(mu_);
        idle_.wait(lock, [this] { return stopping_ || (queue_.empty() && !running_); });
    }

private:
    void run() {
        for (;;) {
            Job job;
            {
                std::unique_lock<std::mutex> lock(mu_);
                wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
                if (stopping_) return;
                job = std::move(queue_.front());
                queue_.pop_front();
                running_ = job.flag;
            }
            serve(job);
            {
                std::lock_guard<std::mutex> lock(mu_);
                running_.reset();
                if (stopping_) return;
            }
            idle_.notify_all();
        }
    }

    /// Answers one call; never throws.
    void serve(Job& job) {
        try {
            if (job.flag->load(std::memory_order_acquire)) throw CallCancelled{};
            json rec = job.op == Op::tokenize ? tokenize_reply(engine_, job.req, job.id, *job.flag)
                                              : detokenize_reply(engine_, job.req, job.id, *job.flag);
            job.req = json();  // free the request before the reply is serialized
            std::string line = rec.dump(-1, ' ', false, json::error_handler_t::replace);
            line.push_back('\n');
            if (line.size() > kMaxRecordBytes) {
                // The parent would take such a line for a broken worker: refuse the request.
                const auto size = line.size();
                line.clear();
                line.shrink_to_fit();
                throw RequestError{"result_too_large",
                                   "the reply would be " + std::to_string(size) + " bytes; a record holds at most " +
                                       std::to_string(kMaxRecordBytes),
                                   json{{"record_bytes", size}, {"max_record_bytes", kMaxRecordBytes}}};
            }
            if (!stopped()) out_.sink().write(line);
        } catch (const CallCancelled&) {
            if (!stopped())
                out_.write_error(job.id, {"cancelled", "the call was cancelled before it completed", json::object()});
        } catch (const RequestError& e) {
            if (!stopped()) out_.write_error(job.id, e);
        } catch (const std::exception& e) {
            if (!stopped())
                out_.write_error(job.id, {"engine_error", std::string("internal error: ") + e.what(), json::object()});
        }
        cancel_.finish_call(job.id);
    }

    bool stopped() const {
        std::lock_guard<std::mutex> lock(mu_);
        return stopping_;
    }

    const Engine& engine_;
    CancelController& cancel_;
    RecordWriter out_;  ///< this thread's records (over the loop's locked sink)
    mutable std::mutex mu_;
    std::condition_variable wake_;
    std::condition_variable idle_;  ///< wait_idle()
    std::deque<Job> queue_;
    CancelFlag running_;  ///< the running call's flag (the destructor sets it)
    bool stopping_ = false;
    std::thread thread_;
};

}  // namespace trioserve
