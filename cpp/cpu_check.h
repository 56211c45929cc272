// cpu_check.h — does the running CPU have every instruction-set extension the linked ggml CPU
// backend was compiled for?
//
// Why: llama-cpp-python builds llama.cpp from source with GGML_NATIVE=ON (-march=native), and
// pip caches the built wheel. A wheel (or an image) built on an AVX-512 machine and reused on an
// AVX2-only one dies by SIGILL at its first matrix multiply. ggml_cpu_has_*() report the
// extensions ggml-cpu was COMPILED with (they test predefined macros such as __AVX512F__), and
// the kernel's /proc/cpuinfo flags list what this CPU HAS; any compiled-for extension the CPU
// lacks makes the worker refuse to start with a message that says how to rebuild, instead of
// crashing on a client's request.
//
// x86-64 Linux only (where GGML_NATIVE builds are the common case and cpuinfo has a `flags`
// line); elsewhere the check reports "not checked" and passes.
#pragma once

#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "ggml-cpu.h"

namespace trioserve {

/// An extension as ggml names it, whether ggml-cpu was compiled for it, and the /proc/cpuinfo
/// flag that says the CPU has it.
struct CompiledFeature {
    const char* name;
    bool compiled;
    const char* cpuinfo_flag;
};

/// The x86 extensions ggml-cpu reports through ggml_cpu_has_*() (ggml-cpu.h), with their
/// cpuinfo flag names (the kernel calls SSE3 "pni").
inline std::vector<CompiledFeature> ggml_compiled_features() {
    return {
        {"SSE3", ggml_cpu_has_sse3() != 0, "pni"},
        {"SSSE3", ggml_cpu_has_ssse3() != 0, "ssse3"},
        {"AVX", ggml_cpu_has_avx() != 0, "avx"},
        {"AVX_VNNI", ggml_cpu_has_avx_vnni() != 0, "avx_vnni"},
        {"AVX2", ggml_cpu_has_avx2() != 0, "avx2"},
        {"BMI2", ggml_cpu_has_bmi2() != 0, "bmi2"},
        {"F16C", ggml_cpu_has_f16c() != 0, "f16c"},
        {"FMA", ggml_cpu_has_fma() != 0, "fma"},
        {"AVX512", ggml_cpu_has_avx512() != 0, "avx512f"},
        {"AVX512_VBMI", ggml_cpu_has_avx512_vbmi() != 0, "avx512vbmi"},
        {"AVX512_VNNI", ggml_cpu_has_avx512_vnni() != 0, "avx512_vnni"},
        {"AVX512_BF16", ggml_cpu_has_avx512_bf16() != 0, "avx512_bf16"},
        {"AMX_INT8", ggml_cpu_has_amx_int8() != 0, "amx_int8"},
    };
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

/// Checks the linked ggml against `cpuinfo_path` (/proc/cpuinfo; tests give another file).
/// Returns "" when every compiled-for feature is present (or the CPU cannot be inspected),
/// else the startup error to print.
inline std::string check_cpu_features(const std::string& cpuinfo_path) {
#if defined(__x86_64__) || defined(__i386__)
    std::ifstream in(cpuinfo_path);
    const std::set<std::string> flags = cpuinfo_flags(in);
    const std::vector<CompiledFeature> compiled = ggml_compiled_features();
    const std::vector<std::string> missing = missing_cpu_features(compiled, flags);
    if (missing.empty()) return "";
    std::string names;
    for (const std::string& m : missing) names += (names.empty() ? "" : " ") + m;
    return "this CPU lacks instruction-set extensions the linked llama.cpp (ggml-cpu) was compiled for: " + names +
           " (compiled for: " + compiled_feature_list(compiled) +
           "). The build came from another machine (a copied image or pip's wheel cache); it would die by "
           "SIGILL (illegal instruction). Rebuild it on this machine: pip install --no-cache-dir "
           "--force-reinstall --no-deps llama-cpp-python==0.3.36 (trioserve's own workers are built for generic x86-64 and need no rebuild).";
#else
    (void)cpuinfo_path;
    return "";
#endif
}

}  // namespace trioserve
