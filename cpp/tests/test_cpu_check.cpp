// Unit tests for cpu_check.h: the CPU backend's reported features against /proc/cpuinfo flags,
// for a linked build and for a run-time-selected variant.
#include "check.h"
#include "cpu_check.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include <unistd.h>

using namespace trioserve;

static std::string write_cpuinfo(const std::string& flags) {
    char path[] = "/tmp/trioserve-cpuinfo-XXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    std::ofstream(path) << "processor\t: 0\nflags\t\t: " << flags << "\n\nprocessor\t: 1\nflags\t\t: " << flags << "\n";
    return path;
}

int main() {
    {   // only the named x86 extensions count; OPENMP/REPACK and unknown names are not CPU flags
        const auto table = ggml_compiled_features({"AVX", "AVX2", "FMA", "OPENMP", "REPACK", "NEON"});
        CHECK_EQ(compiled_feature_list(table), std::string("AVX AVX2 FMA"));
    }
    {   // cpuinfo: the first flags line, split on blanks
        std::istringstream in("processor : 0\nflags\t\t: fpu sse2 avx2\nflags : other\n");
        const auto flags = cpuinfo_flags(in);
        CHECK(flags.count("avx2") == 1 && flags.count("other") == 0 && flags.size() == 3);
        std::istringstream none("processor : 0\n");
        CHECK(cpuinfo_flags(none).empty());
    }
    {   // SSE3 is "pni" in cpuinfo; no flags at all means "cannot tell"
        const auto table = ggml_compiled_features({"SSE3", "AVX512"});
        CHECK(missing_cpu_features(table, {"pni", "avx512f"}).empty());
        CHECK_EQ(missing_cpu_features(table, {"pni"}), std::vector<std::string>{"AVX512"});
        CHECK(missing_cpu_features(table, {}).empty());
    }
#if defined(__x86_64__) || defined(__i386__)
    const std::string avx2_only = write_cpuinfo("fpu sse2 pni ssse3 avx avx2 fma f16c bmi2");
    {   // a haswell-class variant on an AVX2 CPU passes
        CHECK_EQ(check_cpu_features(avx2_only, {"SSE3", "AVX", "AVX2", "FMA", "F16C", "BMI2", "OPENMP"}, "haswell"),
                 std::string());
    }
    {   // a linked AVX-512 build on an AVX2 CPU: refused, with the rebuild command
        const std::string msg = check_cpu_features(avx2_only, {"AVX2", "AVX512", "AVX512_VNNI"}, "");
        CHECK(msg.find("the linked llama.cpp (ggml-cpu) was compiled for: AVX512 AVX512_VNNI (compiled for: AVX2 AVX512 AVX512_VNNI)") != std::string::npos);
        CHECK(msg.find("pip install --no-cache-dir") != std::string::npos);
    }
    {   // a run-time-selected variant the kernel does not back: refused, naming the variant
        const std::string msg = check_cpu_features(avx2_only, {"AVX2", "AVX512"}, "skylakex");
        CHECK(msg.find("selected for it (variant skylakex): AVX512 (compiled for: AVX2 AVX512)") != std::string::npos);
        CHECK(msg.find("pip install") == std::string::npos);
    }
    std::remove(avx2_only.c_str());
#endif
    return trioserve_test::finish("test_cpu_check");
}
