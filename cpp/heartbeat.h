// heartbeat.h — liveness reported from inside a running step (spec §4.4 "Progress records").
//
// WHY: the loop thread reads input and answers `ping` only between steps, and on a loaded CPU
// one step (a 512-token prefill piece for two prompts) has been seen to take over a minute. A
// parent that judges liveness by pings alone cannot tell such a step from a stuck one and
// kills a worker that was computing. The heartbeat thread looks at the running step from the
// outside: every `interval_ms` while one step has been running that long, it writes a
// `progress` record with the engine's work counter (llama.cpp: graph nodes computed, counted in
// the per-node abort callback; fake: simulated compute slices) and the step's composition.
// The parent counts a record whose step or work differs from the previous one as progress; a
// step whose counter stands still is what the parent's stall deadline is for.
//
// Cost: nothing for steps shorter than the interval (no record, no wake-up: the thread sleeps
// until a step began `interval_ms` ago and is parked while the worker is idle). The loop
// thread pays one uncontended mutex lock at the start and the end of each step and copies
// the step's parts into a buffer reserved to capacity (no allocation).
//
// Threading: begin_step()/end_step() on the loop thread; the work counter must be THREAD-SAFE
// (engine.h: Engine::work_done()); records go to a sink shared with the loop thread (the
// worker's LockedSink keeps each record one write). The destructor stops and joins the thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "json_out.h"

namespace trioserve {

/// One item of a step as the heartbeat reports it.
struct StepPart {
    uint64_t id = 0;       ///< the generation's request id
    uint32_t tokens = 0;   ///< tokens it appends in this step
    bool prefill = false;  ///< a prompt piece (else one decode token)
};

/// "2 prefill pieces (256+256 tokens: ids 3, 4), 1 decode (id 2); 513 tokens" — the step as
/// a log line names it.
inline std::string describe_step(const StepPart* parts, size_t n) {
    std::string pre_tokens, pre_ids, dec_ids;
    size_t n_pre = 0, n_dec = 0, total = 0;
    for (size_t i = 0; i < n; ++i) {
        const StepPart& p = parts[i];
        total += p.tokens;
        std::string& ids = p.prefill ? pre_ids : dec_ids;
        if (!ids.empty()) ids += ", ";
        ids += std::to_string(p.id);
        if (p.prefill) {
            if (!pre_tokens.empty()) pre_tokens += "+";
            pre_tokens += std::to_string(p.tokens);
            ++n_pre;
        } else {
            ++n_dec;
        }
    }
    std::string s;
    if (n_pre > 0)
        s += std::to_string(n_pre) + (n_pre == 1 ? " prefill piece (" : " prefill pieces (") + pre_tokens +
             " tokens: " + (n_pre == 1 ? "id " : "ids ") + pre_ids + ")";
    if (n_dec > 0) {
        if (!s.empty()) s += ", ";
        s += std::to_string(n_dec) + (n_dec == 1 ? " decode (id " : " decodes (ids ") + dec_ids + ")";
    }
    return s + "; " + std::to_string(total) + " tokens";
}

class Heartbeat {
public:
    using Clock = std::chrono::steady_clock;
    /// Thread-safe, monotonic: the engine's work units computed so far (0 when it counts none).
    using WorkCounter = std::function<uint64_t()>;

    /// How long a step may make no progress before the worker logs it on stderr (once per
    /// stall; the parent's stall and health timeouts decide what happens to the worker).
    static constexpr double kLogStallMs = 10000;

    /// `interval_ms` <= 0: disabled (no thread, begin/end_step do nothing). `max_parts`: the
    /// most items one step holds (the slot count), reserved up front.
    Heartbeat(RecordSink& out, double interval_ms, WorkCounter work, size_t max_parts)
        : out_(out), interval_(std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double, std::milli>(interval_ms > 0 ? interval_ms : 0))),
          work_(std::move(work)) {
        if (interval_ms <= 0) return;
        parts_.reserve(max_parts);
        snapshot_.reserve(max_parts);
        thread_ = std::thread([this] { run(); });
    }

    ~Heartbeat() {
        if (!thread_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        cv_.notify_one();
        thread_.join();
    }
    Heartbeat(const Heartbeat&) = delete;
    Heartbeat& operator=(const Heartbeat&) = delete;

    bool enabled() const { return thread_.joinable(); }

    /// Loop thread: step number `step` starts now with `parts[0..n)` (n <= max_parts, else
    /// the rest is not reported). Wakes the thread only when it is parked (the worker was
    /// idle), so steady stepping costs no wake-ups.
    void begin_step(uint64_t step, const StepPart* parts, size_t n) {
        if (!enabled()) return;
        bool wake = false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            parts_.clear();
            for (size_t i = 0; i < n && parts_.size() < parts_.capacity(); ++i) parts_.push_back(parts[i]);
            step_ = step;
            started_ = Clock::now();
            running_ = true;
            wake = parked_;
        }
        if (wake) cv_.notify_one();
    }

    /// Loop thread: the step that began last has ended (committed, aborted or failed).
    void end_step() {
        if (!enabled()) return;
        std::lock_guard<std::mutex> lock(mu_);
        running_ = false;
    }

private:
    void run() {
        std::unique_lock<std::mutex> lock(mu_);
        Clock::time_point last_beat{};
        while (!stop_) {
            if (!running_) {
                parked_ = true;
                cv_.wait(lock, [this] { return stop_ || running_; });
                parked_ = false;
                continue;
            }
            const Clock::time_point due = std::max(started_, last_beat) + interval_;
            const Clock::time_point now = Clock::now();
            if (now < due) {
                cv_.wait_until(lock, due);  // a stop notifies; a new step just moves `due`
                continue;
            }
            last_beat = now;
            snapshot_.assign(parts_.begin(), parts_.end());
            const uint64_t step = step_;
            const Clock::time_point started = started_;
            lock.unlock();
            beat(step, started, now);  // outside the lock: a blocked stdout never blocks the loop here
            lock.lock();
        }
    }

    /// Writes one progress record for `step` (running since `started`) and logs a stall.
    void beat(uint64_t step, Clock::time_point started, Clock::time_point now) {
        const uint64_t work = work_ ? work_() : 0;
        if (step != seen_step_ || work != seen_work_ || !seen_any_) {
            if (logged_stall_ && step == seen_step_)
                std::fprintf(stderr, "trioserve-worker: step %llu progresses again after %.1f s without progress\n",
                             static_cast<unsigned long long>(step), ms_between(last_progress_, now) / 1000.0);
            logged_stall_ = false;
            seen_any_ = true;
            seen_step_ = step;
            seen_work_ = work;
            last_progress_ = now;
        }
        const double elapsed_ms = ms_between(started, now);
        const double stalled_ms = ms_between(last_progress_, now);
        nlohmann::json batch = nlohmann::json::array();
        for (const StepPart& p : snapshot_)
            batch.push_back({{"id", p.id}, {"kind", p.prefill ? "prefill" : "decode"}, {"tokens", p.tokens}});
        const nlohmann::json rec{{"type", "progress"},   {"step", step},
                                 {"work", work},         {"elapsed_ms", static_cast<int64_t>(std::llround(elapsed_ms))},
                                 {"stalled_ms", static_cast<int64_t>(std::llround(stalled_ms))}, {"batch", std::move(batch)}};
        std::string line = rec.dump();
        line.push_back('\n');
        out_.write(line);
        if (!logged_stall_ && stalled_ms >= kLogStallMs) {
            logged_stall_ = true;
            std::fprintf(stderr, "trioserve-worker: step %llu (%s) has made no progress for %.1f s (running %.1f s)\n",
                         static_cast<unsigned long long>(step), describe_step(snapshot_.data(), snapshot_.size()).c_str(),
                         stalled_ms / 1000.0, elapsed_ms / 1000.0);
        }
    }

    static double ms_between(Clock::time_point a, Clock::time_point b) {
        return std::chrono::duration<double, std::milli>(b - a).count();
    }

    RecordSink& out_;
    const Clock::duration interval_;
    WorkCounter work_;
    std::thread thread_;

    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;     ///< guarded by mu_
    bool running_ = false;  ///< guarded by mu_: a step is running
    bool parked_ = false;   ///< guarded by mu_: the thread waits for a step without a deadline
    uint64_t step_ = 0;     ///< guarded by mu_
    Clock::time_point started_{};   ///< guarded by mu_
    std::vector<StepPart> parts_;   ///< guarded by mu_

    // Heartbeat thread only.
    std::vector<StepPart> snapshot_;
    bool seen_any_ = false;
    uint64_t seen_step_ = 0;
    uint64_t seen_work_ = 0;
    Clock::time_point last_progress_{};
    bool logged_stall_ = false;
};

}  // namespace trioserve
