// kernel_path.h — the one rule that decides which CPU kernels every binary that runs a llama.cpp
// model takes: the worker, the direct loop (trioserve-llama-direct), and — through
// `trioserve-llama-worker --kernel-path-only` — whatever tests and benchmarks run next to them
// (llama-cpp-python in a child process, llama-server). spec/worker-protocol.md §10.
//
// Two choices make a kernel path: the libggml-cpu-<variant>.so module (ggml's pick for this CPU,
// or a forced one), and which of the module's "extra buffer types" may hold weights. The extra
// types are faster kernels (CPU_REPACK: repacked quantized blocks; AMX: Intel's tile unit, only in
// an AMX variant such as sapphirerapids) that can crash where the CPU or the hypervisor does not
// really support them (AMX dies by SIGILL at `ldtilecfg` on some Sapphire Rapids VMs, llama.cpp
// issue #20824). So, with `--cpu-extra-buffers auto`:
//
//   1. probe the selected variant with every extra type it offers, in a child process
//      (kernel_probe.h): passed → keep them all;
//   2. failed, and AMX was among them → probe the best other variant this CPU can run that is
//      not an AMX variant, with its extra types (CPU_REPACK): passed → switch to that variant
//      and keep them, so an AMX fault does not also cost the repacked kernels;
//   3. otherwise → the selected variant with no extra type (what llama-server's --no-repack runs).
//
// `on` keeps every offered type without a probe, `off` none. The outcome says what was kept,
// what was dropped and why (every probe's result), for the ready record and the start-up log.
#pragma once

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <dlfcn.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "cpu_backend.h"
#include "engines/llama/llama_engine.h"
#include "kernel_probe.h"

namespace trioserve {

/// The x86 variants ggml compiles with AMX (GGML_AMX_TILE/GGML_AMX_INT8): their module offers
/// the AMX extra buffer type; every other variant offers at most CPU_REPACK.
inline bool is_amx_variant(const std::string& variant) { return variant == "sapphirerapids"; }

/// One probe of the ladder above.
struct ProbeRun {
    std::string variant;  ///< the CPU variant it ran ("" = the linked backend)
    ProbeResult result;
};

/// What choose_kernel_path() decided.
struct KernelPath {
    std::string mode = "auto";              ///< --cpu-extra-buffers: auto | on | off
    std::vector<std::string> offered;       ///< extra types the originally selected variant offers
    std::vector<std::string> kept;          ///< extra types weights may use (empty = plain buffers)
    std::vector<std::pair<std::string, std::string>> dropped;  ///< type -> why it was dropped
    std::vector<ProbeRun> probes;           ///< in the order they ran
    std::string switched_from;              ///< the variant given up for step 2's ("" = none)
    std::string error;                      ///< non-empty: the chosen variant could not be loaded

    bool use_extra_bufts() const { return !kept.empty(); }
    /// Whether extra buffer types were offered and not all kept (a probe failed).
    bool fell_back() const { return !dropped.empty() && mode == "auto"; }
    /// Whether the kernels in use are the ones a passing probe ran (now, or remembered for
    /// these binaries, CPU, model and settings): then the worker's warm-up checks one token.
    bool probed() const { return use_extra_bufts() && !probes.empty() && probes.back().result.passed; }
};

/// How to start a probe of one variant (the argv of `worker --probe ...`, with --cpu-variant).
using ProbeLauncher = std::function<ProbeResult(const std::string& variant)>;

namespace kernel_path_detail {

/// ggml_backend_score of a libggml-cpu-<variant>.so module: 0 when this CPU cannot run it.
/// Loads the module privately and unloads it again (what ggml's own best-variant search does).
inline int variant_score(const std::string& variant) {
    for (const std::string& dir : cpu_module_dirs()) {
        const std::string path = dir + "/libggml-cpu-" + variant + ".so";
        void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (handle == nullptr) continue;
        using score_fn = int (*)();
        auto score = reinterpret_cast<score_fn>(dlsym(handle, "ggml_backend_score"));
        const int s = score != nullptr ? score() : 0;
        dlclose(handle);
        return s;
    }
    return 0;
}

/// The best-scoring variant present that this CPU runs, other than `current` and not an AMX
/// variant; "" when there is none.
inline std::string best_variant_without_amx(const std::string& current) {
    std::string best;
    int best_score = 0;
    for (const std::string& v : cpu_variants_present()) {
        if (v == current || is_amx_variant(v)) continue;
        const int s = variant_score(v);
        if (s > best_score) { best_score = s; best = v; }
    }
    return best;
}

inline bool contains(const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace kernel_path_detail

/// Applies the rule above. `loaded` is the CPU backend ensure_cpu_backend() loaded; `offered`
/// the extra types it offers (cpu_extra_buffer_types(); a test may pretend more). When step 2
/// wins, the loaded CPU module is replaced by the other variant's (ggml_backend_unload, then
/// load) and `loaded` describes it afterwards. Call before any model is loaded and before any
/// thread starts. Never throws.
inline KernelPath choose_kernel_path(CpuBackendInfo& loaded, const std::string& mode,
                                     const std::vector<std::string>& offered, const ProbeLauncher& probe) {
    namespace d = kernel_path_detail;
    KernelPath kp;
    kp.mode = mode;
    kp.offered = offered;
    if (offered.empty()) return kp;
    if (mode == "on") {
        kp.kept = offered;
        return kp;
    }
    if (mode == "off") {
        for (const std::string& t : offered) kp.dropped.emplace_back(t, "--cpu-extra-buffers off");
        return kp;
    }
    ProbeRun first{loaded.variant, probe(loaded.variant)};
    kp.probes.push_back(first);
    if (first.result.passed) {
        kp.kept = offered;
        return kp;
    }
    const std::string why_first = "its probe (variant " + (loaded.variant.empty() ? std::string("linked") : loaded.variant) +
                                  ") " + first.result.how;
    const std::string other = d::contains(offered, "AMX") && !loaded.variant.empty() && !loaded.forced
                                  ? d::best_variant_without_amx(loaded.variant)
                                  : std::string();
    if (!other.empty()) {
        ProbeRun second{other, probe(other)};
        kp.probes.push_back(second);
        if (second.result.passed) {
            // Switch modules: nothing has used the CPU backend yet (no model, no thread).
            ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
            if (cpu != nullptr) ggml_backend_unload(ggml_backend_dev_backend_reg(cpu));
            CpuBackendInfo now = ensure_cpu_backend(other);
            if (!now.error.empty()) {
                kp.error = "switching the CPU kernels to variant '" + other + "' after " + why_first + " failed: " + now.error;
                return kp;
            }
            now.forced = false;  // chosen by the rule, not asked for
            kp.switched_from = loaded.variant;
            loaded = now;
            for (const std::string& t : cpu_extra_buffer_types()) kp.kept.push_back(t);
            for (const std::string& t : offered)
                if (!d::contains(kp.kept, t)) kp.dropped.emplace_back(t, why_first);
            return kp;
        }
        for (const std::string& t : offered)
            kp.dropped.emplace_back(t, why_first + "; variant " + other + " with its extra types " + second.result.how);
        return kp;
    }
    for (const std::string& t : offered) kp.dropped.emplace_back(t, why_first);
    return kp;
}

/// The ready record's `kernel_path` fields about the choice (spec/worker-protocol.md §10).
inline nlohmann::json kernel_path_json(const KernelPath& kp) {
    nlohmann::json probes = nlohmann::json::array();
    for (const ProbeRun& p : kp.probes)
        probes.push_back({{"variant", p.variant}, {"result", p.result.how}, {"ms", static_cast<long long>(p.result.ms)},
                          {"remembered", p.result.remembered}});
    nlohmann::json dropped = nlohmann::json::object();
    for (const auto& [type, why] : kp.dropped) dropped[type] = why;
    nlohmann::json j = {{"cpu_extra_buffers", kp.mode},
                        {"extra_buffer_types", kp.offered},
                        {"extra_buffer_types_kept", kp.kept},
                        {"extra_buffer_types_dropped", dropped},
                        {"probes", probes},
                        {"probe", kp.probes.empty() ? std::string("not run") : kp.probes.front().result.how},
                        {"probe_remembered", !kp.probes.empty() && kp.probes.front().result.remembered},
                        {"fallback", kp.fell_back()},
                        {"extra_buffers_enabled", kp.use_extra_bufts()}};
    if (!kp.probes.empty()) j["probe_ms"] = static_cast<long long>(kp.probes.front().result.ms);
    if (!kp.switched_from.empty()) j["cpu_variant_switched_from"] = kp.switched_from;
    return j;
}

/// One line for the start-up log: what was kept and why the rest was dropped.
inline std::string kernel_path_summary(const KernelPath& kp) {
    auto join = [](const std::vector<std::string>& v) {
        std::string out;
        for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
        return out.empty() ? std::string("none") : out;
    };
    std::string s = "extra buffer types kept: " + join(kp.kept);
    for (const auto& [type, why] : kp.dropped) s += "; " + type + " dropped: " + why;
    if (!kp.switched_from.empty()) s += "; CPU kernels switched from " + kp.switched_from;
    return s;
}

/// The directory of the running program (where the worker binaries are installed together).
inline std::string program_dir() {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return ".";
    std::string path(buf, static_cast<size_t>(n));
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

/// The argv of a probe of `variant` run by `worker_exe` (trioserve-llama-worker --probe) with the
/// settings that decide which kernels run: the model, threads, KV cache type, flash attention.
struct ProbeSettings {
    std::string worker_exe;
    std::string model_path;
    int32_t threads = 0;
    std::string kv_cache_type = "f16";
    std::string flash_attn;       ///< "" = the default
    std::string cpuinfo_path;     ///< "" = /proc/cpuinfo
    std::string fault;            ///< test-only: --test-probe-fault
    double timeout_s = 120;
    bool verbose = false;
};

inline ProbeLauncher probe_launcher(const ProbeSettings& s) {
    return [s](const std::string& variant) {
        std::vector<std::string> argv = {s.worker_exe, "--probe", "--model", s.model_path, "--threads",
                                         std::to_string(default_threads(s.threads)), "--ctx", "512",
                                         "--capacity", "1", "--batch-tokens", "512", "--prefill-chunk", "512",
                                         "--kv-cache-type", s.kv_cache_type};
        if (!variant.empty()) argv.insert(argv.end(), {"--cpu-variant", variant});
        if (s.verbose) argv.push_back("--verbose");
        if (!s.flash_attn.empty()) argv.insert(argv.end(), {"--flash-attn", s.flash_attn});
        if (!s.fault.empty()) argv.insert(argv.end(), {"--test-probe-fault", s.fault});
        if (!s.cpuinfo_path.empty()) argv.insert(argv.end(), {"--test-cpuinfo", s.cpuinfo_path});
        return run_probe(s.worker_exe, argv, s.timeout_s);
    };
}

}  // namespace trioserve
