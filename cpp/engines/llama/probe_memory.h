// probe_memory.h — remembers kernel probes that PASSED (kernel_probe.h, kernel_path.h), so a
// worker restart or a server restart on the same machine, binaries and model does not pay the
// probe again (issue #51: 0.9-1.5 s of a ~3.5 s start for a 1.5B Q4_K_M model on 2 cores).
//
// One small file per key in a directory (`--probe-memory DIR`). The key hashes everything that
// can change whether the extra-buffer kernels crash: a format version; the identity (resolved
// path, size, mtime ns, inode) of the worker binary, of the probed variant's CPU module and of
// every libggml*/libllama* file mapped into this process; the first processor's vendor_id,
// model name, flags and microcode lines of the cpuinfo file the worker reads; the kernel's
// release and version (uname); the model file's identity; the KV cache type, the flash
// attention setting and the offered extra buffer types. spec/worker-protocol.md §10.
//
// Only passes are remembered: a failure may be transient (a timeout under load) and must be
// retried. Every error (an unwritable directory, a garbage file, no such path) reads as "not
// remembered" and the probe simply runs: the memory can make a start faster, never fail it.
// Single-threaded use (before the worker starts any thread); no waits.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "cpu_backend.h"
#include "engines/llama/kernel_path.h"
#include "stable_hash.h"

namespace trioserve {

namespace probe_memory_detail {

/// Bump when the key's contents or the file's format change: old files then never match.
constexpr const char* kFormat = "trioserve-probe-memory-2";
/// Files kept in the directory: one per (machine, binaries, model, settings); the oldest go.
constexpr size_t kMaxFiles = 256;
/// What a remembered file holds (checked on read, so a truncated or foreign file is ignored).
constexpr const char* kPassed = "passed\n";

/// "resolved-path size mtime-ns inode" of a file, or "missing <path>" when it cannot be stat'ed.
inline std::string file_identity(const std::string& path) {
    char resolved[4096];
    const std::string real = realpath(path.c_str(), resolved) != nullptr ? std::string(resolved) : path;
    struct stat st {};
    if (stat(real.c_str(), &st) != 0) return "missing " + path;
    const long long mtime_ns = static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
    return real + " " + std::to_string(static_cast<long long>(st.st_size)) + " " + std::to_string(mtime_ns) + " " +
           std::to_string(static_cast<unsigned long long>(st.st_ino));
}

/// The libggml*/libllama* files mapped into this process (the loaded CPU module among them),
/// sorted and unique.
inline std::vector<std::string> mapped_llama_libraries() {
    std::vector<std::string> out;
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
        const size_t slash = line.find('/');
        if (slash == std::string::npos) continue;
        const std::string path = line.substr(slash);
        const std::string base = path.substr(path.rfind('/') + 1);
        if (base.rfind("libggml", 0) == 0 || base.rfind("libllama", 0) == 0) out.push_back(path);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

/// The first processor's vendor_id, model name, flags and microcode lines of `cpuinfo_path`.
inline std::string cpu_identity(const std::string& cpuinfo_path) {
    std::ifstream in(cpuinfo_path);
    std::string line, out;
    while (std::getline(in, line)) {
        if (line.empty() && !out.empty()) break;  // the first processor's block ends here
        const std::string name = line.substr(0, line.find(':'));
        const std::string trimmed = name.substr(0, name.find_last_not_of(" \t") + 1);
        if (trimmed == "vendor_id" || trimmed == "model name" || trimmed == "flags" || trimmed == "microcode")
            out += line + "\n";
    }
    return out.empty() ? "no cpuinfo " + cpuinfo_path : out;
}

/// The CPU module file of `variant` (the first found in cpu_module_dirs()).
inline std::string variant_module_identity(const std::string& variant) {
    if (variant.empty()) return "linked";
    for (const std::string& dir : cpu_module_dirs()) {
        const std::string path = dir + "/libggml-cpu-" + variant + ".so";
        if (access(path.c_str(), F_OK) == 0) return file_identity(path);
    }
    return "no module " + variant;
}

/// mkdir -p with mode 0700; true when `dir` is a directory afterwards.
inline bool make_dirs(const std::string& dir) {
    if (dir.empty()) return false;
    struct stat st {};
    if (stat(dir.c_str(), &st) == 0) return S_ISDIR(st.st_mode);
    const size_t slash = dir.find_last_of('/');
    if (slash != std::string::npos && slash > 0 && !make_dirs(dir.substr(0, slash))) return false;
    return mkdir(dir.c_str(), 0700) == 0 || errno == EEXIST;
}

/// Keeps the newest kMaxFiles remembered files of `dir` (by mtime); removes the rest.
inline void prune(const std::string& dir) {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return;
    std::vector<std::pair<long long, std::string>> files;
    while (dirent* e = readdir(d)) {
        const std::string name = e->d_name;
        if (name.size() != 16 + 5 || name.compare(16, 5, ".pass") != 0) continue;  // ours only
        struct stat st {};
        if (stat((dir + "/" + name).c_str(), &st) != 0) continue;
        files.emplace_back(static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec, name);
    }
    closedir(d);
    if (files.size() <= kMaxFiles) return;
    std::sort(files.begin(), files.end(), std::greater<>());
    for (size_t i = kMaxFiles; i < files.size(); ++i) unlink((dir + "/" + files[i].second).c_str());
}

}  // namespace probe_memory_detail

/// What decides a probe's outcome besides the variant (the rest of the key is read from the
/// machine when a probe is looked up).
struct ProbeMemoryKey {
    std::string model_path;
    std::string cpuinfo_path = "/proc/cpuinfo";
    std::string kv_cache_type;
    std::string flash_attn;                ///< "" = the default
    std::vector<std::string> offered;      ///< the extra buffer types offered
};

/// The hex key of a probe of `variant` with `k` on this machine and these binaries.
inline std::string probe_memory_key(const ProbeMemoryKey& k, const std::string& variant) {
    namespace d = probe_memory_detail;
    std::ostringstream s;
    s << d::kFormat << "\nexe " << d::file_identity("/proc/self/exe") << "\nvariant " << variant << " "
      << d::variant_module_identity(variant) << "\n";
    for (const std::string& lib : d::mapped_llama_libraries()) s << "lib " << d::file_identity(lib) << "\n";
    s << d::cpu_identity(k.cpuinfo_path);
    struct utsname u {};
    if (uname(&u) == 0) s << "uname " << u.release << " " << u.version << "\n";
    s << "model " << d::file_identity(k.model_path) << "\nkv " << k.kv_cache_type << "\nfa " << k.flash_attn
      << "\noffered";
    for (const std::string& t : k.offered) s << " " << t;
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(state_hash(s.str())));
    return hex;
}

/// Whether `dir` remembers a passed probe under `key`. Any error reads as false.
inline bool probe_remembered(const std::string& dir, const std::string& key) {
    std::ifstream in(dir + "/" + key + ".pass", std::ios::binary);
    if (!in) return false;
    std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return content == probe_memory_detail::kPassed;
}

/// Remembers a passed probe under `key`: the directory (and missing parents) made mode 0700,
/// the file written to a temporary name (mode 0600) and renamed, so a reader never sees half a
/// file; then the oldest files beyond the bound are removed. Returns false on any error (the
/// next start probes again).
inline bool remember_probe(const std::string& dir, const std::string& key) {
    namespace d = probe_memory_detail;
    if (!d::make_dirs(dir)) return false;
    const std::string final_path = dir + "/" + key + ".pass";
    const std::string tmp = dir + "/." + key + "." + std::to_string(static_cast<long long>(getpid())) + ".tmp";
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return false;
    const std::string body = d::kPassed;
    const bool wrote = write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size());
    const bool closed = close(fd) == 0;
    if (!wrote || !closed || rename(tmp.c_str(), final_path.c_str()) != 0) {
        unlink(tmp.c_str());
        return false;
    }
    d::prune(dir);
    return true;
}

/// Wraps `probe`: a probe of a variant remembered in `dir` returns a pass without spawning
/// anything (ms 0, remembered = true); otherwise the probe runs and a pass is remembered.
/// `dir` empty = no memory (`probe` itself).
inline ProbeLauncher remembering(ProbeLauncher probe, const std::string& dir, const ProbeMemoryKey& k) {
    if (dir.empty()) return probe;
    return [probe = std::move(probe), dir, k](const std::string& variant) {
        const std::string key = probe_memory_key(k, variant);
        if (probe_remembered(dir, key)) {
            ProbeResult r;
            r.passed = true;
            r.exit_status = 0;
            r.how = "passed";
            r.remembered = true;
            return r;
        }
        ProbeResult r = probe(variant);
        if (r.passed) remember_probe(dir, key);
        return r;
    };
}

}  // namespace trioserve
