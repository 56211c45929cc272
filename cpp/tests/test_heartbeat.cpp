// Unit tests for liveness from progress (spec §4.4): the heartbeat thread's progress records
// (written only while a step runs longer than the interval; work counter moving or standing
// still), the step description, the piece sizer's grid (shrink under a slow step, grow back
// with hysteresis, off = fixed), and both inside the worker loop over the fake engine.
//
// Timing: sleeps here only make a step last AT LEAST some time (lower bounds hold under any
// load); no check depends on an upper bound.
#include "check.h"
#include "records_check.h"
#include "engines/fake/fake_engine.h"
#include "heartbeat.h"
#include "loop_harness.h"
#include "scheduler.h"
#include "loop/worker_loop.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <sstream>
#include <thread>

using namespace trioserve;
using nlohmann::json;
using trioserve_test::LoopHarness;
using trioserve_test::SharedSink;

namespace {

std::vector<json> of_type(const std::vector<json>& recs, const char* type) {
    std::vector<json> out;
    for (const json& r : recs)
        if (r["type"] == type) out.push_back(r);
    return out;
}

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

int main() {
    {   // the step in words, as the log lines name it
        const StepPart parts[] = {{3, 256, true}, {4, 256, true}, {2, 1, false}};
        CHECK_EQ(describe_step(parts, 3),
                 std::string("2 prefill pieces (256+256 tokens: ids 3, 4), 1 decode (id 2); 513 tokens"));
        CHECK_EQ(describe_step(parts + 2, 1), std::string("1 decode (id 2); 1 tokens"));
    }
    {   // piece sizer off: always the configured size, whatever the timing
        PieceSizer p(0, 512, 16);
        CHECK(!p.adaptive());
        p.observe(512, 512, 60000);
        CHECK_EQ(p.limit(), size_t(512));
    }
    {   // a slow step shrinks the limit to the largest grid size that fits the bound, at once
        PieceSizer p(4000, 512, 16);
        CHECK_EQ(p.floor(), size_t(16));
        p.observe(512, 512, 60000);  // ~117 ms a token: 32 tokens take ~3.75 s
        CHECK_EQ(p.limit(), size_t(32));
        p.observe(32, 32, 3750);  // same rate at the new size: stays
        CHECK_EQ(p.limit(), size_t(32));
        // never below the floor, even when one token is over the bound
        p.observe(32, 32, 32 * 5000.0);
        CHECK_EQ(p.limit(), size_t(16));
    }
    {   // grows back one grid step per fast step, with hysteresis (double only when a piece
        // twice as big would take at most half the bound)
        PieceSizer p(4000, 512, 16);
        p.observe(512, 512, 60000);
        CHECK_EQ(p.limit(), size_t(32));
        p.observe(32, 32, 1500);  // 64 tokens would take 3 s > 2 s: stay
        CHECK_EQ(p.limit(), size_t(32));
        p.observe(32, 32, 900);  // 64 would take 1.8 s: grow
        CHECK_EQ(p.limit(), size_t(64));
        for (int i = 0; i < 10; ++i) p.observe(p.limit(), p.limit(), 0.5 * static_cast<double>(p.limit()));
        CHECK_EQ(p.limit(), size_t(512));  // and never above the configured size
    }
    {   // a shrink that does not pay (an oversubscribed CPU: the step's time is in its graph
        // nodes, not its tokens) is undone and the limit stays there until a fast step;
        // numbers from a 2-core host at load 11: 512 tokens 17.7 s, 128 and 64 tokens 9.7 s
        PieceSizer p(5000, 512, 16);
        p.observe(512, 512, 17700);
        CHECK_EQ(p.limit(), size_t(128));
        p.observe(128, 128, 9700);  // paid (saved 45%), still over: the rate says 64
        CHECK_EQ(p.limit(), size_t(64));
        p.observe(64, 64, 9700);  // saved nothing: back to 128, no smaller for now
        CHECK_EQ(p.limit(), size_t(128));
        CHECK_EQ(p.floor(), size_t(128));
        p.observe(128, 128, 9700);
        CHECK_EQ(p.limit(), size_t(128));
        p.observe(128, 128, 2000);  // within the bound: the floor goes; 256 would take 4 s: stay
        CHECK_EQ(p.limit(), size_t(128));
        CHECK_EQ(p.floor(), size_t(16));
        p.observe(128, 128, 1000);
        CHECK_EQ(p.limit(), size_t(256));
    }
    {   // a small step (under half the limit: the end of a prompt, a paced step beside
        // decodes) says nothing about the limit, however slow per token
        PieceSizer p(4000, 512, 16);
        p.observe(100, 104, 30000);
        CHECK_EQ(p.limit(), size_t(512));
    }
    {   // a grid of a size that is not a power of two: full >> k, exact on the way back up
        PieceSizer p(1000, 500, 16);
        p.observe(500, 500, 500 * 100.0);  // 100 ms a token: 7 tokens fit, floor is 31
        CHECK_EQ(p.limit(), size_t(31));
        for (int i = 0; i < 10; ++i) p.observe(p.limit(), p.limit(), 0.1 * static_cast<double>(p.limit()));
        CHECK_EQ(p.limit(), size_t(500));
    }
    {   // heartbeat: a step shorter than the interval writes nothing; a long one writes
        // records with its composition and a moving work counter
        SharedSink sink;
        std::atomic<uint64_t> work{0};
        {
            Heartbeat hb(sink, 20, [&work] { return work.load(); }, 4);
            CHECK(hb.enabled());
            const StepPart parts[] = {{7, 100, true}, {5, 1, false}};
            hb.begin_step(1, parts, 2);
            hb.end_step();
            sleep_ms(60);
            CHECK(of_type(sink.records(), "progress").empty());
            hb.begin_step(2, parts, 2);
            for (int i = 0; i < 10; ++i) {
                sleep_ms(10);
                work += 5;
            }
            hb.end_step();
        }
        const std::vector<json> recs = of_type(sink.records(), "progress");
        CHECK(!recs.empty());
        uint64_t last = 0;
        for (const json& r : recs) {
            CHECK_EQ(r["step"].get<uint64_t>(), uint64_t(2));
            CHECK(r["work"].get<uint64_t>() >= last);
            last = r["work"].get<uint64_t>();
            CHECK(r["elapsed_ms"].get<int64_t>() >= 20);
            CHECK_EQ(r["batch"], json::parse(R"([{"id":7,"kind":"prefill","tokens":100},{"id":5,"kind":"decode","tokens":1}])"));
        }
    }
    {   // a stuck step: records keep coming with the counter standing still and stalled_ms
        // growing (that is what the parent's stall deadline acts on)
        SharedSink sink;
        {
            Heartbeat hb(sink, 10, [] { return uint64_t(42); }, 1);
            const StepPart part{9, 64, true};
            hb.begin_step(1, &part, 1);
            sleep_ms(80);
            hb.end_step();
        }
        const std::vector<json> recs = of_type(sink.records(), "progress");
        CHECK(recs.size() >= 2);
        if (recs.size() >= 2) {
            CHECK_EQ(recs.front()["stalled_ms"].get<int64_t>(), int64_t(0));
            CHECK(recs.back()["stalled_ms"].get<int64_t>() > 0);
            for (const json& r : recs) CHECK_EQ(r["work"].get<uint64_t>(), uint64_t(42));
        }
    }
    {   // disabled (interval 0): no thread, nothing written
        SharedSink sink;
        Heartbeat hb(sink, 0, nullptr, 1);
        CHECK(!hb.enabled());
        const StepPart part{1, 1, false};
        hb.begin_step(1, &part, 1);
        hb.end_step();
        CHECK(sink.records().empty());
    }
    {   // in the worker loop: a 200 ms prefill step reports its progress before its tokens;
        // the ready record says progress records are on
        FakeConfig cfg;
        cfg.script = {"ok"};
        cfg.prefill_ms_per_token = 2;
        FakeEngine engine(cfg);
        CancelController cancel;
        SharedSink sink;
        WorkerOptions opts{512, 512, true};
        opts.heartbeat_ms = 20;
        {
            WorkerLoop loop(engine, cancel, sink, opts);
            CHECK_EQ(loop.ready_record()["capabilities"]["progress"], json(true));
            CHECK_EQ(loop.ready_record()["heartbeat_ms"], json(20.0));
            loop.handle_line(R"({"op":"generate","id":1,"prompt":")" + std::string(100, 'a') + R"("})");
            loop.run_until_idle();
        }
        const std::vector<json> recs = sink.records();
        const std::vector<json> progress = of_type(recs, "progress");
        CHECK(!progress.empty());
        uint64_t last = 0;
        for (const json& r : progress) {
            CHECK_EQ(r["batch"], json::parse(R"([{"id":1,"kind":"prefill","tokens":100}])"));
            CHECK(r["work"].get<uint64_t>() >= last);
            last = r["work"].get<uint64_t>();
        }
        CHECK(last > 0);  // the fake's compute slices count as work
        CHECK_EQ(recs.front()["type"], json("progress"));
        CHECK_EQ(recs.back()["type"], json("done"));
    }
    {   // in the worker loop: --max-step-ms shrinks the pieces of a slow prefill onto the grid
        // 256 >> k, never below the loop's 64-token floor (at >= 1 ms a token under a 100 ms
        // bound), and the output is unchanged; off, every piece is the configured size
        for (const bool adaptive : {false, true}) {
            FakeConfig cfg;
            cfg.prefill_ms_per_token = 1;
            cfg.record_steps = true;
            WorkerOptions opts{256, 256, true};
            opts.max_step_ms = adaptive ? 100 : 0;
            LoopHarness<> h(cfg, opts);
            CHECK_EQ(h.loop.ready_record()["max_step_ms"], json(adaptive ? 100.0 : 0.0));
            const std::string prompt(700, 'p');
            h.loop.handle_line(R"({"op":"generate","id":1,"prompt":")" + prompt + R"(","max_new_tokens":1})");
            h.loop.run_until_idle();
            std::vector<size_t> sizes;
            for (const FakeStepRecord& st : h.engine.step_log())
                for (auto& it : st.items)
                    if (it.prefill) sizes.push_back(it.n);
            CHECK(sizes.size() >= 3);
            if (sizes.empty()) continue;
            CHECK_EQ(sizes.front(), size_t(256));  // nothing measured yet: the configured size
            size_t total = 0;
            for (size_t i = 0; i < sizes.size(); ++i) {
                total += sizes[i];
                if (i == 0 || i + 1 == sizes.size()) continue;  // the last piece is the rest
                if (adaptive) CHECK(sizes[i] >= 64 && sizes[i] < 256 && 256 % sizes[i] == 0);
                else CHECK_EQ(sizes[i], size_t(256));
            }
            CHECK_EQ(total, prompt.size());
            CHECK(h.sink.data.find("\"text\":\"p\"") != std::string::npos);  // echo: the prompt's last byte
        }
    }
    return trioserve_test::finish("test_heartbeat");
}
