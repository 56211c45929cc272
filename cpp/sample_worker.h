// sample_worker.h — the worker loop's sampler thread: runs the costly part of deferred samples
// (Engine::finish_sample: a grammar's mask over the whole vocabulary) off the loop thread, so
// one constrained generation's mask does not hold up the other generations' steps (found by a hostile test:
// a grammar's cost cannot block other generations' steps).
//
// Ownership, the point of this design: a job CARRIES its generation's Sampler (unique_ptr)
// and its result carries it back. While a job is out, nothing on the loop thread can reach
// that sampler, so a cancel, an error or a shutdown may retire the generation at once (done
// record, slot freed) without waiting for the job: the sampler is destroyed when its result
// is dropped, on the loop thread, or by the destructor after the join. No sampler is ever
// used by two threads, and none can be freed under the thread.
//
// One thread, started at the first job (a worker that never defers a sample has none) and
// joined by the destructor, which lets the running job finish (a mask is bounded: the enum
// and alternative limits of the control plane, spec/README.md §5.6) and drops the queued ones.
// Bounded: at most `max_jobs` jobs (queued, running or finished and not taken) at once; the
// loop has at most one per generation in flight, i.e. capacity.
//
// Threading: submit/take/pending/wait_for_result are for the loop thread; the thread runs
// only Engine::finish_sample (THREAD-SAFE by the engine contract) on the job's own sampler.
// `on_result` is called on the sampler thread after each result is queued (outside the lock):
// it wakes the loop (loop/step.h).
#pragma once

#include <cassert>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine.h"

namespace trioserve {

class SampleWorker {
public:
    /// A deferred sample of generation `id`; `sampler` travels with it.
    struct Job {
        uint64_t id = 0;
        std::unique_ptr<Sampler> sampler;
    };

    /// What finish_sample() gave; `sampler` comes back (advanced, as after sample()).
    struct Result {
        uint64_t id = 0;
        std::unique_ptr<Sampler> sampler;
        Status status = Status::engine_error;
        TokenId token = 0;
        std::string error;  ///< what finish_sample() threw, if it did
        double ms = 0;      ///< how long finish_sample() took
    };

    SampleWorker(const Engine& engine, size_t max_jobs, std::function<void()> on_result)
        : engine_(engine), max_jobs_(max_jobs < 1 ? 1 : max_jobs), on_result_(std::move(on_result)) {
        queue_.reserve(max_jobs_);
        done_.reserve(max_jobs_);
    }

    /// Lets the running job finish, drops the queued ones, joins the thread. The samplers of
    /// dropped jobs and untaken results are destroyed here, after the join.
    ~SampleWorker() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_ = true;
        }
        work_.notify_all();
        if (thread_.joinable()) thread_.join();
    }

    SampleWorker(const SampleWorker&) = delete;
    SampleWorker& operator=(const SampleWorker&) = delete;

    /// Queues `job` (moved from only on success). Starts the thread at the first job. Throws
    /// (std::system_error: no thread; bad_alloc) leaving `job` intact, so the caller can run
    /// the sample itself. Never blocks on a running job.
    void submit(Job& job) {
        std::unique_lock<std::mutex> lock(mu_);
        assert(pending_ < max_jobs_ && "at most one deferred sample per generation in flight");
        if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
        queue_.push_back(std::move(job));  // reserved to max_jobs_: no allocation
        ++pending_;
        lock.unlock();
        work_.notify_one();
    }

    /// Appends every finished result to `out` (loop thread). Returns how many.
    size_t take(std::vector<Result>& out) {
        std::lock_guard<std::mutex> lock(mu_);
        const size_t n = done_.size();
        for (Result& r : done_) out.push_back(std::move(r));
        done_.clear();
        pending_ -= n;
        return n;
    }

    /// Jobs submitted and not yet taken back (queued, running, or finished).
    size_t pending() const {
        std::lock_guard<std::mutex> lock(mu_);
        return pending_;
    }

    /// Whether a finished result waits to be taken.
    bool has_result() const {
        std::lock_guard<std::mutex> lock(mu_);
        return !done_.empty();
    }

    /// Blocks until a result waits to be taken, or returns at once when no job is pending.
    /// For callers that have nothing else to do (WorkerLoop::run_until_idle; run() waits on
    /// its input reader instead, which a result also wakes).
    void wait_for_result() {
        std::unique_lock<std::mutex> lock(mu_);
        result_.wait(lock, [this] { return !done_.empty() || pending_ == 0; });
    }

private:
    void run() {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (stopping_) return;
            Job job = std::move(queue_.front());
            queue_.erase(queue_.begin());
            lock.unlock();
            Result r;
            r.id = job.id;
            const auto t0 = std::chrono::steady_clock::now();
            try {
                r.status = engine_.finish_sample(*job.sampler, &r.token);
            } catch (const std::exception& e) {  // e.g. llama.cpp: a grammar with no allowed token
                r.status = Status::engine_error;
                try {
                    r.error = e.what();
                } catch (const std::bad_alloc&) {
                }
            }
            r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
            r.sampler = std::move(job.sampler);
            lock.lock();
            done_.push_back(std::move(r));  // reserved to max_jobs_: no allocation
            result_.notify_all();
            lock.unlock();
            if (on_result_) on_result_();
            lock.lock();
        }
    }

    const Engine& engine_;
    const size_t max_jobs_;
    std::function<void()> on_result_;
    mutable std::mutex mu_;
    std::condition_variable work_;    ///< a job was queued (or stopping)
    std::condition_variable result_;  ///< a result was queued
    std::vector<Job> queue_;          ///< FIFO; at most max_jobs_
    std::vector<Result> done_;        ///< finished, not yet taken
    size_t pending_ = 0;              ///< queued + running + done
    bool stopping_ = false;
    std::thread thread_;
};

}  // namespace trioserve
