// utf8_assembler.h — turns a stream of token byte pieces into valid UTF-8 text.
//
// Model tokens are byte sequences; a multi-byte character is often split across tokens.
// The protocol (spec/worker-protocol.md §4.1) requires that a token record never ends inside
// a UTF-8 sequence and that invalid bytes become U+FFFD. Utf8Assembler holds back only a
// trailing *incomplete but still possibly valid* sequence (at most 3 bytes) and replaces
// every invalid byte sequence with U+FFFD using the Unicode "maximal subpart" rule (the same
// replacement count as Python's bytes.decode("utf-8", "replace")).
//
// Thread-safety: none; one assembler per generation, used by the decode loop only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace trioserve {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

class Utf8Assembler {
public:
    /// Appends `bytes` and moves every complete character into `out` (appended).
    /// Invalid sequences are appended as U+FFFD. A trailing incomplete sequence is kept.
    void push(std::string_view bytes, std::string& out) {
        pending_.append(bytes.data(), bytes.size());
        size_t consumed = drain(out, /*final=*/false);
        pending_.erase(0, consumed);
    }

    /// Ends the stream: a trailing incomplete sequence becomes U+FFFD (appended to `out`).
    void flush(std::string& out) {
        drain(out, /*final=*/true);
        pending_.clear();
    }

    /// Bytes currently held back (0..3).
    size_t pending_size() const { return pending_.size(); }

    void clear() { pending_.clear(); }

private:
    // Decodes pending_ into `out`; returns the number of bytes consumed. When !final, an
    // incomplete-but-valid tail is left unconsumed.
    size_t drain(std::string& out, bool final) {
        const auto* s = reinterpret_cast<const unsigned char*>(pending_.data());
        const size_t n = pending_.size();
        size_t i = 0;
        size_t run_start = 0;  // start of a run of valid bytes not yet copied to `out`
        while (i < n) {
            const unsigned char c = s[i];
            if (c < 0x80) { ++i; continue; }
            size_t need;          // continuation bytes required
            unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
            if (c >= 0xC2 && c <= 0xDF) { need = 1; }
            else if (c == 0xE0) { need = 2; lo = 0xA0; }
            else if (c >= 0xE1 && c <= 0xEC) { need = 2; }
            else if (c == 0xED) { need = 2; hi = 0x9F; }  // no UTF-16 surrogates
            else if (c >= 0xEE && c <= 0xEF) { need = 2; }
            else if (c == 0xF0) { need = 3; lo = 0x90; }
            else if (c >= 0xF1 && c <= 0xF3) { need = 3; }
            else if (c == 0xF4) { need = 3; hi = 0x8F; }  // <= U+10FFFF
            else {  // 0x80..0xC1 or 0xF5..0xFF: never valid as a lead byte
                out.append(pending_, run_start, i - run_start);
                out.append(kReplacementChar);
                ++i;
                run_start = i;
                continue;
            }
            size_t j = 1;  // bytes of this sequence validated so far (lead included)
            bool invalid = false;
            while (j <= need) {
                if (i + j >= n) break;  // ran out of input
                const unsigned char cc = s[i + j];
                const unsigned char l = (j == 1) ? lo : 0x80;
                const unsigned char h = (j == 1) ? hi : 0xBF;
                if (cc < l || cc > h) { invalid = true; break; }
                ++j;
            }
            if (!invalid && j == need + 1) { i += j; continue; }  // complete character
            if (!invalid && !final) {
                // Incomplete but valid so far: keep it (and only it) for the next push.
                out.append(pending_, run_start, i - run_start);
                return i;
            }
            // Maximal subpart s[i, i+j) is invalid (or truncated at the end): one U+FFFD.
            out.append(pending_, run_start, i - run_start);
            out.append(kReplacementChar);
            i += j;
            run_start = i;
        }
        out.append(pending_, run_start, n - run_start);
        return n;
    }

    std::string pending_;
};

/// Whether `s` is entirely valid UTF-8 (used by tests and assertions).
inline bool is_valid_utf8(std::string_view s) {
    Utf8Assembler a;
    std::string out;
    a.push(s, out);
    return a.pending_size() == 0 && out == s;
}

}  // namespace trioserve
