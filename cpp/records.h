// records.h — the record codec of the worker protocol (spec/worker-protocol.md): line framing
// with a hard bound, request parsing/validation, and record writing (the per-token record is
// hand-built: it is the hot path).
//
// Pure with respect to the engine: nothing here knows slots, sessions or generations, so the
// validation rules are unit-tested alone (cpp/tests/test_worker_loop.cpp). Every validation
// failure is a RequestError carrying a stable protocol code (spec §8).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine.h"
#include "json_key_guard.h"
#include "json_out.h"

namespace trioserve {

inline constexpr int kProtocolVersion = 2;
inline constexpr size_t kMaxLineBytes = size_t(16) << 20;  // 16 MiB, excluding '\n'
/// The longest record the parent reads (worker protocol §2); a longer one would end the
/// worker as broken, so a reply that would exceed it is answered `result_too_large` instead.
inline constexpr size_t kMaxRecordBytes = size_t(8) << 20;  // 8 MiB, '\n' included

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Line framing with a hard bound (spec §1).

/// Splits a byte stream into '\n'-terminated lines without ever holding more than `max_line`
/// bytes of one line: a longer line is discarded as it streams in and reported once, when its
/// '\n' arrives. Push-style, so the loop can feed whatever a non-blocking read returned.
class LineSplitter {
public:
    enum class Kind { line, too_long };

    explicit LineSplitter(size_t max_line = kMaxLineBytes) : max_(max_line) {}

    /// Feeds `n` bytes. Calls `on_line(Kind, std::string_view line)` (line without '\n') for
    /// every completed line; when it returns false the rest of `data` is dropped and feed()
    /// returns false (the caller stops: shutdown).
    template <typename F>
    bool feed(const char* data, size_t n, F&& on_line) {
        size_t pos = 0;
        while (pos < n) {
            const char* start = data + pos;
            const char* nl = static_cast<const char*>(std::memchr(start, '\n', n - pos));
            const size_t avail = nl ? static_cast<size_t>(nl - start) : n - pos;
            if (!overflow_) {
                if (partial_.size() + avail > max_) {
                    overflow_ = true;
                    partial_.clear();
                    partial_.shrink_to_fit();
                } else if (nl && partial_.empty()) {
                    pos += avail + 1;  // whole line inside this chunk: no copy
                    if (!on_line(Kind::line, std::string_view(start, avail))) return false;
                    continue;
                } else {
                    partial_.append(start, avail);
                }
            }
            pos += avail;
            if (!nl) break;
            ++pos;
            const Kind k = overflow_ ? Kind::too_long : Kind::line;
            overflow_ = false;
            std::string line;
            line.swap(partial_);
            if (!on_line(k, std::string_view(line))) return false;
        }
        return true;
    }

private:
    size_t max_;
    std::string partial_;
    bool overflow_ = false;
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
    bool special = true;  ///< text: parse special tokens (template text); false: user content
    bool checkpoint = false;  ///< keep a state checkpoint where this segment ends (spec §6.3)
    std::string text;
    std::vector<TokenId> ids;
};

struct GenerateRequest {
    uint64_t id = 0;
    std::vector<PromptSegment> segments;  ///< `prompt` becomes one text segment (special: true)
    int64_t max_new_tokens = -1;          ///< -1 = until the context is full
    SamplingParams sampling;
    bool has_seed = false;                ///< false: a random seed is drawn
    std::vector<std::string> stop;
    std::string session_id;               ///< empty = anonymous
    bool long_retention = false;          ///< `retention: "long"` (spill priority, spec §6.1)
    std::string grammar;                  ///< GBNF, root rule `root`; empty = none
    /// `unique_keys`: keep every JSON object of the output free of repeated keys
    /// (json_key_guard.h); absent = off.
    std::optional<JsonKeyOptions> unique_keys;
};

namespace detail {

inline RequestError invalid(const std::string& msg) { return {"invalid_request", msg, json::object()}; }

inline bool is_int(const json& v) { return v.is_number_integer(); }

/// `logit_bias` (spec §4): a list of [id, bias] pairs, each id a distinct integer >= 0 (the
/// vocabulary bound is checked where the engine is known: WorkerLoop::refuse_unsupported_sampling),
/// each bias a number in [-100, 100]. Throws RequestError{invalid_request}.
inline std::vector<std::pair<TokenId, float>> parse_logit_bias(const json& v) {
    const char* shape = "'logit_bias' must be a list of [token id, bias] pairs: distinct integer ids >= 0, "
                        "biases numbers in [-100, 100]";
    if (!v.is_array()) throw invalid(shape);
    std::vector<std::pair<TokenId, float>> out;
    out.reserve(v.size());
    for (const json& pair : v) {
        if (!pair.is_array() || pair.size() != 2 || !pair[0].is_number_integer() || !pair[1].is_number())
            throw invalid(shape);
        const bool negative = !pair[0].is_number_unsigned() && pair[0].get<int64_t>() < 0;
        if (negative || (pair[0].is_number_unsigned() && pair[0].get<uint64_t>() > uint64_t(INT32_MAX)))
            throw invalid(shape);
        const double bias = pair[1].get<double>();
        if (!(bias >= -100.0 && bias <= 100.0)) throw invalid(shape);  // NaN fails too
        out.emplace_back(static_cast<TokenId>(pair[0].get<int64_t>()), static_cast<float>(bias));
    }
    std::vector<TokenId> ids;
    ids.reserve(out.size());
    for (const auto& [id, bias] : out) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    // A repeated id would add twice in llama.cpp's logit-bias sampler: refused, not summed.
    if (std::adjacent_find(ids.begin(), ids.end()) != ids.end()) throw invalid(shape);
    return out;
}

inline double number_field(const json& o, const char* key, double dflt) {
    auto it = o.find(key);
    if (it == o.end() || it->is_null()) return dflt;
    if (!it->is_number()) throw invalid(std::string("'") + key + "' must be a number");
    double d = it->get<double>();
    if (!std::isfinite(d)) throw invalid(std::string("'") + key + "' must be finite");
    return d;
}

inline bool present(const json& o, const char* key) {
    auto it = o.find(key);
    return it != o.end() && !it->is_null();
}

}  // namespace detail

/// Parses a `prompt_segments` list (spec §4). Throws RequestError{invalid_request}.
inline std::vector<PromptSegment> parse_segments(const json& segs) {
    using detail::invalid;
    if (!segs.is_array()) throw invalid("'prompt_segments' must be a list");
    std::vector<PromptSegment> out;
    out.reserve(segs.size());
    for (const json& seg : segs) {
        if (!seg.is_object()) throw invalid("each 'prompt_segments' item must be an object");
        const bool t = seg.contains("text"), i = seg.contains("ids");
        if (t == i) throw invalid("each 'prompt_segments' item needs exactly one of 'text' and 'ids'");
        PromptSegment s;
        if (auto it = seg.find("checkpoint"); it != seg.end() && !it->is_null()) {
            if (!it->is_boolean()) throw invalid("'prompt_segments[].checkpoint' must be a boolean");
            s.checkpoint = it->get<bool>();
        }
        if (t) {
            if (!seg["text"].is_string()) throw invalid("'prompt_segments[].text' must be a string");
            s.text = seg["text"].get<std::string>();
            if (auto it = seg.find("special"); it != seg.end() && !it->is_null()) {
                if (!it->is_boolean()) throw invalid("'prompt_segments[].special' must be a boolean");
                s.special = it->get<bool>();
            }
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
        out.push_back(std::move(s));
    }
    return out;
}

/// The prompt of a generate or tokenize request: exactly one of `prompt`/`text` (named by
/// `text_key`) and `prompt_segments`. Throws RequestError{invalid_request}.
inline std::vector<PromptSegment> parse_prompt(const json& o, const char* text_key) {
    using detail::invalid;
    const bool has_text = detail::present(o, text_key);
    const bool has_segments = detail::present(o, "prompt_segments");
    if (has_text == has_segments)
        throw invalid(std::string("exactly one of '") + text_key + "' and 'prompt_segments' is required");
    if (has_segments) return parse_segments(o["prompt_segments"]);
    const json& p = o[text_key];
    if (!p.is_string()) throw invalid(std::string("'") + text_key + "' must be a string");
    PromptSegment s;
    s.text = p.get<std::string>();
    return {std::move(s)};
}

/// Parses and validates a generate request (spec §4). Throws RequestError{invalid_request}.
/// `id` has already been validated by the caller.
inline GenerateRequest parse_generate(const json& o, uint64_t id) {
    using detail::invalid;
    GenerateRequest r;
    r.id = id;
    r.segments = parse_prompt(o, "prompt");
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
    if (auto it = o.find("logit_bias"); it != o.end() && !it->is_null())
        r.sampling.logit_bias = detail::parse_logit_bias(*it);
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
    if (auto it = o.find("retention"); it != o.end() && !it->is_null()) {
        if (!it->is_string() || (*it != "short" && *it != "long"))
            throw invalid("'retention' must be \"short\", \"long\" or null");
        r.long_retention = *it == "long";
    }
    if (auto it = o.find("grammar"); it != o.end() && !it->is_null()) {
        if (!it->is_string() || it->get_ref<const std::string&>().empty())
            throw invalid("'grammar' must be a non-empty string (GBNF with a 'root' rule) or null");
        r.grammar = it->get<std::string>();
    }
    if (auto it = o.find("unique_keys"); it != o.end() && !it->is_null()) {
        const char* shape = "'unique_keys' must be null or an object with optional non-empty strings "
                            "'reasoning_start' and 'reasoning_end' ('reasoning_start' only with 'reasoning_end')";
        if (!it->is_object()) throw invalid(shape);
        JsonKeyOptions k;
        for (const auto& [name, value] : it->items()) {
            if (name != "reasoning_start" && name != "reasoning_end") throw invalid(shape);
            if (value.is_null()) continue;
            if (!value.is_string() || value.get_ref<const std::string&>().empty()) throw invalid(shape);
            (name == "reasoning_start" ? k.reasoning_start : k.reasoning_end) = value.get<std::string>();
        }
        if (!k.reasoning_start.empty() && k.reasoning_end.empty()) throw invalid(shape);
        r.unique_keys = std::move(k);
    }
    return r;
}

/// Tokenizes prompt segments into `out` (spec §4): text segments with special-token parsing
/// as their `special` flag says, each segment separately; id segments verbatim after a range
/// check. Throws RequestError{invalid_token_id | engine_error}.
/// Tokenizes `segments` into `out`; with `marks`, appends the token position where each
/// segment flagged `checkpoint` ends.
inline void encode_segments(const Engine& engine, const std::vector<PromptSegment>& segments, std::vector<TokenId>& out,
                            std::vector<size_t>* marks = nullptr) {
    const int64_t n_vocab = engine.info().n_vocab;
    for (const PromptSegment& seg : segments) {
        if (seg.is_ids) {
            for (TokenId t : seg.ids) {
                if (t < 0 || t >= n_vocab)
                    throw RequestError{"invalid_token_id",
                                       "token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                                           std::to_string(n_vocab) + ")",
                                       json{{"token_id", t}}};
            }
            out.insert(out.end(), seg.ids.begin(), seg.ids.end());
        } else if (engine.tokenize(seg.text, seg.special, out) != Status::ok) {
            throw RequestError{"engine_error", "tokenization failed", json::object()};
        }
        if (marks != nullptr && seg.checkpoint) marks->push_back(out.size());
    }
}

// ---------------------------------------------------------------------------------------------
// Records.

/// Writes protocol records to a RecordSink, one whole line per write. Reuses one buffer, so
/// the per-token record allocates nothing once the buffer has grown.
class RecordWriter {
public:
    using Clock = std::chrono::steady_clock;

    explicit RecordWriter(RecordSink& out) : out_(out) {}

    RecordSink& sink() { return out_; }

    /// Token coalescing (`--stream-interval-ms`, spec/worker-protocol.md §4.1): token records
    /// are held and written together at most once per `interval`, so the parent wakes once for
    /// several tokens instead of once per token (its wake-up is what costs a busy machine: on
    /// 2 cores it preempts a model thread, and the other waits at the next barrier). A
    /// generation's first token is written at once (time to first token is unchanged), and any
    /// other record first writes what is held (records keep their order). Zero (the default):
    /// every record is written as it is made.
    void set_token_interval(Clock::duration interval) { interval_ = interval; }

    void write_json(const json& j) {
        flush_held();
        buf_ = j.dump(-1, ' ', false, json::error_handler_t::replace);
        buf_.push_back('\n');
        out_.write(buf_);
    }

    /// Writes the held token records if their interval is up (the loop calls it after each
    /// step, so a held token waits at most the interval plus one step).
    void flush_due(Clock::time_point now = Clock::now()) {
        if (!held_.empty() && now - last_flush_ >= interval_) flush_held(now);
    }

    /// Writes the held token records now (before the loop blocks, or with any other record).
    void flush_held(Clock::time_point now = Clock::now()) {
        if (held_.empty()) return;
        out_.write(held_);
        held_.clear();
        last_flush_ = now;
    }

    void write_error(std::optional<uint64_t> id, const RequestError& e) {
        json j{{"type", "error"}, {"id", id ? json(*id) : json(nullptr)}, {"code", e.code}, {"message", e.message}};
        for (auto it = e.extra.begin(); it != e.extra.end(); ++it) j[it.key()] = it.value();
        write_json(j);
    }

    /// The per-token hot path: hand-built, no json object, one reused buffer. `first`: the
    /// generation's first token (never held).
    void write_token(uint64_t id, std::string_view text, bool first = false) {
        const bool hold = interval_ != Clock::duration::zero();
        std::string& to = hold ? held_ : buf_;
        if (!hold) buf_.clear();
        to.append("{\"type\":\"token\",\"id\":");
        append_u64(to, id);
        to.append(",\"text\":");
        append_json_string(to, text);
        to.append("}\n");
        if (!hold) {
            out_.write(buf_);
            return;
        }
        const Clock::time_point now = Clock::now();
        if (first || now - last_flush_ >= interval_) flush_held(now);
    }

private:
    RecordSink& out_;
    std::string buf_;
    std::string held_;  ///< token records not yet written (set_token_interval())
    Clock::duration interval_ = Clock::duration::zero();
    Clock::time_point last_flush_{};
};

}  // namespace trioserve
