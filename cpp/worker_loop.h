// worker_loop.h — the protocol and decode loop shared by every trioserve worker.
//
// Owns: request parsing/validation, session routing (anonymous + named, warm resume),
// encode, context clamp, chunked prefill, the decode loop (UTF-8 assembly, stop strings,
// EOS handling, stats, finish_reason), cancellation (latch/seal via CancelController) and
// every protocol record. The wire contract is spec/worker-protocol.md; this file implements
// it and must stay exactly true to it.
//
// Threading model: WorkerLoop runs on one thread and handles one request at a time; it reads
// the next line only after the terminal record of the current request. The cancel watcher
// thread touches only the CancelController (and, through its stop hook, Session::request_stop).
//
// stdout rule: records go to a RecordSink, one complete line per write (flushed per record).
// Logs go to stderr. Nothing here throws past handle_line(): every failure becomes an error
// record and the loop keeps serving.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cancel_controller.h"
#include "engine.h"
#include "json_out.h"
#include "prefill_plan.h"
#include "stop_matcher.h"
#include "utf8_assembler.h"

namespace trioserve {

inline constexpr int kProtocolVersion = 1;
inline constexpr size_t kMaxLineBytes = 1u << 20;  // 1 MiB, excluding '\n'

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Line framing with a hard bound (spec §1).

/// Reads '\n'-terminated lines from a byte source without ever buffering more than
/// kMaxLineBytes of one line: a longer line is discarded as it streams in and reported once.
class LineReader {
public:
    /// `read_some(buf, cap)` returns bytes read (> 0), 0 at EOF, < 0 on error (treated as EOF).
    using ReadFn = std::function<long(char*, size_t)>;
    enum class Kind { line, too_long, eof };

    explicit LineReader(ReadFn read_some, size_t max_line = kMaxLineBytes)
        : read_(std::move(read_some)), max_(max_line), buf_(64 * 1024) {}

    /// Next line (without '\n') in `line`. A partial line at EOF is dropped (EOF = exit now).
    Kind next(std::string& line) {
        line.clear();
        bool overflow = false;
        for (;;) {
            while (pos_ < len_) {
                const char* start = buf_.data() + pos_;
                const char* nl = static_cast<const char*>(std::memchr(start, '\n', len_ - pos_));
                const size_t avail = nl ? static_cast<size_t>(nl - start) : len_ - pos_;
                if (!overflow) {
                    if (line.size() + avail > max_) {
                        overflow = true;
                        line.clear();
                        line.shrink_to_fit();
                    } else {
                        line.append(start, avail);
                    }
                }
                pos_ += avail;
                if (nl) {
                    ++pos_;
                    return overflow ? Kind::too_long : Kind::line;
                }
            }
            long n = read_(buf_.data(), buf_.size());
            if (n <= 0) { line.clear(); return Kind::eof; }
            pos_ = 0;
            len_ = static_cast<size_t>(n);
        }
    }

private:
    ReadFn read_;
    size_t max_;
    std::vector<char> buf_;
    size_t pos_ = 0, len_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Requests.

/// A per-request failure with a stable protocol code (spec §8).
struct RequestError {
    std::string code;
    std::string message;
    json extra = json::object();  ///< extra fields merged into the error record
};

struct PromptSegment {
    bool is_ids = false;
    std::string text;
    std::vector<TokenId> ids;
};

struct GenerateRequest {
    uint64_t id = 0;
    std::vector<PromptSegment> segments;  ///< `prompt` becomes one text segment
    int64_t max_new_tokens = -1;          ///< -1 = until the context is full
    SamplingParams sampling;
    bool has_seed = false;                ///< false: a random seed is drawn
    std::vector<std::string> stop;
    std::string session_id;               ///< empty = anonymous session
};

namespace detail {

inline RequestError invalid(const std::string& msg) { return {"invalid_request", msg, json::object()}; }

inline bool is_int(const json& v) { return v.is_number_integer(); }

inline double number_field(const json& o, const char* key, double dflt) {
    auto it = o.find(key);
    if (it == o.end() || it->is_null()) return dflt;
    if (!it->is_number()) throw invalid(std::string("'") + key + "' must be a number");
    double d = it->get<double>();
    if (!std::isfinite(d)) throw invalid(std::string("'") + key + "' must be finite");
    return d;
}

}  // namespace detail

/// Parses and validates a generate request (spec §4). Throws RequestError{invalid_request}.
/// `id` has already been validated by the caller.
inline GenerateRequest parse_generate(const json& o, uint64_t id) {
    using detail::invalid;
    GenerateRequest r;
    r.id = id;
    const bool has_prompt = o.contains("prompt") && !o["prompt"].is_null();
    const bool has_segments = o.contains("prompt_segments") && !o["prompt_segments"].is_null();
    if (has_prompt == has_segments) throw invalid("exactly one of 'prompt' and 'prompt_segments' is required");
    if (has_prompt) {
        const json& p = o["prompt"];
        if (!p.is_string()) throw invalid("'prompt' must be a string");
        PromptSegment s;
        s.text = p.get<std::string>();
        r.segments.push_back(std::move(s));
    } else {
        const json& segs = o["prompt_segments"];
        if (!segs.is_array()) throw invalid("'prompt_segments' must be a list");
        for (const json& seg : segs) {
            if (!seg.is_object()) throw invalid("each 'prompt_segments' item must be an object");
            const bool t = seg.contains("text"), i = seg.contains("ids");
            if (t == i) throw invalid("each 'prompt_segments' item needs exactly one of 'text' and 'ids'");
            PromptSegment s;
            if (t) {
                if (!seg["text"].is_string()) throw invalid("'prompt_segments[].text' must be a string");
                s.text = seg["text"].get<std::string>();
            } else {
                const json& ids = seg["ids"];
                if (!ids.is_array()) throw invalid("'prompt_segments[].ids' must be a list of integers");
                s.is_ids = true;
                s.ids.reserve(ids.size());
                for (const json& v : ids) {
                    if (!detail::is_int(v)) throw invalid("'prompt_segments[].ids' must be a list of integers");
                    // Range is checked against the vocabulary later (invalid_token_id); clamp
                    // out-of-int32 values to -1 so they fail that check.
                    int64_t x = v.is_number_unsigned() ? (v.get<uint64_t>() > INT32_MAX ? -1 : int64_t(v.get<uint64_t>()))
                                                       : v.get<int64_t>();
                    if (x < INT32_MIN || x > INT32_MAX) x = -1;
                    s.ids.push_back(static_cast<TokenId>(x));
                }
            }
            r.segments.push_back(std::move(s));
        }
    }
    if (auto it = o.find("max_new_tokens"); it != o.end() && !it->is_null()) {
        if (!detail::is_int(*it)) throw invalid("'max_new_tokens' must be an integer");
        if (it->is_number_unsigned()) {
            uint64_t u = it->get<uint64_t>();
            r.max_new_tokens = u > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(u);
        } else {
            r.max_new_tokens = it->get<int64_t>();
        }
        if (r.max_new_tokens == 0 || r.max_new_tokens < -1)
            throw invalid("'max_new_tokens' must be -1 or a positive integer");
    }
    const double temp = detail::number_field(o, "temperature", 0.0);
    if (temp < 0) throw invalid("'temperature' must be >= 0");
    const double top_p = detail::number_field(o, "top_p", 1.0);
    if (!(top_p > 0 && top_p <= 1)) throw invalid("'top_p' must be in (0, 1]");
    r.sampling.temperature = static_cast<float>(temp);
    r.sampling.top_p = static_cast<float>(top_p);
    if (auto it = o.find("top_k"); it != o.end() && !it->is_null()) {
        if (!detail::is_int(*it) || (!it->is_number_unsigned() && it->get<int64_t>() < 0) ||
            (it->is_number_unsigned() && it->get<uint64_t>() > uint64_t(INT32_MAX)))
            throw invalid("'top_k' must be an integer in [0, 2^31)");
        r.sampling.top_k = static_cast<int32_t>(it->get<int64_t>());
    }
    if (auto it = o.find("seed"); it != o.end() && !it->is_null()) {
        // 2^32-1 is llama.cpp's "random seed" sentinel, so the deterministic range stops below it.
        if (!it->is_number_unsigned() || it->get<uint64_t>() >= 0xFFFFFFFFull)
            throw invalid("'seed' must be an integer in [0, 4294967295) or null");
        r.sampling.seed = static_cast<uint32_t>(it->get<uint64_t>());
        r.has_seed = true;
    }
    if (auto it = o.find("stop"); it != o.end() && !it->is_null()) {
        if (!it->is_array()) throw invalid("'stop' must be a list of non-empty strings");
        for (const json& s : *it) {
            if (!s.is_string() || s.get_ref<const std::string&>().empty())
                throw invalid("'stop' must be a list of non-empty strings");
            r.stop.push_back(s.get<std::string>());
        }
    }
    if (auto it = o.find("session_id"); it != o.end() && !it->is_null()) {
        if (!it->is_string() || it->get_ref<const std::string&>().empty())
            throw invalid("'session_id' must be a non-empty string");
        r.session_id = it->get<std::string>();
    }
    return r;
}

// ---------------------------------------------------------------------------------------------
// The loop.

struct WorkerOptions {
    size_t prefill_chunk = 512;   ///< tokens per prefill call (bounds cancel latency in prefill)
    bool supports_cancel = false; ///< a valid cancel fd was inherited (spec §7)
};

/// Test/fault-injection hooks (used by the fake worker only).
struct WorkerHooks {
    /// Called when a generate request starts (before validation), e.g. --garbage-line.
    std::function<void(uint64_t id, RecordSink&)> on_generate_start;
};

class WorkerLoop {
public:
    WorkerLoop(Engine& engine, CancelController& cancel, RecordSink& out, WorkerOptions opts = {},
               WorkerHooks hooks = {})
        : engine_(engine), cancel_(cancel), out_(out), opts_(opts), hooks_(std::move(hooks)),
          rng_(std::random_device{}()) {
        if (opts_.prefill_chunk == 0) opts_.prefill_chunk = 1;
    }

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
                    {"capacity", in.capacity},
                    {"n_vocab", in.n_vocab},
                    {"capabilities",
                     {{"supports_cancel", opts_.supports_cancel}, {"supports_truncate", in.supports_truncate}}},
                    {"special_tokens",
                     {{"bos", opt_str(in.bos_text)}, {"eos", opt_str(in.eos_text)},
                      {"bos_id", opt_id(in.bos_id)}, {"eos_id", opt_id(in.eos_id)}}},
                    {"chat_template", opt_str(in.chat_template)}};
    }

    void write_ready() { write_json(ready_record()); }

    /// Runs until EOF or shutdown. Returns the process exit status (0).
    int run(LineReader& reader) {
        std::string line;
        for (;;) {
            LineReader::Kind k = reader.next(line);
            if (k == LineReader::Kind::eof) return 0;
            if (k == LineReader::Kind::too_long) {
                write_error(std::nullopt, {"line_too_long", "input line exceeds 1048576 bytes", json::object()});
                continue;
            }
            if (handle_line(line) == Flow::stop) return 0;
        }
    }

    enum class Flow { next, stop };

    /// Handles one input line (without '\n'). Never throws.
    Flow handle_line(std::string_view line) {
        if (line.find_first_not_of(" \t\r") == std::string_view::npos) return Flow::next;  // blank
        json req = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
        if (req.is_discarded()) {
            write_error(std::nullopt, {"invalid_json", "input line is not valid JSON", json::object()});
            return Flow::next;
        }
        if (!req.is_object()) {
            write_error(std::nullopt, detail::invalid("request must be a JSON object"));
            return Flow::next;
        }
        std::optional<uint64_t> id;
        if (auto it = req.find("id"); it != req.end() && it->is_number_unsigned() && it->get<uint64_t>() >= 1)
            id = it->get<uint64_t>();
        auto op_it = req.find("op");
        if (op_it == req.end() || !op_it->is_string()) {
            write_error(id, detail::invalid("missing or non-string 'op'"));
            return Flow::next;
        }
        const std::string& op = op_it->get_ref<const std::string&>();
        if (!id) {
            write_error(std::nullopt, detail::invalid("'id' must be an integer in [1, 2^64)"));
            return Flow::next;
        }
        try {
            if (op == "generate") {
                if (hooks_.on_generate_start) hooks_.on_generate_start(*id, out_);
                handle_generate(req, *id);
            } else if (op == "tokenize") {
                handle_tokenize(req, *id);
            } else if (op == "ping") {
                write_json(json{{"type", "pong"}, {"id", *id}});
            } else if (op == "session_open" || op == "session_close" || op == "session_reset") {
                handle_session_op(req, *id, op);
            } else if (op == "shutdown") {
                write_json(json{{"type", "ack"}, {"id", *id}, {"op", "shutdown"}});
                return Flow::stop;
            } else {
                write_error(id, detail::invalid("unknown op '" + op + "'"));
            }
        } catch (const RequestError& e) {
            write_error(id, e);
        } catch (const std::exception& e) {
            write_error(id, {"engine_error", std::string("internal error: ") + e.what(), json::object()});
        }
        return Flow::next;
    }

    /// Number of open named sessions (tests).
    size_t named_sessions() const { return named_.size(); }

private:
    struct Slot {
        std::unique_ptr<Session> session;
        std::vector<TokenId> resident;  ///< ids in the session state; invariant: size == position()
        bool dirty = false;             ///< state no longer matches `resident`: reset before reuse
    };

    // -- records ---------------------------------------------------------------------------

    void write_json(const json& j) {
        line_buf_ = j.dump(-1, ' ', false, json::error_handler_t::replace);
        line_buf_.push_back('\n');
        out_.write(line_buf_);
    }

    void write_error(std::optional<uint64_t> id, const RequestError& e) {
        json j{{"type", "error"}, {"id", id ? json(*id) : json(nullptr)}, {"code", e.code}, {"message", e.message}};
        for (auto it = e.extra.begin(); it != e.extra.end(); ++it) j[it.key()] = it.value();
        write_json(j);
    }

    void write_token(uint64_t id, std::string_view text) {
        // Hand-built: this is the per-token hot path (no json object, one reused buffer).
        line_buf_.assign("{\"type\":\"token\",\"id\":");
        append_u64(line_buf_, id);
        line_buf_.append(",\"text\":");
        append_json_string(line_buf_, text);
        line_buf_.append("}\n");
        out_.write(line_buf_);
    }

    // -- sessions --------------------------------------------------------------------------

    static std::string session_id_field(const json& req) {
        auto it = req.find("session_id");
        if (it == req.end() || !it->is_string() || it->get_ref<const std::string&>().empty())
            throw detail::invalid("'session_id' must be a non-empty string");
        return it->get<std::string>();
    }

    Slot& anonymous_slot() {
        if (!anon_.session) {
            anon_.session = engine_.create_session();
            if (!anon_.session) throw RequestError{"engine_error", "could not create the anonymous session", json::object()};
        }
        return anon_;
    }

    /// Finds or opens a named session (spec §6).
    Slot& open_named(const std::string& sid) {
        auto it = named_.find(sid);
        if (it != named_.end()) return it->second;
        const int64_t cap = engine_.info().capacity;
        json extra{{"session_id", sid}, {"capacity", cap}};
        if (cap <= 1) throw RequestError{"unsupported_session", "this worker hosts no named sessions (capacity 1)", extra};
        anonymous_slot();  // the anonymous session always holds its slot
        if (static_cast<int64_t>(named_.size()) >= cap - 1)
            throw RequestError{"capacity_exhausted", "all " + std::to_string(cap - 1) + " named session slots are in use", extra};
        Slot s;
        s.session = engine_.create_session();
        if (!s.session) throw RequestError{"capacity_exhausted", "the engine has no free session slot", extra};
        return named_.emplace(sid, std::move(s)).first->second;
    }

    void handle_session_op(const json& req, uint64_t id, const std::string& op) {
        const std::string sid = session_id_field(req);
        if (op == "session_open") {
            open_named(sid);
        } else if (op == "session_close") {
            named_.erase(sid);  // the Session destructor frees its slot
        } else {  // session_reset
            auto it = named_.find(sid);
            if (it != named_.end()) {
                Slot& s = it->second;
                Status st = s.session->reset();
                if (st != Status::ok) {
                    s.dirty = true;
                    throw RequestError{"engine_error", std::string("session reset failed: ") + status_name(st),
                                       json{{"session_id", sid}}};
                }
                s.resident.clear();
                s.dirty = false;
            }
        }
        write_json(json{{"type", "ack"}, {"id", id}, {"op", op}, {"session_id", sid}});
    }

    void handle_tokenize(const json& req, uint64_t id) {
        auto it = req.find("text");
        if (it == req.end() || !it->is_string()) throw detail::invalid("'text' must be a string");
        std::vector<TokenId> ids;
        if (engine_.tokenize(it->get_ref<const std::string&>(), ids) != Status::ok)
            throw RequestError{"engine_error", "tokenization failed", json::object()};
        write_json(json{{"type", "tokens"}, {"id", id}, {"ids", ids}});
    }

    // -- generate --------------------------------------------------------------------------

    /// Ends the request in the CancelController on every path out of handle_generate.
    struct CancelScope {
        CancelController& c;
        uint64_t id;
        ~CancelScope() { c.end(id); }
    };

    using Clock = std::chrono::steady_clock;
    static double ms_between(Clock::time_point a, Clock::time_point b) {
        return std::chrono::duration<double, std::milli>(b - a).count();
    }

    void handle_generate(const json& req, uint64_t id) {
        cancel_.sync();  // CONTRACT: a cancel written before its generate line is latched (spec §7)
        // CONTRACT: ids of generates strictly increase (spec §2). Checked before anything else
        // so a stale id can never disturb the cancel state of a newer request.
        if (id <= cancel_.last_finished())
            throw detail::invalid("stale or duplicate id " + std::to_string(id) + " (last finished generate: " +
                                  std::to_string(cancel_.last_finished()) + ")");
        cancel_.begin(id);
        CancelScope scope{cancel_, id};
        const auto t_start = Clock::now();

        GenerateRequest r = parse_generate(req, id);
        if (!r.has_seed) r.sampling.seed = static_cast<uint32_t>(rng_() % 0xFFFFFFFFull);
        const bool anonymous = r.session_id.empty();
        Slot& slot = anonymous ? anonymous_slot() : open_named(r.session_id);
        Session& sess = *slot.session;

        // Encode.
        prompt_.clear();
        const int64_t n_vocab = engine_.info().n_vocab;
        for (const PromptSegment& seg : r.segments) {
            if (seg.is_ids) {
                for (TokenId t : seg.ids) {
                    if (t < 0 || t >= n_vocab)
                        throw RequestError{"invalid_token_id",
                                           "token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                               std::to_string(n_vocab) + ")",
                                           json{{"token_id", t}}};
                }
                prompt_.insert(prompt_.end(), seg.ids.begin(), seg.ids.end());
            } else if (engine_.tokenize(seg.text, prompt_) != Status::ok) {
                throw RequestError{"engine_error", "tokenization failed", json::object()};
            }
        }
        if (prompt_.empty()) throw RequestError{"empty_prompt", "the prompt tokenizes to nothing", json::object()};

        // Context clamp.
        const int64_t n_prompt = static_cast<int64_t>(prompt_.size());
        const int64_t n_ctx = engine_.info().n_ctx;
        const int64_t max_new = clamp_max_new(n_prompt, n_ctx, r.max_new_tokens);
        if (max_new < 0)
            throw RequestError{"context_length_exceeded",
                               "prompt has " + std::to_string(n_prompt) + " tokens; the context window is " +
                                   std::to_string(n_ctx) + " (no room to generate)",
                               json{{"prompt_tokens", n_prompt}, {"n_ctx", n_ctx}}};

        // From here on the session may be mutated; it is marked clean again only on success.
        sess.clear_stop();
        cancel_.set_stop_hook([&sess] { sess.request_stop(); });

        Outcome res;
        res.prompt_tokens = n_prompt;
        const auto t_prefill = Clock::now();
        const PrefillPlan plan = plan_prefill(slot.resident, prompt_, slot.dirty, anonymous, engine_.info().supports_truncate);
        res.plan = plan.reason;
        slot.dirty = true;
        if (plan.reset) {
            Status st = sess.reset();
            if (st != Status::ok) fail_engine("session reset failed", st);
            slot.resident.clear();
        } else if (plan.keep < slot.resident.size()) {
            Status st = sess.truncate(static_cast<int64_t>(plan.keep));
            if (st == Status::unsupported) {  // fall back to a full prefill
                st = sess.reset();
                if (st != Status::ok) fail_engine("session reset failed", st);
                slot.resident.clear();
                res.plan = "mismatch";
            } else if (st != Status::ok) {
                fail_engine("session truncate failed", st);
            } else {
                slot.resident.resize(plan.keep);
            }
        }
        res.reused = static_cast<int64_t>(slot.resident.size());

        // Chunked prefill; a cancel is checked between chunks and (engine permitting) inside.
        size_t pos = slot.resident.size();
        while (pos < prompt_.size() && !cancel_.cancelled()) {
            const size_t n = std::min(opts_.prefill_chunk, prompt_.size() - pos);
            Status st = sess.prefill(prompt_.data() + pos, n);
            if (st == Status::aborted) break;  // cancelled mid-prefill: slot stays dirty
            if (st != Status::ok) fail_engine("prefill failed", st);
            slot.resident.insert(slot.resident.end(), prompt_.begin() + pos, prompt_.begin() + pos + n);
            pos += n;
        }
        res.prefilled = static_cast<int64_t>(pos) - res.reused;
        const auto t_decode = Clock::now();
        res.prefill_ms = ms_between(t_prefill, t_decode);

        if (pos == prompt_.size() && !cancel_.cancelled()) {
            Status st = sess.start_generation(r.sampling);
            if (st != Status::ok) fail_engine("sampler setup failed", st);
            decode_loop(r, slot, max_new, res);
        } else {
            cancel_.seal();  // the only way to get here is a cancel
            res.cancelled = true;
        }
        const auto t_end = Clock::now();
        res.decode_ms = pos == prompt_.size() ? ms_between(t_decode, t_end) : 0.0;
        res.total_ms = ms_between(t_start, t_end);

        // CONTRACT: a cancelled generation leaves the session dirty (reset before reuse);
        // otherwise `resident` is exactly the session state (even after a stop-string cut).
        slot.dirty = res.cancelled;
        if (anonymous) slot.dirty = true;  // never warm-resumed; skip the bookkeeping
        write_done(r, res);
    }

    struct Outcome {
        const char* finish = "stop";
        const char* plan = "new";
        bool cancelled = false;
        int stop_index = -1;
        int64_t prompt_tokens = 0, reused = 0, prefilled = 0, completion = 0;
        double prefill_ms = 0, decode_ms = 0, total_ms = 0;
        std::vector<TokenId> generated;
    };

    [[noreturn]] static void fail_engine(const std::string& what, Status st) {
        throw RequestError{"engine_error", what + ": " + status_name(st), json::object()};
    }

    /// The decode loop: sample, stop on EOS, assemble UTF-8, match stops, emit, decode.
    /// Preconditions: prefill done, sampler started. Leaves `slot.resident` exact.
    void decode_loop(const GenerateRequest& r, Slot& slot, int64_t max_new, Outcome& res) {
        Session& sess = *slot.session;
        Utf8Assembler utf8;
        StopMatcher stops(r.stop);
        res.generated.clear();
        res.generated.reserve(static_cast<size_t>(std::min<int64_t>(max_new, 4096)));
        bool hit = false;
        for (int64_t step = 0;; ++step) {
            if (cancel_.cancelled()) { res.cancelled = true; cancel_.seal(); break; }
            TokenId tok = 0;
            Status st = sess.sample(&tok);
            if (st != Status::ok) fail_engine("sampling failed", st);
            if (engine_.is_end_of_generation(tok)) {  // CONTRACT: EOS never emitted nor counted
                res.cancelled = cancel_.seal();
                res.finish = "stop";
                break;
            }
            ++res.completion;
            res.generated.push_back(tok);
            piece_.clear();
            text_.clear();
            emit_.clear();
            engine_.token_bytes(tok, piece_);
            utf8.push(piece_, text_);
            hit = stops.push(text_, emit_);
            const bool last = hit || step + 1 >= max_new;
            if (last) res.cancelled = cancel_.seal();  // the terminal decision (spec §7 "sealed")
            if (!emit_.empty()) write_token(r.id, emit_);
            if (hit) { res.stop_index = stops.hit_index(); res.finish = "stop"; break; }
            if (last) { res.finish = "length"; break; }
            st = sess.decode(tok);
            if (st == Status::aborted) { res.cancelled = true; cancel_.seal(); break; }
            if (st != Status::ok) fail_engine("decode failed", st);
            slot.resident.push_back(tok);
        }
        if (!hit) {  // flush what was held back (EOS, length or cancel)
            text_.clear();
            emit_.clear();
            utf8.flush(text_);
            stops.push(text_, emit_);
            if (stops.hit_index() >= 0) {
                res.stop_index = stops.hit_index();
                hit = true;
            } else {
                stops.flush(emit_);
            }
            if (!emit_.empty()) write_token(r.id, emit_);
        }
        if (res.cancelled) res.finish = "stop";
        if (hit) res.stop_index = stops.hit_index();
        stop_text_ = hit ? stops.stop(static_cast<size_t>(stops.hit_index())) : std::string();
    }

    void write_done(const GenerateRequest& r, const Outcome& res) {
        auto rate = [](int64_t n, double ms) { return ms > 0 ? n * 1000.0 / ms : 0.0; };
        json j{{"type", "done"},
               {"id", r.id},
               {"finish_reason", res.finish},
               {"cancelled", res.cancelled},
               {"stop_string", res.stop_index >= 0 ? json(stop_text_) : json(nullptr)},
               {"prompt_tokens", res.prompt_tokens},
               {"completion_tokens", res.completion},
               {"reused_prompt_tokens", res.reused},
               {"prefilled_prompt_tokens", res.prompt_tokens - res.reused},
               {"prefill_plan", res.plan},
               {"prefill_ms", res.prefill_ms},
               {"decode_ms", res.decode_ms},
               {"total_ms", res.total_ms},
               {"prefill_tok_s", rate(res.prefilled, res.prefill_ms)},
               {"decode_tok_s", rate(res.completion, res.decode_ms)}};
        // CONTRACT: ids only when they match what the client saw and the session state
        // (no stop-string cut, no cancel). Pinned by tests/worker/test_fake_worker.py.
        if (!res.cancelled && res.stop_index < 0) j["generated_token_ids"] = res.generated;
        if (!r.session_id.empty()) j["session_id"] = r.session_id;
        write_json(j);
    }

    Engine& engine_;
    CancelController& cancel_;
    RecordSink& out_;
    WorkerOptions opts_;
    WorkerHooks hooks_;
    std::mt19937_64 rng_;
    Slot anon_;
    std::map<std::string, Slot> named_;
    // Reused buffers: the decode loop allocates nothing per token once these have grown.
    std::vector<TokenId> prompt_;
    std::string line_buf_, piece_, text_, emit_, stop_text_;
};

}  // namespace trioserve
