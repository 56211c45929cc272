// json_out.h — the hot-path JSON writer for token records (no allocation beyond the reused
// output buffer) and the record sink abstraction.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace trioserve {

/// Appends `s` as a JSON string literal. `s` must be valid UTF-8 (Utf8Assembler output);
/// only '"', '\\' and control characters need escaping then.
inline void append_json_string(std::string& out, std::string_view s) {
    static const char hex[] = "0123456789abcdef";
    out.push_back('"');
    for (char ch : s) {
        const auto c = static_cast<unsigned char>(ch);
        switch (c) {
            case '"': out.append("\\\""); break;
            case '\\': out.append("\\\\"); break;
            case '\n': out.append("\\n"); break;
            case '\r': out.append("\\r"); break;
            case '\t': out.append("\\t"); break;
            case '\b': out.append("\\b"); break;
            case '\f': out.append("\\f"); break;
            default:
                if (c < 0x20) {
                    out.append("\\u00");
                    out.push_back(hex[c >> 4]);
                    out.push_back(hex[c & 0xF]);
                } else {
                    out.push_back(ch);
                }
        }
    }
    out.push_back('"');
}

inline void append_u64(std::string& out, uint64_t v) {
    char buf[24];
    int n = std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(v));
    out.append(buf, static_cast<size_t>(n));
}

/// Where protocol records go. write() receives one or more complete record lines, each with
/// its '\n' (several: coalesced token records, RecordWriter::set_token_interval()), and must
/// deliver them in one piece (the stdout sink does one write(2) loop per call, so the parent
/// sees the records as soon as they are handed over: "flush once per write").
class RecordSink {
public:
    virtual ~RecordSink() = default;
    virtual void write(std::string_view line) = 0;
};

/// Test sink: collects lines.
class StringSink : public RecordSink {
public:
    void write(std::string_view line) override { data.append(line); }
    std::string data;
};

}  // namespace trioserve
