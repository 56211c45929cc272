// Unit tests for the call thread (call_worker.h) inside WorkerLoop over FakeEngine: a slow
// tokenize never holds the step loop, a cancel frame ends a waiting or running call with a
// `cancelled` error, the queue bound answers `capacity_exhausted`, and shutdown drops what
// waits without records.
#include "check.h"
#include "loop_harness.h"
#include "records_check.h"

#include <sstream>

using namespace trioserve;
using nlohmann::json;
using trioserve_test::LoopHarness;
using trioserve_test::SharedSink;

namespace {

json record_for(const std::vector<json>& recs, uint64_t id) {
    for (const auto& r : recs)
        if (r.contains("id") && r["id"] == id && r["type"] != "token") return r;
    return json();
}

std::string tokenize_line(uint64_t id, size_t bytes) {
    return R"({"op":"tokenize","id":)" + std::to_string(id) + R"(,"text":")" + std::string(bytes, 'x') + R"("})";
}

}  // namespace

int main() {
    {   // A tokenize of 1 s (fake cost) runs beside a generation: the generation takes all its
        // steps and ends while the call is still on the call thread; the call answers after.
        FakeConfig cfg;
        cfg.tokenize_us_per_byte = 100;  // 10,000 bytes: 1 s
        cfg.script = {"abcdefgh"};
        LoopHarness<SharedSink> h(cfg);
        h.loop.handle_line(tokenize_line(1, 10000));
        CHECK_EQ(h.loop.calls_pending(), size_t(1));
        h.loop.handle_line(R"({"op":"generate","id":2,"prompt_segments":[{"ids":[97]}],"max_new_tokens":8})");
        while (h.loop.in_flight() > 0) h.loop.step();
        const auto during = h.loop.calls_pending();
        const auto recs = h.sink.records();
        CHECK_EQ(during, size_t(1));                       // the call was still running...
        CHECK_EQ(record_for(recs, 2)["type"], "done");     // ...when the generation ended
        CHECK(record_for(recs, 1).is_null());
        h.loop.run_until_idle();
        const auto after = record_for(h.sink.records(), 1);
        CHECK_EQ(after["type"], "tokens");
        CHECK_EQ(after["ids"].size(), size_t(10000));
    }
    {   // A cancel frame ends the running call and a waiting one, each with `cancelled`; a
        // frame latched before the line cancels it as well. The thread then serves the next.
        FakeConfig cfg;
        cfg.tokenize_us_per_byte = 1000;  // 100,000 bytes: 100 s unless cancelled
        LoopHarness<SharedSink> h(cfg);
        h.loop.handle_line(tokenize_line(1, 100000));
        h.loop.handle_line(tokenize_line(2, 100000));
        CHECK_EQ(h.cancel.call_count(), size_t(2));
        h.cancel.on_frame(2);
        h.cancel.on_frame(1);
        h.cancel.on_frame(4);  // not read yet: latched
        h.loop.handle_line(R"({"op":"detokenize","id":4,"ids":[104,105]})");
        h.loop.handle_line(R"({"op":"detokenize","id":5,"ids":[104,105]})");
        h.loop.run_until_idle();
        const auto recs = h.sink.records();
        for (uint64_t id : {1, 2, 4}) {
            CHECK_EQ(record_for(recs, id)["type"], "error");
            CHECK_EQ(record_for(recs, id)["code"], "cancelled");
        }
        CHECK_EQ(record_for(recs, 5)["text"], "hi");
        CHECK_EQ(h.cancel.call_count(), size_t(0));
        CHECK_EQ(h.cancel.active_count(), size_t(0));
    }
    {   // The queue bound: beyond one running and kMaxQueued waiting, `capacity_exhausted` at
        // once; the refused id is not registered. Shutdown (destruction) drops the waiting
        // calls without records and stops the running one.
        FakeConfig cfg;
        cfg.tokenize_us_per_byte = 1000;
        CancelController cancel;
        SharedSink sink;
        FakeEngine engine(cfg);
        const size_t n = CallWorker::kMaxQueued + 2;
        {
            WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
            // The first may already be running (then n - 1 fit) or still waiting (n - 2 fit).
            for (size_t i = 1; i <= n; ++i) loop.handle_line(tokenize_line(i, 100000));
            const auto recs = sink.records();
            size_t refused = 0;
            for (const auto& r : recs) refused += r["code"] == "capacity_exhausted";
            CHECK(refused == 1 || refused == 2);
            CHECK_EQ(record_for(recs, n)["code"], "capacity_exhausted");
            CHECK_EQ(cancel.call_count(), n - refused);
        }
        CHECK_EQ(cancel.call_count(), size_t(0));
        size_t answered = 0;
        for (const auto& r : sink.records()) answered += r["code"] != "capacity_exhausted";
        CHECK_EQ(answered, size_t(0));
    }
    {   // Detokenize and errors keep their records on the call thread (ids outside the
        // vocabulary, bad fields), and an empty text is an empty list.
        LoopHarness<SharedSink> h;
        h.loop.handle_line(R"({"op":"detokenize","id":1,"ids":[300]})");
        h.loop.handle_line(R"({"op":"detokenize","id":2,"ids":"x"})");
        h.loop.handle_line(R"({"op":"tokenize","id":3,"prompt_segments":[{"ids":[999]}]})");
        h.loop.handle_line(R"({"op":"tokenize","id":4,"text":""})");
        h.loop.run_until_idle();
        const auto recs = h.sink.records();
        CHECK_EQ(record_for(recs, 1)["code"], "invalid_token_id");
        CHECK_EQ(record_for(recs, 2)["code"], "invalid_request");
        CHECK_EQ(record_for(recs, 3)["code"], "invalid_token_id");
        CHECK_EQ(record_for(recs, 4)["ids"], json::array());
    }
    {   // count_only answers the number alone; a reply longer than the parent reads (the ids of
        // 3 MB of text: ~12 MB of JSON) is refused `result_too_large`, not written.
        LoopHarness<SharedSink> h;
        const std::string big(3000000, 'x');
        h.loop.handle_line(R"({"op":"tokenize","id":1,"count_only":true,"text":")" + big + R"("})");
        h.loop.handle_line(R"({"op":"tokenize","id":2,"text":")" + big + R"("})");
        h.loop.handle_line(R"({"op":"tokenize","id":3,"count_only":1,"text":"a"})");
        h.loop.run_until_idle();
        const auto recs = h.sink.records();
        CHECK_EQ(record_for(recs, 1)["count"], 3000000);
        CHECK(!record_for(recs, 1).contains("ids"));
        CHECK_EQ(record_for(recs, 2)["code"], "result_too_large");
        CHECK_EQ(record_for(recs, 3)["code"], "invalid_request");
    }
    return trioserve_test::finish("test_call_worker");
}
