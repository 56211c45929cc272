// loop_harness.h — one WorkerLoop over a FakeEngine for the C++ unit tests (no process): the
// engine, the cancel controller, a record sink and the loop, set up the same way in every
// test. Sink: StringSink when only the loop thread writes; SharedSink (records_check.h) when
// the call thread or the heartbeat may write while the test reads.
#pragma once

#include "engines/fake/fake_engine.h"
#include "loop/worker_loop.h"
#include "records_check.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace trioserve_test {

/// A position in a sink's output, and the records written after it.
inline size_t mark_of(const trioserve::StringSink& s) { return s.data.size(); }
inline std::vector<json> records_since(const trioserve::StringSink& s, size_t mark) { return parse(s.data, mark); }
inline size_t mark_of(const SharedSink& s) { return s.records().size(); }
inline std::vector<json> records_since(const SharedSink& s, size_t mark) {
    std::vector<json> all = s.records();
    return std::vector<json>(all.begin() + static_cast<std::ptrdiff_t>(mark), all.end());
}

/// Members are destroyed in reverse: the loop (its threads joined) first, the engine last.
template <class Sink = trioserve::StringSink>
struct LoopHarness {
    explicit LoopHarness(trioserve::FakeConfig cfg = {},
                         trioserve::WorkerOptions opts = trioserve::WorkerOptions{512, 512, true})
        : engine(std::move(cfg)), loop(engine, cancel, sink, std::move(opts)) {}

    /// Every record the sink holds so far.
    std::vector<json> records() const { return records_since(sink, 0); }

    /// Sends `lines`, runs the scheduler until idle; returns the records written meanwhile.
    std::vector<json> send_all(const std::vector<std::string>& lines) {
        const size_t mark = mark_of(sink);
        for (const auto& l : lines) loop.handle_line(l);
        loop.run_until_idle();
        return records_since(sink, mark);
    }
    std::vector<json> send(const std::string& line) { return send_all({line}); }

    trioserve::FakeEngine engine;
    trioserve::CancelController cancel;
    Sink sink;
    trioserve::WorkerLoop loop;
};

}  // namespace trioserve_test
