// check.h — minimal test helpers for the C++ unit tests (plain main(), no framework).
#pragma once

#include <cstdio>
#include <string>

namespace trioserve_test {

inline int g_failures = 0;
inline int g_checks = 0;

#define CHECK(cond)                                                                     \
    do {                                                                                \
        ++trioserve_test::g_checks;                                                     \
        if (!(cond)) {                                                                  \
            ++trioserve_test::g_failures;                                               \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                               \
    } while (0)

#define CHECK_EQ(a, b)                                                                        \
    do {                                                                                      \
        ++trioserve_test::g_checks;                                                           \
        const auto _va = (a);                                                                \
        const auto _vb = (b);                                                                \
        if (!(_va == _vb)) {                                                                  \
            ++trioserve_test::g_failures;                                                     \
            std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s\n", __FILE__, __LINE__, #a, #b); \
        }                                                                                     \
    } while (0)

inline int finish(const char* name) {
    std::fprintf(stderr, "%s: %d checks, %d failures\n", name, g_checks, g_failures);
    return g_failures == 0 ? 0 : 1;
}

}  // namespace trioserve_test
