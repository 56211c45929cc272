// Deferred samples (a grammar's cost cannot block other generations' steps):
// the costly part of a sample (a grammar's mask over the vocabulary) runs on the worker loop's
// sampler thread while the loop steps the other generations. Over the fake engine, whose
// FakeConfig::defer_sample picks which samples are deferred and whose on_finish_sample runs on
// the sampler thread first: there it waits for a latch the test opens, so "the mask takes
// long" is a fact of the test's order of events, not of the clock. Nothing here asserts a
// duration; waits on other threads have a generous deadline only so a broken build fails
// instead of hanging.
//
//   * while one generation's sample is out, another one gets a token in every step (counted
//     per step), and the slow generation's output equals its solo run;
//   * a cancel while the sample is out retires the generation at once (slot freed, done record
//     cancelled); the sampler dies with the job's result, after the job (ASan/TSan: no use
//     after free, no race);
//   * shutdown and destruction with a job out are clean (the join waits for it);
//   * a masked sample that throws fails only its generation;
//   * through run(): a loop whose only generation waits for its sample still answers input,
//     sees a cancel at once, and is woken by the result (no step while it waits).
// Label `threads`: also built and run under ThreadSanitizer (.ci/sanitizers).
#include "check.h"
#include "records_check.h"
#include "engines/fake/fake_engine.h"
#include "loop/worker_loop.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <unistd.h>

using namespace trioserve;
using namespace trioserve_test;
using nlohmann::json;

namespace {

/// A gate the sampler thread waits at (in FakeConfig::on_finish_sample) until the test opens
/// it; `entered` counts the samples that reached it.
struct Latch {
    std::mutex mu;
    std::condition_variable cv;
    bool open = false;
    int entered = 0;

    void pass() {
        std::unique_lock<std::mutex> lock(mu);
        ++entered;
        cv.notify_all();
        // A deadline against a hang of a broken build only (the test opens it long before).
        cv.wait_for(lock, std::chrono::seconds(30), [this] { return open; });
    }
    void release() {
        std::lock_guard<std::mutex> lock(mu);
        open = true;
        cv.notify_all();
    }
    bool wait_entered(int n) {
        std::unique_lock<std::mutex> lock(mu);
        return cv.wait_for(lock, std::chrono::seconds(30), [&] { return entered >= n; });
    }
};

/// Slow script (entry 0) and bystander script (entry 1): the k-th admitted generation plays
/// script[k]. The slow one's sample of output byte `slow_pos` is deferred and waits at `latch`.
FakeConfig slow_config(Latch* latch, size_t slow_pos = 2) {
    FakeConfig cfg;
    cfg.script = {"abcdef", std::string(40, 'x')};
    cfg.record_steps = true;
    cfg.defer_sample = [slow_pos](int64_t script, size_t pos) { return script == 0 && pos == slow_pos; };
    if (latch != nullptr) cfg.on_finish_sample = [latch](int64_t, size_t) { latch->pass(); };
    return cfg;
}

/// Steps until the slow generation's sample is out (at most `limit` steps).
bool step_until_deferred(WorkerLoop& loop, int limit = 50) {
    for (int i = 0; i < limit && loop.awaiting_samples() == 0; ++i) loop.step();
    return loop.awaiting_samples() == 1;
}

/// Admits the slow generation (1) and a bystander (2) and steps until 1's sample is out, held
/// at `latch` by the sampler thread.
void start_slow_beside_bystander(WorkerLoop& loop, Latch& latch) {
    loop.handle_line(gen(1, "slow"));
    loop.handle_line(gen(2, "bystander"));
    CHECK(step_until_deferred(loop));
    CHECK(latch.wait_entered(1));  // the sampler thread holds it now
}

/// Steps until the sampler thread has handed back every result and the loop has collected
/// them (orphans included); the deadline only guards against a hang.
bool drain_samples(WorkerLoop& loop) {
    for (int i = 0; i < 30000 && loop.samples_in_flight() != 0; ++i) {
        loop.step();
        if (loop.samples_in_flight() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return loop.samples_in_flight() == 0;
}

/// A sink the test thread can watch while the loop thread writes.
struct WatchSink : RecordSink {
    std::mutex mu;
    std::condition_variable cv;
    std::string data;
    void write(std::string_view line) override {
        std::lock_guard<std::mutex> lock(mu);
        data.append(line);
        cv.notify_all();
    }
    /// Waits until a record of `type` for `id` was written (deadline: a hang guard only).
    bool wait_for(const std::string& type, uint64_t id) {
        std::unique_lock<std::mutex> lock(mu);
        return cv.wait_for(lock, std::chrono::seconds(30), [&] {
            for (auto& r : parse(data))
                if (r["type"] == type && r["id"] == id) return true;
            return false;
        });
    }
    std::string snapshot() {
        std::lock_guard<std::mutex> lock(mu);
        return data;
    }
};

/// A loop served by run() on its own thread, its input a pipe the test writes.
struct RunRig {
    explicit RunRig(FakeConfig cfg) : engine(std::move(cfg)) {
        if (pipe(in) != 0) std::abort();
        loop = std::make_unique<WorkerLoop>(engine, cancel, sink, WorkerOptions{512, 512, true});
        runner = std::thread([this] { rc = loop->run(in[0]); });
    }
    void put(const std::string& line) {
        const std::string l = line + "\n";
        CHECK_EQ(::write(in[1], l.data(), l.size()), static_cast<ssize_t>(l.size()));
    }
    /// Shutdown, EOF, join; returns run()'s status.
    int finish() {
        put(R"({"op":"shutdown","id":1000})");
        ::close(in[1]);
        runner.join();
        loop.reset();
        ::close(in[0]);
        return rc;
    }
    FakeEngine engine;
    CancelController cancel;
    WatchSink sink;
    int in[2] = {-1, -1};
    int rc = -1;
    std::unique_ptr<WorkerLoop> loop;
    std::thread runner;
};

}  // namespace

int main() {
    std::string solo_text;
    json solo_ids;
    {   // the slow generation alone, nothing deferred: the reference output
        FakeConfig cfg = slow_config(nullptr);
        cfg.defer_sample = nullptr;
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
        loop.handle_line(gen(1, "slow"));
        loop.run_until_idle();
        auto recs = parse(sink.data);
        solo_text = text_of(recs, 1);
        solo_ids = terminal(recs, 1)["generated_token_ids"];
        CHECK_EQ(solo_text, std::string("abcdef"));
    }
    {   // the other generation steps while the slow one's sample is out
        Latch latch;
        FakeEngine engine(slow_config(&latch));
        CancelController cancel;
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
        start_slow_beside_bystander(loop, latch);
        const size_t by_before = tokens_of(parse(sink.data), 2);
        const size_t slow_before = tokens_of(parse(sink.data), 1);
        const size_t steps_before = engine.step_log().size();
        const int32_t slow_slot = 0;  // the first admitted generation takes slot 0
        for (int i = 0; i < 10; ++i) loop.step();
        auto recs = parse(sink.data);
        // One bystander token per step; the slow generation got nothing and was in no step.
        CHECK_EQ(tokens_of(recs, 2), by_before + 10);
        CHECK_EQ(tokens_of(recs, 1), slow_before);
        CHECK_EQ(engine.step_log().size(), steps_before + 10);
        for (size_t k = steps_before; k < engine.step_log().size(); ++k)
            for (const auto& item : engine.step_log()[k].items) CHECK(item.slot != slow_slot);
        CHECK_EQ(loop.awaiting_samples(), size_t(1));  // the latch is still closed
        latch.release();
        loop.run_until_idle();
        recs = parse(sink.data);
        CHECK_EQ(text_of(recs, 1), solo_text);
        CHECK_EQ(terminal(recs, 1)["generated_token_ids"], solo_ids);
        CHECK_EQ(terminal(recs, 1)["finish_reason"], "stop");
        CHECK_EQ(terminal(recs, 1)["deferred_samples"], 1);  // one sample went off the loop thread
        CHECK(!terminal(recs, 2).contains("deferred_samples"));
        CHECK_EQ(text_of(recs, 2), std::string(40, 'x'));
        // Order: the slow generation's deferred byte ('c') comes after the 10 bystander tokens.
        size_t by_seen = 0;
        bool c_after = false;
        for (auto& r : recs) {
            if (r["type"] != "token") continue;
            if (r["id"] == 2) ++by_seen;
            if (r["id"] == 1 && r["text"] == "c") c_after = by_seen >= by_before + 10;
        }
        CHECK(c_after);
        CHECK(drain_samples(loop));
        CHECK(loop.idle_invariants_hold());
    }
    {   // a cancel while the sample is out: retired at once, the sampler dies after the job
        Latch latch;
        FakeEngine engine(slow_config(&latch));
        CancelController cancel;
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
        start_slow_beside_bystander(loop, latch);
        std::thread watcher([&] { cancel.on_frame(1); });  // as the watcher thread would
        watcher.join();
        loop.step();  // one step boundary: the cancel is retired while the job still runs
        auto recs = parse(sink.data);
        json t = terminal(recs, 1);
        CHECK_EQ(t["type"], "done");
        CHECK_EQ(t["cancelled"], true);
        CHECK_EQ(loop.slots().at(0).busy, uint64_t(0));  // its slot is free
        CHECK_EQ(loop.samples_in_flight(), size_t(1));   // the job still holds its sampler
        const size_t slow_tokens = tokens_of(recs, 1);
        latch.release();
        loop.run_until_idle();
        CHECK(drain_samples(loop));  // the orphaned result is dropped on the loop thread
        recs = parse(sink.data);
        CHECK_EQ(tokens_of(recs, 1), slow_tokens);  // nothing after its done record
        CHECK_EQ(text_of(recs, 2), std::string(40, 'x'));
        CHECK(loop.idle_invariants_hold());
        // The freed slot serves again.
        StringSink& s = sink;
        const size_t from = s.data.size();
        loop.handle_line(gen(3, "again"));
        loop.run_until_idle();
        CHECK_EQ(terminal(parse(s.data.substr(from)), 3)["type"], "done");
        CHECK(loop.idle_invariants_hold());
    }
    {   // shutdown with a job out, then the loop destroyed while the job still runs
        Latch latch;
        FakeEngine engine(slow_config(&latch));
        CancelController cancel;
        StringSink sink;
        auto loop = std::make_unique<WorkerLoop>(engine, cancel, sink, WorkerOptions{512, 512, true});
        start_slow_beside_bystander(*loop, latch);
        CHECK(loop->handle_line(R"({"op":"shutdown","id":3})") == WorkerLoop::Flow::stop);
        CHECK(!loop->busy());
        const size_t before = sink.data.size();
        std::thread opener([&] {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));  // (not asserted)
            latch.release();
        });
        loop.reset();  // joins the sampler thread: the running job finishes first
        opener.join();
        CHECK_EQ(sink.data.size(), before);  // nothing written after the shutdown ack
        CHECK_EQ(cancel.active_count(), size_t(0));
        cancel.on_frame(1);  // a late frame touches nothing
    }
    {   // a masked sample that throws fails only its generation
        FakeConfig cfg = slow_config(nullptr);
        cfg.on_finish_sample = [](int64_t, size_t) { throw std::runtime_error("no token matches the grammar"); };
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
        loop.handle_line(gen(1, "slow"));
        loop.handle_line(gen(2, "bystander"));
        loop.run_until_idle();
        auto recs = parse(sink.data);
        json t = terminal(recs, 1);
        CHECK_EQ(t["type"], "error");
        CHECK_EQ(t["code"], "engine_error");
        CHECK(t["message"].get<std::string>().find("no token matches the grammar") != std::string::npos);
        CHECK_EQ(text_of(recs, 2), std::string(40, 'x'));
        CHECK(drain_samples(loop));
        CHECK(loop.idle_invariants_hold());
    }
    {   // through run(): the only generation waits for its sample; the loop still reads input
        // (a ping is answered while the job is held, with no engine step meanwhile) and the
        // result wakes it
        Latch latch;
        RunRig rig(slow_config(&latch));
        rig.put(gen(1, "slow"));
        CHECK(latch.wait_entered(1));  // generation 1 waits for its sample; nothing else runs
        const size_t steps_waiting = rig.engine.step_log().size();
        rig.put(R"({"op":"ping","id":2})");
        CHECK(rig.sink.wait_for("pong", 2));
        CHECK_EQ(rig.engine.step_log().size(), steps_waiting);
        CHECK(terminal(parse(rig.sink.snapshot()), 1).is_null());
        latch.release();
        CHECK(rig.sink.wait_for("done", 1));
        CHECK_EQ(rig.finish(), 0);
        auto recs = parse(rig.sink.snapshot());
        CHECK_EQ(text_of(recs, 1), solo_text);
        CHECK_EQ(terminal(recs, 1)["generated_token_ids"], solo_ids);
    }
    {   // through run(): a cancel while the loop waits for the only generation's sample wakes
        // it; the generation is retired while the job is still held
        Latch latch;
        RunRig rig(slow_config(&latch));
        rig.put(gen(1, "slow"));
        CHECK(latch.wait_entered(1));
        std::thread watcher([&] { rig.cancel.on_frame(1); });
        watcher.join();
        CHECK(rig.sink.wait_for("done", 1));
        auto recs = parse(rig.sink.snapshot());
        CHECK_EQ(terminal(recs, 1)["cancelled"], true);
        latch.release();
        rig.put(gen(2, "next"));  // the worker serves on (script entry 1)
        CHECK(rig.sink.wait_for("done", 2));
        CHECK_EQ(rig.finish(), 0);
        recs = parse(rig.sink.snapshot());
        CHECK_EQ(text_of(recs, 2), std::string(40, 'x'));
    }
    return trioserve_test::finish("test_deferred_sample");
}
