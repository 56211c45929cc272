// records_check.h — reading a worker loop's output records in the C++ unit tests: the JSONL a
// StringSink collected, and the token text / terminal record of one generation.
#pragma once

#include "check.h"
#include "json_out.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <sstream>
#include <string_view>
#include <string>
#include <vector>

namespace trioserve_test {

using nlohmann::json;

/// The records in `data` (one JSON object a line) from byte `from` on.
inline std::vector<json> parse(const std::string& data, size_t from = 0) {
    std::vector<json> out;
    std::istringstream in(data.substr(from));
    std::string l;
    while (std::getline(in, l)) out.push_back(json::parse(l));
    return out;
}

/// A sink that another thread (the call thread, the heartbeat) may write while the test reads.
class SharedSink : public trioserve::RecordSink {
public:
    void write(std::string_view line) override {
        std::lock_guard<std::mutex> lock(mu_);
        data_.append(line);
    }
    std::vector<json> records() const {
        std::lock_guard<std::mutex> lock(mu_);
        return parse(data_);
    }

private:
    mutable std::mutex mu_;
    std::string data_;
};

/// Generation `id`'s text: its token records' text, in order.
inline std::string text_of(const std::vector<json>& recs, uint64_t id) {
    std::string s;
    for (auto& r : recs)
        if (r["type"] == "token" && r["id"] == id) s += r["text"].get<std::string>();
    return s;
}

/// How many token records generation `id` has.
inline size_t tokens_of(const std::vector<json>& recs, uint64_t id) {
    size_t n = 0;
    for (auto& r : recs) n += r["type"] == "token" && r["id"] == id;
    return n;
}

/// Generation `id`'s done or error record (null when none); CHECKs there is at most one.
inline json terminal(const std::vector<json>& recs, uint64_t id) {
    json t;
    int n = 0;
    for (auto& r : recs)
        if (r["id"] == id && (r["type"] == "done" || r["type"] == "error")) { t = r; ++n; }
    CHECK(n <= 1);
    return t;
}

/// A generate line for `prompt` (plain text, no JSON escapes needed), with `extra` fields
/// (",\"key\":value...") appended.
inline std::string gen(uint64_t id, const std::string& prompt, const std::string& extra = "") {
    return R"({"op":"generate","id":)" + std::to_string(id) + R"(,"prompt":")" + prompt + "\"" + extra + "}";
}

}  // namespace trioserve_test
