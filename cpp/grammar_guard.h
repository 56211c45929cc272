// grammar_guard.h — checks a client's GBNF grammar for inputs that would make llama.cpp's
// grammar parser hang, before the parser sees it (pure; cpp/tests/test_grammar_guard.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace trioserve {

/// Guards a llama.cpp grammar-parser hazard before handing it a client's grammar: a repetition
/// `{m,n}` with n < m makes the parser expand n - m (wrapped around: ~2^64) optional rules, a
/// hang. Scans the GBNF outside string literals, character classes and comments. Returns an
/// error message, or "" when nothing dangerous was found (the parser still validates the rest).
inline std::string grammar_hazard(const std::string& g) {
    size_t i = 0;
    const size_t n = g.size();
    auto skip_space = [&](size_t& k) { while (k < n && (g[k] == ' ' || g[k] == '\t')) ++k; };
    auto digits = [&](size_t& k, uint64_t& v) {
        const size_t start = k;
        v = 0;
        while (k < n && g[k] >= '0' && g[k] <= '9') {
            v = v > 100000000000ull ? v : v * 10 + static_cast<uint64_t>(g[k] - '0');
            ++k;
        }
        return k > start;
    };
    while (i < n) {
        const char c = g[i];
        if (c == '"' || c == '[') {  // literal or class: skip to its unescaped end
            const char end = c == '"' ? '"' : ']';
            for (++i; i < n && g[i] != end; ++i)
                if (g[i] == '\\') ++i;
            ++i;
        } else if (c == '#') {
            while (i < n && g[i] != '\n' && g[i] != '\r') ++i;
        } else if (c == '{') {
            size_t k = i + 1;
            uint64_t lo = 0, hi = 0;
            skip_space(k);
            const bool has_lo = digits(k, lo);
            skip_space(k);
            if (k < n && g[k] == ',') {
                ++k;
                skip_space(k);
                const bool has_hi = digits(k, hi);
                skip_space(k);
                if (has_lo && has_hi && k < n && g[k] == '}' && hi < lo)
                    return "repetition {" + std::to_string(lo) + "," + std::to_string(hi) +
                           "} has its minimum above its maximum";
            }
            i = k;
        } else {
            ++i;
        }
    }
    return "";
}

}  // namespace trioserve
