// worker_process.h — process plumbing shared by the worker mains: the stdout record sink,
// the stdin reader, the cancel-fd / parent-liveness watcher thread, and signal setup.
//
// Liveness rules (spec §1, §7, §9): stdin EOF = exit now (0); cancel-fd EOF = parent gone,
// exit (0); Linux PR_SET_PDEATHSIG(SIGKILL). The worker loop itself reads stdin between steps
// and sees EOF there; the watcher thread also notices it (POLLHUP on the stdin pipe) while the
// loop thread is inside a long engine step, so "exit now" holds mid-step too; it exits with
// _exit(0), which is safe from any thread (no destructors run, nothing of value is buffered:
// records are written whole).
#pragma once

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "cancel_controller.h"
#include "json_out.h"

namespace trioserve {

inline constexpr const char* kCancelFdEnv = "TRIOSERVE_CANCEL_FD";

/// Set by fault injection (--hang-after-tokens): the watcher then ignores stdin/cancel EOF so
/// only a signal ends the process, like a worker stuck inside a kernel.
inline std::atomic<bool> g_simulated_hang{false};

/// Milliseconds the watcher thread gives the loop, once stdin or the cancel pipe closed, to
/// see the same end itself and exit the orderly way before the watcher's _exit(0): a worker
/// with a persistent state store drains its writes on that path (spec/worker-protocol.md
/// §6.4). 0 (the default): exit at once. A loop inside a long step does not see the end in
/// time, and the watcher exits when the grace is up, as before.
inline std::atomic<int> g_exit_grace_ms{0};

/// Writes each record with write(2) on fd 1, retrying short writes. If the parent stopped
/// reading (EPIPE) the worker has no one to serve: exit 0.
class FdSink : public RecordSink {
public:
    explicit FdSink(int fd = 1) : fd_(fd) {}
    void write(std::string_view line) override {
        const char* p = line.data();
        size_t left = line.size();
        while (left > 0) {
            ssize_t n = ::write(fd_, p, left);
            if (n < 0) {
                if (errno == EINTR) continue;
                // A simulated hang (fake --hang-after-tokens / --stuck-token) must not end
                // here either: the heartbeat thread still writes while the loop is "stuck",
                // and only a signal may end such a worker (spec §11).
                while (g_simulated_hang.load()) pause();
                std::fprintf(stderr, "trioserve-worker: stdout write failed (%s); exiting\n", std::strerror(errno));
                _exit(0);
            }
            p += n;
            left -= static_cast<size_t>(n);
        }
    }

private:
    int fd_;
};

/// Common signal/parent setup: ignore SIGPIPE (write errors are handled), die with the parent.
inline void setup_process(bool ignore_sigterm = false) {
    ::signal(SIGPIPE, SIG_IGN);
    if (ignore_sigterm) ::signal(SIGTERM, SIG_IGN);
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1) {
        // The parent may already be gone (reparented to init) before prctl took effect.
        const char* keep = std::getenv("TRIOSERVE_ALLOW_ORPHAN");
        if (!keep) std::fprintf(stderr, "trioserve-worker: warning: parent is pid 1\n");
    }
#endif
}

/// Validates the inherited cancel fd named by TRIOSERVE_CANCEL_FD (spec §7). Returns the fd
/// (non-blocking, close-on-exec) or -1. The variable is unset so grandchildren never see it.
inline int take_cancel_fd(bool enabled) {
    const char* v = std::getenv(kCancelFdEnv);
    if (!v) return -1;
    std::string s(v);
    unsetenv(kCancelFdEnv);
    if (!enabled) return -1;
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) {
        std::fprintf(stderr, "trioserve-worker: ignoring %s=%s (not a decimal fd)\n", kCancelFdEnv, s.c_str());
        return -1;
    }
    int fd = std::atoi(s.c_str());
    struct stat st;
    if (fd <= 2 || fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode)) {
        std::fprintf(stderr, "trioserve-worker: %s=%d is not an inherited pipe; cancel disabled\n", kCancelFdEnv, fd);
        return -1;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || (fl & O_ACCMODE) == O_WRONLY || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0 ||
        fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
        std::fprintf(stderr, "trioserve-worker: %s=%d is not readable; cancel disabled\n", kCancelFdEnv, fd);
        close(fd);
        return -1;
    }
    return fd;
}

/// A small thread that blocks in poll() on the cancel fd (frames → CancelController, which may
/// abort the running engine step) and on stdin (POLLHUP → exit now). It never touches engine state except through the controller's
/// stop hook. Lives for the whole process; the destructor wakes and joins it.
class ProcessWatcher {
public:
    ProcessWatcher(CancelController& cancel, int cancel_fd) : cancel_(cancel), cancel_fd_(cancel_fd) {
        if (pipe(wake_) != 0) { wake_[0] = wake_[1] = -1; }
        cancel_.set_frame_source([this] { drain(); });
        thread_ = std::thread([this] { run(); });
    }
    ~ProcessWatcher() {
        stop_.store(true);
        if (wake_[1] >= 0) { char c = 0; (void)!::write(wake_[1], &c, 1); }
        if (thread_.joinable()) thread_.join();
        cancel_.set_frame_source(nullptr);
        for (int fd : wake_) if (fd >= 0) close(fd);
        if (cancel_fd_ >= 0) close(cancel_fd_);
    }
    ProcessWatcher(const ProcessWatcher&) = delete;
    ProcessWatcher& operator=(const ProcessWatcher&) = delete;

private:
    void run() {
        bool watch_stdin = true;
        for (;;) {
            if (stop_.load()) return;
            pollfd fds[3];
            nfds_t n = 0;
            fds[n++] = {wake_[0], POLLIN, 0};
            const int stdin_idx = watch_stdin ? static_cast<int>(n) : -1;
            if (watch_stdin) fds[n++] = {0, 0, 0};  // events 0: only POLLHUP/POLLERR are reported
            int cfd;
            {
                std::lock_guard<std::mutex> lock(read_mu_);
                cfd = cancel_fd_;
            }
            const int cancel_idx = cfd >= 0 ? static_cast<int>(n) : -1;
            if (cfd >= 0) fds[n++] = {cfd, POLLIN, 0};
            int r = poll(fds, n, g_simulated_hang.load() ? 200 : -1);
            if (r < 0) {
                if (errno == EINTR) continue;
                return;
            }
            if (stop_.load()) return;
            if (stdin_idx >= 0 && fds[stdin_idx].revents) {
                if (fds[stdin_idx].revents & POLLNVAL) {
                    watch_stdin = false;  // not a pollable stdin; the loop's read() sees EOF
                } else if (fds[stdin_idx].revents & (POLLHUP | POLLERR)) {
                    if (!g_simulated_hang.load() && !grace("stdin closed")) parent_gone("stdin closed");
                    if (stop_.load()) return;
                    watch_stdin = false;
                }
            }
            if (cancel_idx >= 0 && fds[cancel_idx].revents) drain();
        }
    }

public:
    /// Reads every queued cancel frame without blocking and hands it to the controller. Called
    /// by the watcher thread and (through CancelController::sync) by the loop thread; the
    /// mutex keeps the partial-frame state consistent. EOF = the parent is gone: exit.
    void drain() {
        std::lock_guard<std::mutex> lock(read_mu_);
        if (cancel_fd_ < 0) return;
        unsigned char buf[256];
        for (;;) {
            ssize_t k = ::read(cancel_fd_, buf, sizeof buf);
            if (k > 0) {
                if (!g_simulated_hang.load())
                    frames_.feed(buf, static_cast<size_t>(k), [this](uint64_t id) { cancel_.on_frame(id); });
                continue;
            }
            if (k < 0 && errno == EINTR) continue;
            if (k < 0 && errno == EAGAIN) return;
            // EOF or error: the parent (the only writer) is gone. With an exit grace (a state
            // store to drain) stdin's end, which comes with it, exits instead: here the
            // loop thread may hold read_mu_'s other side.
            if (!g_simulated_hang.load() && g_exit_grace_ms.load() == 0) parent_gone("cancel pipe closed");
            close(cancel_fd_);
            cancel_fd_ = -1;
            return;
        }
    }

private:
    /// Watcher thread: waits up to g_exit_grace_ms for the process to end the orderly way
    /// (the destructor sets stop_). True when it did.
    bool grace(const char* why) {
        const int ms = g_exit_grace_ms.load();
        if (ms > 0) std::fprintf(stderr, "trioserve-worker: %s; finishing the state store's writes\n", why);
        for (int waited = 0; waited < ms && !stop_.load(); waited += 10)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return stop_.load();
    }

    [[noreturn]] static void parent_gone(const char* why) {
        std::fprintf(stderr, "trioserve-worker: %s; exiting\n", why);
        _exit(0);
    }

    CancelController& cancel_;
    std::mutex read_mu_;     ///< guards cancel_fd_ and frames_ (watcher vs loop thread)
    int cancel_fd_;
    FrameAssembler frames_;
    int wake_[2] = {-1, -1};
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

}  // namespace trioserve
