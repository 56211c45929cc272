// Unit tests for Utf8Assembler: split characters, invalid bytes, flush.
#include "check.h"
#include "utf8_assembler.h"

using trioserve::Utf8Assembler;
using trioserve::is_valid_utf8;

static std::string feed_bytewise(const std::string& s, bool flush = true) {
    Utf8Assembler a;
    std::string out;
    for (char c : s) {
        std::string piece;
        a.push(std::string(1, c), piece);
        CHECK(is_valid_utf8(piece));  // never a partial sequence in any output piece
        out += piece;
    }
    if (flush) a.flush(out);
    return out;
}

int main() {
    const std::string fffd = "\xEF\xBF\xBD";
    // Complete multi-byte characters survive any split.
    for (std::string s : {std::string("h\xC3\xA9llo"), std::string("\xE2\x82\xAC"), std::string("\xF0\x9F\x98\x80!"),
                          std::string("a\xE4\xBD\xA0\xE5\xA5\xBD z")}) {
        CHECK_EQ(feed_bytewise(s), s);
    }
    {   // held back until complete
        Utf8Assembler a;
        std::string out;
        a.push("\xF0\x9F", out);
        CHECK_EQ(out, std::string());
        CHECK_EQ(a.pending_size(), size_t(2));
        a.push("\x98", out);
        CHECK_EQ(out, std::string());
        a.push("\x80x", out);
        CHECK_EQ(out, std::string("\xF0\x9F\x98\x80x"));
    }
    // Invalid bytes become U+FFFD (maximal subpart: one per invalid subsequence).
    CHECK_EQ(feed_bytewise("a\xFF" "b"), "a" + fffd + "b");
    CHECK_EQ(feed_bytewise("\x80"), fffd);
    CHECK_EQ(feed_bytewise("\xC0\xAF"), fffd + fffd);              // overlong lead
    CHECK_EQ(feed_bytewise("\xE0\x80\x80"), fffd + fffd + fffd);   // E0 needs A0..BF
    CHECK_EQ(feed_bytewise("\xED\xA0\x80"), fffd + fffd + fffd);   // surrogate
    CHECK_EQ(feed_bytewise("\xE2\x82" "a"), fffd + "a");            // truncated then ASCII
    CHECK_EQ(feed_bytewise("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // > U+10FFFF
    // Truncated at the end: flushed as one U+FFFD.
    CHECK_EQ(feed_bytewise("ok\xE2\x82"), "ok" + fffd);
    {
        Utf8Assembler a;
        std::string out;
        a.push("x\xE2\x82", out);
        CHECK_EQ(out, std::string("x"));
        a.flush(out);
        CHECK_EQ(out, "x" + fffd);
        CHECK_EQ(a.pending_size(), size_t(0));
    }
    CHECK(is_valid_utf8("plain"));
    CHECK(!is_valid_utf8("\xC3"));
    return trioserve_test::finish("test_utf8_assembler");
}
