// The cancel watcher thread against a running worker loop, as in the worker processes: a real
// cancel pipe read by ProcessWatcher's thread, frames written by another thread at arbitrary
// moments (mid-step, between steps, after shutdown, while the loop is destroyed), the loop
// stepping the fake engine on the main thread. Checks the observable contract (one terminal
// record per generate, cancelled ones marked, idle invariants) and is the focused target of
// the ThreadSanitizer build (ctest label `threads`): any data race between the watcher and the
// loop fails it there.
#include "check.h"
#include "records_check.h"
#include "engines/fake/fake_engine.h"
#include "loop/worker_loop.h"
#include "worker_process.h"

#include <atomic>
#include <chrono>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

using namespace trioserve;
using namespace trioserve_test;
using nlohmann::json;

namespace {

/// A cancel pipe: the watcher reads `r` (non-blocking, as take_cancel_fd makes it).
struct CancelPipe {
    CancelPipe() {
        int fds[2];
        if (pipe(fds) != 0) std::abort();
        r = fds[0];
        w = fds[1];
        fcntl(r, F_SETFL, fcntl(r, F_GETFL) | O_NONBLOCK);
    }
    ~CancelPipe() {
        if (w >= 0) close(w);
    }  // r is closed by the watcher
    /// Writes one frame; after the watcher closed its end the write fails (EPIPE; SIGPIPE is
    /// ignored), as the parent's would after the worker exited.
    void send(uint64_t id) const {
        unsigned char b[8];
        for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(id >> (8 * i));
        (void)!::write(w, b, 8);
    }
    int r = -1, w = -1;
};

std::string gen(uint64_t id, size_t prompt_len) {
    return R"({"op":"generate","id":)" + std::to_string(id) + R"(,"prompt":")" + std::string(prompt_len, 'p') + "\"}";
}

}  // namespace

int main() {
    // The watcher exits the process when stdin hangs up (parent gone): give it a stdin pipe
    // whose write end stays open, so the test cannot end early with status 0 by accident.
    // (ctest also requires the final "0 failures" line: see CMakeLists.txt.)
    int in_pipe[2];
    if (pipe(in_pipe) != 0 || dup2(in_pipe[0], 0) < 0) return 2;
    ::signal(SIGPIPE, SIG_IGN);

    {   // frames from another thread while generations prefill and decode: every generate
        // gets exactly one terminal record; the cancelled ones say so; nothing is left behind
        FakeConfig cfg;
        cfg.script = {std::string(40, 'a')};
        cfg.prefill_ms_per_token = 0.02;  // steps long enough for frames to land mid-step
        cfg.token_delay_ms = 0.2;
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        CancelPipe cp;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{128, 64, true});
        ProcessWatcher watcher(cancel, cp.r);  // after the loop, as in the worker mains
        uint64_t next = 1;
        std::vector<uint64_t> cancelled;
        for (int round = 0; round < 6; ++round) {
            const uint64_t first = next;
            for (int k = 0; k < 4; ++k) loop.handle_line(gen(next++, 100 + 50 * k));
            std::atomic<bool> stop{false};
            std::thread writer([&, first] {
                // Cancel two of the four at staggered moments, plus an id not read yet.
                std::this_thread::sleep_for(std::chrono::microseconds(300 * (round + 1)));
                cp.send(first + 1);
                std::this_thread::sleep_for(std::chrono::microseconds(700));
                cp.send(first + 3);
                cp.send(first + 1000);  // latched, never admitted: harmless
                while (!stop.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
            });
            loop.run_until_idle();
            stop.store(true);
            writer.join();
        }
        auto recs = parse(sink.data);
        for (uint64_t id = 1; id < next; ++id) {
            int terminals = 0;
            std::string text;
            for (auto& r : recs) {
                if (r["id"] != id) continue;
                if (r["type"] == "token") text += r["text"].get<std::string>();
                if (r["type"] == "done") {
                    ++terminals;
                    if (r["cancelled"] == false) CHECK_EQ(text, std::string(40, 'a'));
                }
                if (r["type"] == "error") ++terminals;
            }
            CHECK_EQ(terminals, 1);
        }
        CHECK(loop.idle_invariants_hold());
    }
    {   // cancel after shutdown, frames racing the destruction: generations in flight, a
        // `shutdown`, then frames keep coming while the watcher and the loop are destroyed
        // (the mains' order: watcher first) and after both are gone
        FakeConfig cfg;
        cfg.script = {std::string(500, 'b')};
        cfg.token_delay_ms = 0.1;
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        CancelPipe cp;
        std::atomic<bool> stop{false};
        std::thread writer;
        {
            auto loop = std::make_unique<WorkerLoop>(engine, cancel, sink, WorkerOptions{512, 512, true});
            auto watcher = std::make_unique<ProcessWatcher>(cancel, cp.r);
            loop->handle_line(gen(1, 10));
            loop->handle_line(gen(2, 10));
            for (int i = 0; i < 5; ++i) loop->step();
            writer = std::thread([&] {
                while (!stop.load()) {
                    cp.send(1);
                    cp.send(2);
                    cancel.on_frame(1);  // straight into the controller too, as sync() would
                    std::this_thread::sleep_for(std::chrono::microseconds(50));
                }
            });
            CHECK(loop->handle_line(R"({"op":"shutdown","id":3})") == WorkerLoop::Flow::stop);
            CHECK_EQ(cancel.active_count(), size_t(0));
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
            watcher.reset();
            loop.reset();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        stop.store(true);
        writer.join();
        CHECK_EQ(cancel.active_count(), size_t(0));
        for (auto& r : parse(sink.data)) CHECK(r["type"] == "token" || r["type"] == "ack");
    }
    {   // the reverse order (the loop destroyed while the watcher still delivers frames):
        // still safe, because the controller shares the flags and the loop unregistered them
        FakeConfig cfg;
        cfg.script = {std::string(500, 'c')};
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        CancelPipe cp;
        ProcessWatcher watcher(cancel, cp.r);
        std::atomic<bool> stop{false};
        auto loop = std::make_unique<WorkerLoop>(engine, cancel, sink, WorkerOptions{512, 512, true});
        loop->handle_line(gen(1, 10));
        loop->step();
        std::thread writer([&] {
            while (!stop.load()) {
                cp.send(1);
                std::this_thread::sleep_for(std::chrono::microseconds(50));
            }
        });
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        loop.reset();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        stop.store(true);
        writer.join();
        CHECK_EQ(cancel.active_count(), size_t(0));
    }
    return trioserve_test::finish("test_cancel_watcher");
}
