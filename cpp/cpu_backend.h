// cpu_backend.h — makes sure the linked ggml has a CPU backend before anything loads a model,
// and says which CPU kernels it is.
//
// Two kinds of llama.cpp build reach the worker:
// * linked CPU backend (llama-cpp-python's default: GGML_NATIVE=ON, one libggml-cpu.so compiled
//   with -march=native for the build machine). The registry holds it from the start.
// * run-time selected CPU kernels (GGML_BACKEND_DL=ON, GGML_CPU_ALL_VARIANTS=ON,
//   GGML_NATIVE=OFF): the CPU backend is one of several libggml-cpu-<variant>.so modules (x64,
//   haswell, skylakex, zen4, sapphirerapids, ...), none linked. Each module scores itself
//   against the running CPU (cpuid); ggml_backend_load_all_from_path() dlopens the best one. No
//   application does that for us: llama_model_load_from_file() fails with "no backends are
//   loaded" until someone loads them, and ggml's default search looks only in the executable's
//   directory and the current directory, where the worker's modules are not.
//
// So the worker looks where the build installed them: beside the libggml.so it is linked to
// (found with dladdr), and in that prefix's bin/ (llama.cpp installs backend modules to
// CMAKE_INSTALL_BINDIR; in a llama-cpp-python wheel that is <site-packages>/bin). Which module
// won is read back from the process's loaded objects (dl_iterate_phdr): ggml keeps only the
// chosen one loaded.
//
// A variant can be FORCED (--cpu-variant NAME, or $TRIOSERVE_CPU_VARIANT): the worker then loads
// libggml-cpu-NAME.so itself (ggml_backend_load: the module still scores itself, and one this CPU
// cannot run is refused) instead of letting ggml pick the best. So one machine runs the kernels
// another machine would pick (an AVX-512 host runs the AVX2 `haswell` kernels, say): the tests
// that compare outputs across paths run under every variant the build holds (spec/worker-protocol.md
// §10). Only the CPU module is loaded then (no GPU module beside it).
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>

#include "ggml-backend.h"

namespace trioserve {

/// The CPU backend the registry holds, as reported in the ready record's kernel_path.
struct CpuBackendInfo {
    /// "linked" (a CPU backend built into the linked libraries) or "runtime-selected" (a
    /// libggml-cpu-<variant>.so module chosen for this CPU and loaded at start).
    std::string kind;
    /// The module's variant ("zen4", "haswell", "x64", ...); "" for a linked backend.
    std::string variant;
    /// The loaded module's path; "" for a linked backend.
    std::string library;
    /// The instruction-set features the backend reports with value "1" (ggml_backend_get_features:
    /// what its kernels were compiled for, e.g. "AVX2", "AVX512"), plus "REPACK", "OPENMP", ...
    std::vector<std::string> features;
    /// Whether the variant was forced (--cpu-variant / $TRIOSERVE_CPU_VARIANT), not ggml's pick.
    bool forced = false;
    /// Non-empty when no CPU backend could be found: the startup error.
    std::string error;
};

namespace cpu_backend_detail {

/// The directory of the shared object that holds `symbol` ("" when unknown).
inline std::string directory_of(const void* symbol) {
    Dl_info info{};
    if (dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "";
    std::string path = info.dli_fname;
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

/// The first loaded object whose file name is libggml-cpu-<variant>.so[.N...]: the module
/// ggml chose (it unloads the other candidates after scoring them).
inline std::string loaded_cpu_module() {
    std::string found;
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) -> int {
            const char* name = info->dlpi_name;
            if (name == nullptr) return 0;
            const char* base = std::strrchr(name, '/');
            base = base ? base + 1 : name;
            if (std::strncmp(base, "libggml-cpu-", 12) != 0) return 0;
            *static_cast<std::string*>(out) = name;
            return 1;
        },
        &found);
    return found;
}

/// "zen4" from ".../libggml-cpu-zen4.so.0"; "" when the name does not have that shape.
inline std::string variant_of(const std::string& path) {
    const size_t slash = path.rfind('/');
    std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    const std::string prefix = "libggml-cpu-";
    if (base.compare(0, prefix.size(), prefix) != 0) return "";
    base = base.substr(prefix.size());
    const size_t so = base.find(".so");
    return so == std::string::npos ? base : base.substr(0, so);
}

inline std::vector<std::string> reported_features(ggml_backend_dev_t cpu) {
    std::vector<std::string> names;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(cpu);
    auto get = reinterpret_cast<ggml_backend_get_features_t>(
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features"));
    if (get == nullptr) return names;
    for (ggml_backend_feature* f = get(reg); f != nullptr && f->name != nullptr; ++f)
        if (f->value != nullptr && std::strcmp(f->value, "1") == 0) names.emplace_back(f->name);
    return names;
}

}  // namespace cpu_backend_detail

/// Where a run-time-selected build keeps its CPU modules, in search order: beside libggml.so,
/// then <prefix>/bin for a libggml.so in <prefix>/lib or <prefix>/llama_cpp/lib.
inline std::vector<std::string> cpu_module_dirs() {
    std::vector<std::string> dirs;
    const std::string lib = cpu_backend_detail::directory_of(reinterpret_cast<const void*>(&ggml_backend_load_all_from_path));
    if (lib.empty()) return dirs;
    dirs.push_back(lib);
    dirs.push_back(lib + "/../bin");
    dirs.push_back(lib + "/../../bin");
    return dirs;
}

/// The variants of the libggml-cpu-<variant>.so modules in cpu_module_dirs(), sorted, unique
/// (whether this CPU can run them or not).
inline std::vector<std::string> cpu_variants_present() {
    std::vector<std::string> out;
    for (const std::string& dir : cpu_module_dirs()) {
        DIR* d = opendir(dir.c_str());
        if (d == nullptr) continue;
        while (dirent* e = readdir(d)) {
            const std::string name = e->d_name;
            if (name.size() < 4 || name.compare(name.size() - 3, 3, ".so") != 0) continue;
            const std::string v = cpu_backend_detail::variant_of(name);
            if (!v.empty()) out.push_back(v);
        }
        closedir(d);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

/// The variant to force: `requested` when not empty, else $TRIOSERVE_CPU_VARIANT, else "".
inline std::string requested_cpu_variant(const std::string& requested) {
    if (!requested.empty()) return requested;
    const char* env = std::getenv("TRIOSERVE_CPU_VARIANT");
    return env != nullptr ? std::string(env) : std::string();
}

namespace cpu_backend_detail {

/// Loads libggml-cpu-`variant`.so from the module directories; "" on success, else why not.
inline std::string load_forced_variant(const std::string& variant) {
    const bool plain = !variant.empty() && std::all_of(variant.begin(), variant.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
    });
    auto present = [] {
        std::string list;
        for (const std::string& v : cpu_variants_present()) list += (list.empty() ? "" : ", ") + v;
        return list.empty() ? std::string("none") : list;
    };
    if (!plain) return "CPU variant '" + variant + "' is not a variant name (lower-case letters, digits, _)";
    for (const std::string& dir : cpu_module_dirs()) {
        const std::string path = dir + "/libggml-cpu-" + variant + ".so";
        struct stat st {};
        if (::stat(path.c_str(), &st) != 0) continue;
        if (ggml_backend_load(path.c_str()) != nullptr &&
            ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) != nullptr)
            return "";
        return "CPU variant '" + variant + "' (" + path + ") cannot run on this CPU (it scores 0: the CPU lacks an " +
               "instruction-set extension it was compiled for) or failed to load";
    }
    return "CPU variant '" + variant + "' is not in this build (variants present: " + present() + ")";
}

}  // namespace cpu_backend_detail

/// Ensures the registry has a CPU device, loading the run-time-selected CPU module (and any
/// other backend module beside it) when the linked ggml has none; then describes it. With a
/// `variant` to force (requested_cpu_variant()), that module is loaded instead of ggml's pick;
/// forcing a variant on a build that links its CPU backend is an error. Call once, at start,
/// before any model load and before any thread. Idempotent: a second call only describes (and
/// re-checks a forced variant against what is loaded). Never throws; `error` says what is wrong.
inline CpuBackendInfo ensure_cpu_backend(const std::string& variant = requested_cpu_variant("")) {
    namespace d = cpu_backend_detail;
    CpuBackendInfo info;
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (cpu == nullptr && !variant.empty()) {
        info.error = d::load_forced_variant(variant);
        if (!info.error.empty()) return info;
        cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    if (cpu == nullptr) {
        for (const std::string& dir : cpu_module_dirs()) {
            ggml_backend_load_all_from_path(dir.c_str());
            cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
            if (cpu != nullptr) break;
        }
    }
    if (cpu == nullptr) {
        std::string where;
        for (const std::string& dir : cpu_module_dirs()) where += (where.empty() ? "" : ", ") + dir;
        info.error = "the linked llama.cpp has no CPU backend: it was built with GGML_BACKEND_DL and no "
                     "libggml-cpu-*.so module that this CPU can run was found in " +
                     (where.empty() ? std::string("(the directory of libggml.so is unknown)") : where);
        return info;
    }
    info.library = d::loaded_cpu_module();
    info.variant = d::variant_of(info.library);
    info.kind = info.library.empty() ? "linked" : "runtime-selected";
    info.features = d::reported_features(cpu);
    if (!variant.empty()) {
        if (info.variant != variant) {
            info.error = info.library.empty()
                             ? "CPU variant '" + variant + "' cannot be forced: this llama.cpp links its CPU backend " +
                                   "(one set of kernels; build it with GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON)"
                             : "CPU variant '" + variant + "' was asked for but '" + info.variant + "' is loaded";
            return info;
        }
        info.forced = true;
    }
    return info;
}

}  // namespace trioserve
