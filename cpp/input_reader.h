// input_reader.h — reads request lines from stdin on a thread of its own, so a request that
// will be refused is answered at once, even while the loop thread is inside a long engine
// step (spec §4 "Fast refusals").
//
// Why a thread: an engine step (a 512-token prefill chunk on a 2-core CPU) takes a second or
// more, and the loop thread only reads input between steps. A refusal that depends on the
// request alone — bad fields, a prompt that does not fit the context, a grammar that does not
// parse — needs no slot and no engine state, so it need not wait for the step. The reader
// splits lines, hands each one to `precheck` (the worker loop's request-intrinsic checks,
// which may answer the request itself) and queues it for the loop thread, which still sees
// every line in order (ids, cancel bookkeeping, everything that needs slot state).
//
// Threading: the reader thread calls `precheck` (which must touch only thread-safe state:
// immutable engine info, the tokenizer, its own record writer over a locked sink) and the
// queue; the loop thread calls wait()/take(); any thread may call wake(). Destruction stops and joins the thread (a stop
// pipe wakes its poll). Bounded: while more than kMaxQueuedBytes of lines wait for the loop,
// the reader stops reading (the pipe then applies back-pressure to the parent).
#pragma once

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include "records.h"

namespace trioserve {

/// One unit of input for the loop thread.
struct InputLine {
    enum class Kind { line, too_long, eof };
    Kind kind = Kind::line;
    std::string text;                    ///< the line without '\n' (Kind::line)
    std::shared_ptr<void> prechecked;    ///< what `precheck` left for the loop (may be null)
    std::chrono::steady_clock::time_point t_read;  ///< when the reader split it off
};

class InputReader {
public:
    /// Runs on the reader thread for every complete line, before it is queued; may fill
    /// `line.prechecked`. Must not throw.
    using Precheck = std::function<void(InputLine& line)>;

    static constexpr size_t kMaxQueuedBytes = size_t(64) << 20;

    InputReader(int in_fd, Precheck precheck) : in_fd_(in_fd), precheck_(std::move(precheck)) {
        if (::pipe(stop_) != 0) stop_[0] = stop_[1] = -1;
        thread_ = std::thread([this] { run(); });
    }

    ~InputReader() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_ = true;
        }
        space_.notify_all();
        if (stop_[1] >= 0) {
            const char c = 0;
            ssize_t ignored = ::write(stop_[1], &c, 1);
            (void)ignored;
        }
        if (thread_.joinable()) thread_.join();
        for (int fd : stop_)
            if (fd >= 0) ::close(fd);
    }

    InputReader(const InputReader&) = delete;
    InputReader& operator=(const InputReader&) = delete;

    /// Waits until lines are queued: at most `timeout_ms` (0 = just look, < 0 = forever).
    /// Returns whether any are.
    ///
    /// CONTRACT: a line the parent wrote before the call returns is delivered by it (as when
    /// the loop read stdin itself): bytes still in the pipe, or read but not yet split, are
    /// waited for. So a `shutdown` written before a cancel frame is handled before the step
    /// that the frame's cancel would otherwise end (the watcher thread sees frames at once).
    ///
    /// wake() (any thread) ends a wait early, also one that has not begun yet (the wake is
    /// kept until a wait consumes it): the loop thread blocks here while its only work is on
    /// another thread (a deferred sample, loop/step.h), and that thread's result, or a
    /// cancel, must reach it. A woken wait still waits for bytes in flight (the contract above).
    bool wait(int timeout_ms) {
        std::unique_lock<std::mutex> lock(mu_);
        auto ready = [this] { return !queue_.empty(); };
        auto ready_or_woken = [this] { return !queue_.empty() || woken_; };
        if (timeout_ms < 0) ready_.wait(lock, ready_or_woken);
        else if (timeout_ms > 0) ready_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready_or_woken);
        woken_ = false;
        while (!ready() && !eof_ && (reading_ || input_waiting()))
            ready_.wait_for(lock, std::chrono::milliseconds(1));
        return ready();
    }

    /// Ends the current or the next wait() (thread-safe, non-blocking but for the queue lock).
    void wake() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            woken_ = true;
        }
        ready_.notify_all();
    }

    /// Moves every queued line to `out` (appended, in order).
    void take(std::deque<InputLine>& out) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            while (!queue_.empty()) {
                queued_bytes_ -= queue_.front().text.size();
                out.push_back(std::move(queue_.front()));
                queue_.pop_front();
            }
        }
        space_.notify_all();
    }

private:
    void run() {
        LineSplitter splitter;
        std::vector<char> buf(256 * 1024);
        auto on_line = [this](LineSplitter::Kind k, std::string_view text) {
            InputLine l;
            l.t_read = std::chrono::steady_clock::now();
            if (k == LineSplitter::Kind::too_long) {
                l.kind = InputLine::Kind::too_long;
            } else {
                l.text.assign(text.data(), text.size());
                precheck_(l);
            }
            push(std::move(l));
            return true;
        };
        for (;;) {
            {   // back-pressure: wait for the loop to take lines
                std::unique_lock<std::mutex> lock(mu_);
                space_.wait(lock, [this] { return stopping_ || queued_bytes_ < kMaxQueuedBytes; });
                if (stopping_) return;
            }
            pollfd p[2] = {{in_fd_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
            const int r = ::poll(p, stop_[0] >= 0 ? 2 : 1, -1);
            if (r < 0) {
                if (errno == EINTR) continue;
                break;  // stdin unusable: nobody can talk to us
            }
            if (stop_[0] >= 0 && p[1].revents) return;
            set_reading(true);
            const ssize_t n = ::read(in_fd_, buf.data(), buf.size());
            if (n < 0) {
                if (errno == EINTR || errno == EAGAIN) {
                    set_reading(false);
                    continue;
                }
                break;
            }
            if (n == 0) break;  // CONTRACT: stdin EOF = exit now (spec §1)
            splitter.feed(buf.data(), static_cast<size_t>(n), on_line);
            set_reading(false);
        }
        InputLine eof;
        eof.kind = InputLine::Kind::eof;
        {
            std::lock_guard<std::mutex> lock(mu_);
            eof_ = true;
            reading_ = false;
        }
        push(std::move(eof));
    }

    void set_reading(bool on) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            reading_ = on;
        }
        if (!on) ready_.notify_all();
    }

    /// Whether stdin holds bytes the reader has not read yet (loop thread, under mu_).
    bool input_waiting() const {
        pollfd p{in_fd_, POLLIN, 0};
        return ::poll(&p, 1, 0) > 0 && (p.revents & POLLIN) != 0;
    }

    void push(InputLine&& l) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            queued_bytes_ += l.text.size();
            queue_.push_back(std::move(l));
        }
        ready_.notify_one();
    }

    int in_fd_;
    Precheck precheck_;
    int stop_[2] = {-1, -1};
    std::mutex mu_;
    std::condition_variable ready_;  ///< lines were queued
    std::condition_variable space_;  ///< the loop took lines (or stopping)
    std::deque<InputLine> queue_;
    size_t queued_bytes_ = 0;
    bool stopping_ = false;
    bool reading_ = false;  ///< the reader holds bytes it has read but not yet split and queued
    bool eof_ = false;      ///< the reader saw EOF (or an unusable stdin) and queued the eof line
    bool woken_ = false;    ///< wake() was called since the last wait()
    std::thread thread_;
};

}  // namespace trioserve
