// Unit tests for StopMatcher: stops straddling pieces, hold-back minimality, earliest wins.
#include "check.h"
#include "stop_matcher.h"

#include <vector>

using trioserve::StopMatcher;

struct Run {
    std::string emitted;
    std::vector<std::string> pieces_out;
    bool hit = false;
};

static Run run(std::vector<std::string> stops, std::vector<std::string> pieces, bool flush = true) {
    StopMatcher m(std::move(stops));
    Run r;
    for (auto& p : pieces) {
        std::string e;
        r.hit = m.push(p, e);
        r.pieces_out.push_back(e);
        r.emitted += e;
        if (r.hit) break;
    }
    if (!r.hit && flush) m.flush(r.emitted);
    return r;
}

int main() {
    {   // no stops: passthrough
        Run r = run({}, {"ab", "cd"});
        CHECK_EQ(r.emitted, std::string("abcd"));
        CHECK(!r.hit);
    }
    {   // stop straddling three pieces, never emitted
        Run r = run({"STOP"}, {"hello S", "T", "OP world"});
        CHECK(r.hit);
        CHECK_EQ(r.emitted, std::string("hello "));
        CHECK_EQ(r.pieces_out[0], std::string("hello "));  // "S" held back
        CHECK_EQ(r.pieces_out[1], std::string());
    }
    {   // a false start is released as soon as it cannot be a stop
        Run r = run({"STOP"}, {"ST", "x"});
        CHECK(!r.hit);
        CHECK_EQ(r.pieces_out[0], std::string());
        CHECK_EQ(r.pieces_out[1], std::string("STx"));
    }
    {   // hold back only the longest suffix that is a proper prefix of a stop
        StopMatcher m({"abc"});
        std::string e;
        m.push("xxab", e);
        CHECK_EQ(e, std::string("xx"));
        CHECK_EQ(m.held_size(), size_t(2));
    }
    {   // earliest occurrence wins across stops
        Run r = run({"world", "lo w"}, {"hello world"});
        CHECK(r.hit);
        CHECK_EQ(r.emitted, std::string("hel"));
    }
    {   // same start: the longer stop wins
        StopMatcher m({"ab", "abc"});
        std::string e;
        CHECK(m.push("xabcd", e));
        CHECK_EQ(e, std::string("x"));
        CHECK_EQ(m.stop(static_cast<size_t>(m.hit_index())), std::string("abc"));
    }
    {   // held text flushed at end when no stop came
        Run r = run({"\n\n"}, {"a\n"});
        CHECK(!r.hit);
        CHECK_EQ(r.pieces_out[0], std::string("a"));
        CHECK_EQ(r.emitted, std::string("a\n"));
    }
    {   // multi-byte stop split across pieces
        Run r = run({"\xC3\xA9t\xC3\xA9"}, {"l'\xC3\xA9", "t", "\xC3\xA9 ici"});
        CHECK(r.hit);
        CHECK_EQ(r.emitted, std::string("l'"));
    }
    {   // stop at the very start
        Run r = run({"<|im_end|>"}, {"<|im_", "end|>tail"});
        CHECK(r.hit);
        CHECK_EQ(r.emitted, std::string());
    }
    return trioserve_test::finish("test_stop_matcher");
}
