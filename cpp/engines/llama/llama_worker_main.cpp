// trioserve-llama-worker: serves a GGUF model through llama.cpp over the worker protocol
// (spec/worker-protocol.md). The main only builds the engine and runs the worker loop (cpp/loop/).
//
// Why --capacity defaults to 4: the reference host is a 2-core CPU machine serving small
// models, where a step's cost grows with the tokens in it, so more than a few concurrent
// streams only slows each of them; and the KV memory of 4 x n_ctx for a small model is small
// (SmolLM2-135M: ~90 MiB per 4096-token slot at f16). On a GPU a batch of 8-32 streams costs
// little more than one, so raise it there (spec section 10).
#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>

#include <unistd.h>

#include "cli_args.h"
#include "cpu_backend.h"
#include "cpu_check.h"
#include "engines/llama/kernel_path.h"
#include "engines/llama/llama_engine.h"
#include "engines/llama/probe_memory.h"
#include "swa_cache.h"
#include "loop/worker_loop.h"
#include "worker_flags.h"
#include "worker_process.h"

using namespace trioserve;

static const char* kHelp = R"(usage: trioserve-llama-worker --model PATH [flags]

Serves a GGUF model through llama.cpp over the trioserve worker protocol
(stdin/stdout JSONL; see spec/worker-protocol.md). Logs go to stderr.

  --model PATH          GGUF file (required)
  --ctx N               context window per slot in tokens (default 0 = the model's training
                        context, lowered when capacity x ctx KV cells do not fit
                        --kv-budget-bytes; an explicit N is capped at the training context)
  --kv-budget-bytes N   memory for the KV cache of all slots when --ctx is 0 (default: a
                        quarter of physical memory); the choice is reported on stderr
  --swa-cache MODE      sliding-window models only: full (the window layers keep n_ctx
                        cells per slot, every position reachable), checkpoints (only the
                        last window + a batch of cells; older positions come back from
                        checkpoints saved at turn boundaries) or auto (default: full when
                        capacity x ctx cells of every layer at full size fit the KV budget);
                        the choice and the full-size cache's memory are reported on stderr
  --swa-checkpoints N   checkpoints kept per slot with the small window cache (default 4;
                        0 = none: a prompt diverging before the window prefills from zero)
  --kv-cache-type T     K and V cache element type: f16 (default), q8_0 (17/32 of f16's
                        memory) or q4_0 (9/32); a quantized type turns flash attention on
  --flash-attn MODE     auto (default: on for a quantized cache or --speculative auto;
                        else off on a CPU while the attention matrix it then needs stays
                        within 1 GiB, else on; llama.cpp decides with --gpu-layers), on or
                        off (off with a quantized cache: startup failure); the choice is
                        reported on stderr and in the ready record (kernel_path.flash_attention)
  --threads N           CPU threads for decode and prefill (default: all hardware threads)
  --gpu-layers N        layers to offload to a GPU (needs a CUDA/Metal build of llama.cpp;
                        -1 = all; default 0)
  --capacity N          slots = generations decoded together in one batch (llama.cpp
                        sequences of one context, each with --ctx tokens of KV); named
                        sessions bind at most N-1 of them (default 4: sized for small CPU
                        hosts; use 8 or more on a GPU)
  --spill-budget-bytes N host memory for the states of evicted named sessions (default
                        1 GiB; 0 = drop evicted sessions)
  --min-shared-prefix N start a prompt from another slot's or a spilled session's state
                        when that holds at least N more of its prefix than its own slot
                        (copied, then trimmed to the shared prefix; default 16; 0 = never
                        share across slots; spec section 6.2)
  --batch-tokens N      per-step token budget: every decoding stream's token first, then
                        prefill chunks of starting generations FIFO (default 512)
  --prefill-chunk N     largest prefill chunk of one generation in one step (default 512)
  --speculative MODE    auto | off (default off): exact self-speculative decoding (drafts
                        from the request's own tokens and a global index of recent outputs,
                        verified in the shared step when the step cost model, measured at
                        start-up, says it pays); off where a start-up check finds a verify
                        step not bit-identical to plain decoding (ready record off_reason);
                        spec/worker-protocol.md §4.6
  --draft-max N         most draft tokens of one generation per step (default 12)
  --global-draft-tokens N  ids the global draft index keeps (default 262144, ~5 MiB; 0 = none)
  --log-drafts          the chosen draft lengths to stderr (also with --verbose)
  --measure-step-cost   measure the step costs at start also with speculation off (the ready
                        record's speculative.step_cost_ms; benchmarks: adds start-up time)
  --step-cost-ms LIST   a fixed step cost model "TOKENS:MS,…" (ms of one decode step of that
                        many tokens) instead of the start-up measurement; a flat one ("1:1,64:1")
                        drafts whenever a draft exists (exactness tests)
  --step-target-ms MS   while streams decode, size each step's prefill share so the step
                        takes about MS (measured rate; at least 16 prompt tokens a step), so
                        admitting a long prompt does not stall them for several seconds;
                        0 = off (default 1000 on CPU: on the reference 2-core host it cut the
                        stall from ~5 s to ~1.3 s for a 20-45% longer long-prompt TTFT; smaller
                        targets trade more prompt TTFT for smoother streams; 0 with
                        --gpu-layers, where a full budget takes milliseconds)
  --heartbeat-ms MS     while one step has run MS, write a progress record every MS with the
                        graph nodes computed so far, so a parent can tell a slow step from
                        a stuck one (spec section 4.4; default 0 = none; trioserve asks for
                        them)
  --stream-interval-ms MS  write token records together at most every MS, so the parent
                        wakes once for several tokens (a generation's first at once; spec
                        section 4.1; default 0 = each at once)
  --max-step-ms MS      shrink the prompt tokens per step (--batch-tokens >> k, at least 64)
                        while a step carrying prefill takes longer than MS, e.g. on a CPU
                        shared with other work; grow them back when steps are fast again
                        (default 0 = fixed pieces, the same boundaries whatever the load;
                        trioserve passes 5000)
  --cpu-extra-buffers M whether llama.cpp may put weights in the CPU's extra buffer types
                        (CPU_REPACK, AMX: faster kernels; AMX crashes on some Xeons, llama.cpp
                        issue #20824): auto (default) = verify them first in a short-lived probe
                        process; if it fails and AMX was offered, probe the best variant without
                        AMX (CPU_REPACK alone) and switch to it when it passes; otherwise load
                        without extra types (spec/worker-protocol.md §10); on = use them without
                        a probe; off = never. Every mode runs the warm-up (a short prefill + 4
                        decode steps) before the ready record.
  --probe-timeout-s S   longest wait for one probe, seconds (default 120: well inside the
                        server's 300 s ready timeout); past it the probe is killed and counts
                        as failed
  --probe-memory DIR    remember probes that passed in DIR (one small file per key, the newest
                        256 kept) and skip the probe when this machine, these binaries, the model
                        and the settings that decide the kernels are unchanged: the ready record
                        says probe_remembered (spec/worker-protocol.md §10). Failures are never
                        remembered; an unusable DIR just means the probe runs. Not consulted with
                        --test-probe-fault or --test-extra-buffer-types (default: off; trioserve
                        passes ~/.cache/trioserve/kernel-probes)
  --kernel-path-only    choose the kernel path as above (probes included), print it as one JSON
                        object on stdout ({"cpu_variant", "extra_buffers_enabled", ...}) and exit
                        0: how tests and benchmarks run other llama.cpp programs on the kernels
                        the worker would run
  --deterministic       outputs that do not depend on the batch (spec/worker-protocol.md §4.5):
                        prompts are prefilled in pieces of 64 tokens on a fixed grid of
                        positions, each slot's tokens of a step are computed on their own
                        (no batching across slots), and only prefixes computed
                        in whole pieces are reused (a turn's reply and its last partial piece
                        are computed again next turn). A generation's tokens then equal a cold
                        run's, whatever else runs, on the same CPU kernels and thread count.
                        Costs throughput with several streams (docs/benchmarks.md)
  --cpu-variant NAME    load the CPU kernels libggml-cpu-NAME.so (haswell, skylakex, zen4, ...)
                        instead of the ones ggml picks for this CPU (a build with run-time-
                        selected kernels only; one this CPU cannot run is refused); also
                        $TRIOSERVE_CPU_VARIANT. Tests run the kernels other machines pick this way
  --verbose             forward llama.cpp info logs (and its abort messages) to stderr
  --help                this text

Test only (fault injection; never in production):
  --test-probe-fault F[@VARIANT]  a probe dies as it starts, before it loads or runs any
                        kernel (so the outcome is the injected one on every CPU): sigill =
                        raise(SIGILL), sigsegv = raise(SIGSEGV), exit = exit status 1, hang =
                        never returns (so --probe-timeout-s kills it); with @VARIANT only the
                        probe of that CPU variant does
  --test-extra-buffer-types LIST  pretend the selected CPU variant offers these extra buffer
                        types (comma-separated, e.g. AMX,CPU_REPACK) when choosing the kernel
                        path: with --test-probe-fault sigill@VARIANT it plays an AMX fault on a
                        CPU without AMX
  --test-cpuinfo FILE   read the CPU's flags from FILE instead of /proc/cpuinfo

Exit status 3 = this CPU lacks instruction-set extensions the linked llama.cpp was compiled
for (a build copied from another machine): rebuilding on this machine is the only remedy.

Environment: TRIOSERVE_CANCEL_FD = read end of the cancel pipe (spec section 7);
TRIOSERVE_CPU_VARIANT = as --cpu-variant (the flag wins).
)";

/// Exit status of a worker that refuses to start on this CPU (spec §3); restarting cannot help.
constexpr int kExitIncompatibleCpu = 3;
constexpr int kWarmupDecodeSteps = 4;
/// --deterministic's prefill grid: small enough that a shared prefix loses at most 63 tokens to
/// the grid, large enough that a piece still runs the batched (matrix-matrix) kernels.
constexpr int64_t kDeterministicGrid = 64;

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// The probe process (--probe): load WITH extra buffer types, warm up, exit 0 (1 on failure).
/// A broken kernel kills it by a signal instead; the worker sees that in its exit status.
/// An injected fault (`kind`, test only) happens first, before any kernel runs.
int run_as_probe(LlamaConfig cfg, const std::string& kind) {
    if (kind == "sigill") std::raise(SIGILL);
    if (kind == "sigsegv") std::raise(SIGSEGV);
    if (kind == "exit") std::_Exit(1);
    if (kind == "hang") for (;;) pause();  // a kernel that never returns: the timeout ends it
    cfg.use_extra_bufts = true;
    LlamaEngine engine(cfg);
    if (!engine.error().empty()) {
        std::fprintf(stderr, "trioserve-llama-worker probe: %s\n", engine.error().c_str());
        return 1;
    }
    if (const std::string failure = engine.warm_up(kWarmupDecodeSteps); !failure.empty()) {
        std::fprintf(stderr, "trioserve-llama-worker probe: %s\n", failure.c_str());
        return 1;
    }
    return 0;
}

/// The fault a --test-probe-fault "KIND[@VARIANT]" injects into the probe of `variant`: KIND,
/// or "" when it names another variant.
std::string injected_fault(const std::string& spec, const std::string& variant) {
    const size_t at = spec.find('@');
    if (at == std::string::npos) return spec;
    return spec.substr(at + 1) == variant ? spec.substr(0, at) : std::string();
}

std::vector<std::string> split_commas(const std::string& list) {
    std::vector<std::string> out;
    size_t at = 0;
    while (at <= list.size()) {
        size_t end = list.find(',', at);
        if (end == std::string::npos) end = list.size();
        if (end > at) out.push_back(list.substr(at, end - at));
        at = end + 1;
    }
    return out;
}

std::string join(const std::vector<std::string>& v) {
    std::string out;
    for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
    return out.empty() ? "none" : out;
}

}  // namespace

int main(int argc, char** argv) {
    LlamaConfig cfg;
    std::string extra_mode = "auto";
    std::string probe_fault;
    std::string cpuinfo_path = "/proc/cpuinfo";
    bool probe_mode = false, kernel_path_only = false;
    std::string pretend_offered;
    double probe_timeout_s = 120;
    std::string probe_memory_dir;  // "" = off
    long long v = 0;
    WorkerFlags flags;  // the flags every worker takes (worker_flags.h)
    std::string fa_mode;
    std::string cpu_variant;
    std::string step_cost;
    std::vector<std::pair<size_t, double>> cost_points;
    Args a(argc, argv);
    while (!a.done()) {
        if (a.flag("--help") || a.flag("-h")) { std::fputs(kHelp, stdout); return 0; }
        else if (flags.parse(a, kAllWorkerFlags)) {}
        else if (a.value("--flash-attn", fa_mode)) {
            if (!parse_flash_attn_mode(fa_mode, cfg.flash_attn)) Args::fail("--flash-attn must be auto, on or off");
        }
        else if (a.value("--model", cfg.model_path)) {}
        else if (a.int_value("--kv-budget-bytes", v, 1)) cfg.kv_budget_bytes = static_cast<uint64_t>(v);
        else if (a.int_value("--threads", v, 1)) cfg.n_threads = static_cast<int32_t>(v);
        else if (a.int_value("--gpu-layers", v, -1)) cfg.n_gpu_layers = static_cast<int32_t>(v);
        else if (a.flag("--verbose")) cfg.verbose = true;
        else if (a.flag("--deterministic")) cfg.deterministic = true;
        else if (a.value("--cpu-variant", cpu_variant)) {
            if (cpu_variant.empty()) Args::fail("--cpu-variant needs a variant name");
        }
        else if (a.value("--step-cost-ms", step_cost)) {
            // "TOKENS:MS,…": a fixed step cost model instead of the start-up measurement
            size_t at = 0;
            while (at < step_cost.size()) {
                size_t end = step_cost.find(',', at);
                if (end == std::string::npos) end = step_cost.size();
                const std::string part = step_cost.substr(at, end - at);
                char* e = nullptr;
                const unsigned long long n = std::strtoull(part.c_str(), &e, 10);
                if (e == part.c_str() || *e != ':' || n == 0) Args::fail("--step-cost-ms entries are TOKENS:MS");
                const double ms = std::strtod(e + 1, &e);
                if (*e != '\0' || !(ms > 0)) Args::fail("--step-cost-ms entries are TOKENS:MS with MS > 0");
                cost_points.emplace_back(static_cast<size_t>(n), ms);
                at = end + 1;
            }
        }
        else if (a.value("--cpu-extra-buffers", extra_mode)) {
            if (extra_mode != "auto" && extra_mode != "on" && extra_mode != "off")
                Args::fail("--cpu-extra-buffers must be auto, on or off");
        }
        else if (a.double_value("--probe-timeout-s", probe_timeout_s)) {}
        else if (a.value("--probe-memory", probe_memory_dir)) {}
        else if (a.flag("--probe")) probe_mode = true;
        else if (a.flag("--kernel-path-only")) kernel_path_only = true;
        else if (a.value("--test-probe-fault", probe_fault)) {
            const std::string kind = probe_fault.substr(0, probe_fault.find('@'));
            if (kind != "sigill" && kind != "sigsegv" && kind != "exit" && kind != "hang")
                Args::fail("--test-probe-fault must be sigill, sigsegv, exit or hang, optionally @VARIANT");
        }
        else if (a.value("--test-extra-buffer-types", pretend_offered)) {}
        else if (a.value("--test-cpuinfo", cpuinfo_path)) {}
        else Args::fail("unknown flag " + a.peek());
    }
    if (cfg.model_path.empty()) Args::fail("--model is required");
    if (flags.ctx) cfg.n_ctx = *flags.ctx;
    if (flags.capacity) cfg.capacity = *flags.capacity;
    if (flags.prefill_chunk) cfg.prefill_chunk = *flags.prefill_chunk;
    if (flags.batch_tokens) cfg.batch_tokens = *flags.batch_tokens;
    cfg.swa_cache = flags.swa_cache;
    cfg.kv_cache_type = flags.kv_cache_type;
    cfg.speculative = flags.speculative;
    const bool chunk_given = flags.prefill_chunk.has_value(), batch_given = flags.batch_tokens.has_value();
    if (cfg.deterministic) {
        // Never silently changed: settings that would break the grid are refused.
        cfg.prefill_grid = kDeterministicGrid;
        if (chunk_given && cfg.prefill_chunk % kDeterministicGrid != 0)
            Args::fail("--deterministic needs --prefill-chunk to be a multiple of " + std::to_string(kDeterministicGrid));
        if (batch_given && cfg.batch_tokens < kDeterministicGrid)
            Args::fail("--deterministic needs --batch-tokens >= " + std::to_string(kDeterministicGrid));
    }
    // The flag wins over the environment; set there, the engine's own check and the probe
    // process (same environment) load the same variant.
    if (!cpu_variant.empty()) ::setenv("TRIOSERVE_CPU_VARIANT", cpu_variant.c_str(), 1);

    setup_process();
    install_llama_log(cfg.verbose);  // before the CPU module loads: its INFO line is verbose-only
    const auto t_start = std::chrono::steady_clock::now();
    // A build with run-time-selected CPU kernels has no CPU backend until one is loaded; a build
    // for another CPU would die by SIGILL on its first matrix multiply: refuse first.
    const CpuBackendInfo selected_backend = ensure_cpu_backend();
    if (!selected_backend.error.empty()) {
        std::fprintf(stderr, "trioserve-llama-worker: %s\n", selected_backend.error.c_str());
        return 1;
    }
    if (const std::string bad = check_cpu_features(cpuinfo_path, selected_backend.features, selected_backend.variant);
        !bad.empty()) {
        std::fprintf(stderr, "trioserve-llama-worker: %s\n", bad.c_str());
        return kExitIncompatibleCpu;
    }
    if (probe_mode) {
        install_llama_log(cfg.verbose);
        return run_as_probe(cfg, injected_fault(probe_fault, selected_backend.variant));
    }
    const int cancel_fd = take_cancel_fd(true);  // close-on-exec from here: the probe never has it
    install_llama_log(cfg.verbose);

    // Choose the kernel path (kernel_path.h): probe the extra buffer types in child processes
    // where a crash costs nothing, before this process loads anything.
    CpuBackendInfo cpu_backend = selected_backend;
    std::vector<std::string> offered = cfg.n_gpu_layers == 0 ? cpu_extra_buffer_types() : std::vector<std::string>{};
    if (!pretend_offered.empty()) offered = split_commas(pretend_offered);
    ProbeSettings probe;
    probe.worker_exe = "/proc/self/exe";
    probe.model_path = cfg.model_path;
    probe.threads = cfg.n_threads;
    probe.kv_cache_type = kv_cache_type_name(cfg.kv_cache_type);  // a quantized cache's flash attention
    probe.flash_attn = fa_mode;
    probe.cpuinfo_path = cpuinfo_path != "/proc/cpuinfo" ? cpuinfo_path : "";
    probe.fault = probe_fault;
    probe.timeout_s = probe_timeout_s;
    probe.verbose = cfg.verbose;
    // A remembered pass skips the probe process (probe_memory.h); never for the fault-injection
    // tests, which must see their probe fail.
    ProbeMemoryKey memory_key{cfg.model_path, cpuinfo_path, probe.kv_cache_type, fa_mode, offered};
    const bool use_memory = probe_fault.empty() && pretend_offered.empty();
    const ProbeLauncher launcher = remembering(probe_launcher(probe), use_memory ? probe_memory_dir : "", memory_key);
    const KernelPath chosen = choose_kernel_path(cpu_backend, extra_mode, offered, launcher);
    if (!chosen.error.empty()) {
        std::fprintf(stderr, "trioserve-llama-worker: %s\n", chosen.error.c_str());
        return 1;
    }
    cfg.use_extra_bufts = chosen.use_extra_bufts();
    json kernel_path = kernel_path_json(chosen);
    kernel_path["cpu_backend"] = cpu_backend.kind;
    kernel_path["cpu_features"] = cpu_backend.features;
    if (!cpu_backend.variant.empty()) kernel_path["cpu_variant"] = cpu_backend.variant;
    kernel_path["cpu_variant_forced"] = cpu_backend.forced;
    kernel_path["cpu_variants_present"] = cpu_variants_present();
    if (chosen.fell_back())
        std::fprintf(stderr, "trioserve-llama-worker: kernel probe: %s\n", kernel_path_summary(chosen).c_str());
    if (kernel_path_only) {
        std::printf("%s\n", kernel_path.dump().c_str());
        return 0;
    }

    LlamaEngine engine(cfg);
    if (!engine.error().empty()) {
        // Startup failure: nothing on stdout, the reason on stderr, non-zero status (spec §3).
        std::fprintf(stderr, "trioserve-llama-worker: %s\n", engine.error().c_str());
        return 1;
    }
    kernel_path["weight_buffers"] = llama_log::weight_buffers;
    kernel_path["flash_attention"] = flash_attn_mode_name(engine.flash_attn());
    const auto t_warm = std::chrono::steady_clock::now();
    // A probe that passed (now, or remembered for these binaries, CPU, model and settings) ran
    // the full warm-up on exactly the kernels this process loaded: running it again costs a
    // ~40-token prefill (~2 s at 4B on 2 cores) and checks nothing new. One token still checks
    // this process's logits are finite before the ready record.
    const bool probed = chosen.probed();
    const std::string failure = probed ? engine.warm_up(0, 1) : engine.warm_up(kWarmupDecodeSteps);
    if (!failure.empty()) {
        std::fprintf(stderr, "trioserve-llama-worker: the start-up warm-up failed: %s\n", failure.c_str());
        return 1;
    }
    kernel_path["warmup"] = probed ? "one token (the probe ran the kernels)" : "full";
    kernel_path["warmup_ms"] = std::round(ms_since(t_warm));
    kernel_path["startup_ms"] = std::round(ms_since(t_start));
    std::fprintf(stderr,
                 "trioserve-llama-worker: kernel path verified: CPU kernels %s; extra buffer types %s (setting %s, "
                 "offered: %s; probe %s; %s); weights in %s; warm-up (%s) %.0f ms, start-up %.0f ms\n",
                 cpu_backend.variant.empty() ? "linked"
                 : (std::string(cpu_backend.forced ? "forced" : "selected at run time") + ": " + cpu_backend.variant).c_str(),
                 chosen.use_extra_bufts() ? "on" : "off", extra_mode.c_str(), join(offered).c_str(),
                 (kernel_path["probe"].get<std::string>() + (kernel_path["probe_remembered"].get<bool>() ? " (remembered)" : "")).c_str(),
                 kernel_path_summary(chosen).c_str(),
                 join(llama_log::weight_buffers).c_str(), kernel_path["warmup"].get<std::string>().c_str(),
                 kernel_path["warmup_ms"].get<double>(), kernel_path["startup_ms"].get<double>());
    CancelController cancel;
    FdSink sink(1);
    WorkerOptions opts;
    flags.apply(opts);
    // A state store drains its writes when stdin closes (worker_process.h, spec §6.4).
    if (!opts.state_dir.empty()) g_exit_grace_ms.store(10000);
    opts.prefill_chunk = static_cast<size_t>(cfg.prefill_chunk);
    opts.batch_tokens = static_cast<size_t>(cfg.batch_tokens);
    // Unset: the default for the device (see --help).
    opts.step_target_ms = flags.step_target_ms ? *flags.step_target_ms : (cfg.n_gpu_layers == 0 ? 1000.0 : 0.0);
    // ggml's CPU flash attention runs a micro-batch of at least 64 queries (GGML_FA_TILE_Q)
    // through its tiled kernel and a smaller one a query at a time: 2-3x the time per prompt
    // token at a 4k context (SmolLM2-135M, 1 thread: ~28 vs ~12 ms). With per-sequence KV
    // streams llama.cpp's equal split puts one prompt token in the micro-batch of the decodes,
    // so a paced chunk of 65 keeps the rest on the tiled kernel (StepPacer). Without flash
    // attention there is no such threshold (a matrix product over the KV cache costs about the
    // same per query at any batch), and 65 would only make paced steps longer.
    if (cfg.n_gpu_layers == 0 && engine.flash_attn() != FlashAttnMode::off) opts.efficient_prefill = 65;
    opts.supports_cancel = cancel_fd >= 0;
    opts.ready_extra = {{"kernel_path", kernel_path}};
    opts.prefill_grid = cfg.deterministic ? static_cast<size_t>(cfg.prefill_grid) : 0;
    opts.log_drafts = flags.log_drafts || cfg.verbose;
    opts.step_cost = cost_points;
    int rc = 0;
    {
        WorkerLoop loop(engine, cancel, sink, opts);
        // Declared after the loop: its thread is joined before the loop goes, so no cancel
        // frame arrives while the loop is destroyed (the controller keeps flags alive anyway).
        ProcessWatcher watcher(cancel, cancel_fd);
        loop.calibrate_speculation();  // the step cost model, measured here (speculation.h)
        loop.write_ready();
        rc = loop.run(0);
    }  // the loop (and every sampler) goes before the engine
    return rc;
}
