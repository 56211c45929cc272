// kernel_probe.h — runs the llama worker's warm-up in a short-lived child process, so a CPU
// kernel that crashes (llama.cpp's AMX / CPU-repack "extra buffer types": e.g. AMX on Sapphire
// Rapids dies by SIGILL/SIGSEGV at `ldtilecfg`, llama.cpp issue #20824) takes down the probe,
// never the worker.
//
// The probe is the llama worker binary (the worker's own /proc/self/exe; the direct loop names
// the worker beside it) started with --probe: it loads the model WITH extra buffer types, runs
// the same warm-up the worker runs, and exits 0. Its stdout
// is the worker's stderr (stdout carries protocol records only), its stdin /dev/null; it dies
// with the worker (PR_SET_PDEATHSIG in setup_process). The worker waits for it with a deadline
// and kills it (SIGKILL) past that. Spawned before the worker starts any thread.
#pragma once

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace trioserve {

/// A signal in words, as the server's log and errors name it: "illegal instruction (SIGILL)".
/// The Python side (trioserve/worker/exit_status.py) uses the same words.
inline std::string signal_in_words(int sig) {
    switch (sig) {
        case SIGILL: return "illegal instruction (SIGILL)";
        case SIGSEGV: return "segmentation fault (SIGSEGV)";
        case SIGBUS: return "bus error (SIGBUS)";
        case SIGFPE: return "floating-point exception (SIGFPE)";
        case SIGABRT: return "aborted (SIGABRT)";
        case SIGKILL: return "killed (SIGKILL)";
        case SIGTERM: return "terminated (SIGTERM)";
        default: {
            const char* d = strsignal(sig);
            return std::string(d ? d : "signal") + " (signal " + std::to_string(sig) + ")";
        }
    }
}

/// How a probe ended.
struct ProbeResult {
    bool passed = false;   ///< exited with status 0: the warm-up ran and its output was sane
    int signal = 0;        ///< the signal that killed it, 0 if none
    int exit_status = -1;  ///< its exit status when it exited
    bool timed_out = false;
    double ms = 0;         ///< spawn → reaped
    std::string how;       ///< "passed", "died by illegal instruction (SIGILL)", "exit status 1", ...
    bool remembered = false;  ///< a pass read from --probe-memory: no process ran (probe_memory.h)
};

/// Starts the program `exe` with `argv` (argv[0] = its name) as the probe and waits up to
/// `timeout_s` for it.
inline ProbeResult run_probe(const std::string& exe, const std::vector<std::string>& argv, double timeout_s) {
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    ProbeResult r;
    std::vector<char*> cargv;
    for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    cargv.push_back(nullptr);

    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, 2, 1);  // never the protocol's stdout
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, cargv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    auto elapsed = [&] { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
    if (rc != 0) {
        r.how = std::string("could not start: ") + std::strerror(rc);
        r.ms = elapsed();
        return r;
    }
    int status = 0;
    for (;;) {
        const pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid) break;
        if (w < 0 && errno != EINTR) {
            r.how = std::string("could not wait: ") + std::strerror(errno);
            r.ms = elapsed();
            return r;
        }
        if (elapsed() > timeout_s * 1000.0) {
            kill(pid, SIGKILL);
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
            r.timed_out = true;
            r.how = "no result within " + std::to_string(static_cast<long long>(timeout_s)) + " s (killed)";
            r.ms = elapsed();
            return r;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    r.ms = elapsed();
    if (WIFSIGNALED(status)) {
        r.signal = WTERMSIG(status);
        r.how = "died by " + signal_in_words(r.signal);
    } else if (WIFEXITED(status)) {
        r.exit_status = WEXITSTATUS(status);
        r.passed = r.exit_status == 0;
        r.how = r.passed ? "passed" : "exit status " + std::to_string(r.exit_status);
    }
    return r;
}

}  // namespace trioserve
