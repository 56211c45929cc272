// cpu_check.h — does the running CPU have every instruction-set extension the CPU backend's
// kernels were compiled for?
//
// Why: llama-cpp-python builds llama.cpp from source with GGML_NATIVE=ON (-march=native), and
// pip caches the built wheel. A wheel (or an image) built on an AVX-512 machine and reused on an
// AVX2-only one dies by SIGILL at its first matrix multiply. The CPU backend reports the
// extensions its kernels were COMPILED with (ggml_backend_get_features, from predefined macros
// such as __AVX512F__), and the kernel's /proc/cpuinfo flags list what this CPU HAS; any
// compiled-for extension the CPU lacks makes the worker refuse to start with a message that says
// how to rebuild, instead of crashing on a client's request.
//
// A build with run-time-selected CPU kernels (cpu_backend.h) passes by construction: ggml loaded
// the variant that scored best on this CPU. The check still runs on it (the kernel may hide an
// extension cpuid reports, e.g. AVX-512 without OS support) and names the variant if it fails.
//
// The features come from the registry, not from ggml_cpu_has_*(): in a run-time-selected build
// those functions live in the dlopen'ed module, not in any library the worker links.
//
// x86-64 Linux only (where GGML_NATIVE builds are the common case and cpuinfo has a `flags`
// line); elsewhere the check reports "not checked" and passes.
#pragma once

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>


namespace trioserve {

/// An extension as ggml names it, whether the CPU backend's kernels were compiled for it, and the
/// /proc/cpuinfo flag that says the CPU has it.
struct CompiledFeature {
    const char* name;
    bool compiled;
    const char* cpuinfo_flag;
};

/// The x86 extensions the CPU backend reports (ggml_backend_get_features: the same names as
/// ggml_cpu_has_*()), with their cpuinfo flag names (the kernel calls SSE3 "pni"), marked
/// compiled when `reported` lists them.
inline std::vector<CompiledFeature> ggml_compiled_features(const std::vector<std::string>& reported) {
    std::vector<CompiledFeature> table = {
        {"SSE3", false, "pni"},          {"SSSE3", false, "ssse3"},
        {"AVX", false, "avx"},           {"AVX_VNNI", false, "avx_vnni"},
        {"AVX2", false, "avx2"},         {"BMI2", false, "bmi2"},
        {"F16C", false, "f16c"},         {"FMA", false, "fma"},
        {"AVX512", false, "avx512f"},    {"AVX512_VBMI", false, "avx512vbmi"},
        {"AVX512_VNNI", false, "avx512_vnni"}, {"AVX512_BF16", false, "avx512_bf16"},
        {"AMX_INT8", false, "amx_int8"},
    };
    for (CompiledFeature& f : table)
        for (const std::string& r : reported)
            if (r == f.name) f.compiled = true;
    return table;
}

/// The flags of the first `flags` line of a /proc/cpuinfo text; empty when there is none
/// (not x86, or no such file).
inline std::set<std::string> cpuinfo_flags(std::istream& in) {
    std::set<std::string> flags;
    std::string line;
    while (std::getline(in, line)) {
        if (line.compare(0, 5, "flags") != 0) continue;
        const size_t colon = line.find(':');
        if (colon == std::string::npos) continue;
        std::istringstream words(line.substr(colon + 1));
        for (std::string w; words >> w;) flags.insert(w);
        break;
    }
    return flags;
}

/// The names of the compiled-for features whose cpuinfo flag is absent. Empty `flags` means
/// "cannot tell" and yields nothing missing.
inline std::vector<std::string> missing_cpu_features(const std::vector<CompiledFeature>& compiled,
                                                     const std::set<std::string>& flags) {
    std::vector<std::string> missing;
    if (flags.empty()) return missing;
    for (const CompiledFeature& f : compiled)
        if (f.compiled && flags.count(f.cpuinfo_flag) == 0) missing.emplace_back(f.name);
    return missing;
}

/// The compiled-for feature names, space-separated ("AVX AVX2 FMA ...").
inline std::string compiled_feature_list(const std::vector<CompiledFeature>& compiled) {
    std::string out;
    for (const CompiledFeature& f : compiled)
        if (f.compiled) out += (out.empty() ? "" : " ") + std::string(f.name);
    return out;
}

/// Checks the CPU backend's compiled-for features (`reported`, from cpu_backend.h) against
/// `cpuinfo_path` (/proc/cpuinfo; tests give another file). `variant` is the run-time-selected
/// module's variant, "" for a linked backend. Returns "" when every compiled-for feature is
/// present (or the CPU cannot be inspected), else the startup error to print.
inline std::string check_cpu_features(const std::string& cpuinfo_path, const std::vector<std::string>& reported,
                                      const std::string& variant) {
#if defined(__x86_64__) || defined(__i386__)
    std::ifstream in(cpuinfo_path);
    const std::set<std::string> flags = cpuinfo_flags(in);
    const std::vector<CompiledFeature> compiled = ggml_compiled_features(reported);
    const std::vector<std::string> missing = missing_cpu_features(compiled, flags);
    if (missing.empty()) return "";
    std::string names;
    for (const std::string& m : missing) names += (names.empty() ? "" : " ") + m;
    if (!variant.empty())
        return "this CPU lacks instruction-set extensions of the CPU kernels llama.cpp selected for it (variant " +
               variant + "): " + names + " (compiled for: " + compiled_feature_list(compiled) +
               "). cpuid offers them but the kernel does not list them in /proc/cpuinfo; they would die by SIGILL "
               "(illegal instruction).";
    return "this CPU lacks instruction-set extensions the linked llama.cpp (ggml-cpu) was compiled for: " + names +
           " (compiled for: " + compiled_feature_list(compiled) +
           "). The build came from another machine (a copied image or pip's wheel cache); it would die by "
           "SIGILL (illegal instruction). Rebuild it on this machine: pip install --no-cache-dir "
           "--force-reinstall --no-deps llama-cpp-python==0.3.36 (trioserve's own workers are built for generic x86-64 and need no rebuild).";
#else
    (void)cpuinfo_path;
    (void)reported;
    (void)variant;
    return "";
#endif
}

}  // namespace trioserve
