// trioserve-executorch-worker: serves an ExecuTorch `.pte` LLM program over the worker
// protocol (spec/worker-protocol.md). The main only builds the engine and runs the worker loop (cpp/loop/).
// Built only when the `executorch` wheel's C++ runtime is found (CMakeLists.txt); it links
// that runtime (libexecutorch*.so) and neither libtorch nor libpython.
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "cli_args.h"
#include "engines/executorch/executorch_engine.h"
#include "loop/worker_loop.h"
#include "worker_flags.h"
#include "worker_process.h"

using namespace trioserve;

static const char* kHelp = R"(usage: trioserve-executorch-worker --model PATH --tokenizer PATH [flags]

Serves an ExecuTorch .pte LLM program (exported by export_llama with a KV cache) over the
trioserve worker protocol (stdin/stdout JSONL; see spec/worker-protocol.md). Logs go to stderr.
The program is loaded once and backs --capacity instances of its forward method, each with its
own KV cache (planned memory): one slot each, scheduled like the llama.cpp worker's (one forward
call per slot per step), with named sessions, spill to host memory and shared prefixes.

  --model PATH          the .pte program (required; --model_path is accepted too)
  --tokenizer PATH      its Hugging Face tokenizer.json (required; --tokenizer_path too). The
                        worker only decodes with it: prompts arrive as token ids, tokenized by
                        the control plane. A tokenizer_config.json in the same directory
                        supplies the chat template and the BOS/EOS texts.
  --ctx N               context window in tokens (default and maximum: the program's
                        max_context_len)
  --threads N           ExecuTorch thread pool size (default: the runtime's choice)
  --capacity N          slots (default 4; --slots too): instances of the forward method on
                        the one loaded program. Each costs its planned memory (KV cache and
                        activations) plus what the XNNPACK delegate keeps per instance; the
                        worker measures that while loading and serves fewer slots when the
                        next one would not fit --memory-budget-bytes (said on stderr and in
                        the ready record's "executorch" object)
  --memory-budget-bytes B
                        memory the extra slots may take together (default: half of
                        MemAvailable at startup, or of what a cgroup v2 memory limit leaves)
  --xnnpack-weight-cache on|off
                        XNNPACK's weight cache (default on): packed weights shared between
                        the instances instead of packed once per instance
  --spill-budget-bytes B
                        host memory for the saved states of named sessions evicted from their
                        slot (default 1 GiB; 0 = evicted sessions are dropped)
  --min-shared-prefix N start a prompt from another slot's or a spilled session's state when
                        it holds at least N more of the prompt's tokens (default 16; 0 = off)
  --prefill-chunk N     largest prefill chunk the scheduler gives one step (default 128; the
                        engine further splits it into the program's max_seq_len)
  --heartbeat-ms MS     while one step has run MS, write a progress record every MS (spec
                        section 4.4; default 0 = none)
  --stream-interval-ms MS  write token records together at most every MS (a generation's
                        first at once; spec section 4.1; default 0 = each at once)
  --batch-tokens N      per-step token budget, decodes and prefill chunks (default: the
                        prefill chunk plus one token per slot)
  --step-target-ms MS   while streams decode, size each step's prefill share so the step
                        takes about MS (as the llama.cpp worker; default 1000 with more than
                        one slot, 0 = off)
  --test-step-delay-ms MS
                        tests only: sleep MS (abortable) before every forward call, so a
                        cancel can be observed inside a prefill or a decode step
  --help                this text

Environment: TRIOSERVE_CANCEL_FD = read end of the cancel pipe (spec section 7).
)";

int main(int argc, char** argv) {
    ExecuTorchConfig cfg;
    long long v = 0;
    // The flags every worker takes (worker_flags.h); this engine has no window cache, step
    // bound or speculation, so those stay unknown flags here.
    WorkerFlags flags;
    std::string weight_cache = "on";
    Args a(argc, argv);
    while (!a.done()) {
        if (a.flag("--help") || a.flag("-h")) { std::fputs(kHelp, stdout); return 0; }
        else if (flags.parse(a, kSlotFlags)) {}
        else if (a.value("--model", cfg.model_path) || a.value("--model_path", cfg.model_path)) {}
        else if (a.value("--tokenizer", cfg.tokenizer_path) || a.value("--tokenizer_path", cfg.tokenizer_path)) {}
        else if (a.int_value("--threads", v, 1)) cfg.n_threads = static_cast<int32_t>(v);
        else if (a.int_value("--slots", v, 1)) flags.capacity = v;  // --capacity's other name
        else if (a.int_value("--memory-budget-bytes", v, 1)) cfg.memory_budget_bytes = static_cast<uint64_t>(v);
        else if (a.value("--xnnpack-weight-cache", weight_cache)) {
            if (weight_cache != "on" && weight_cache != "off") Args::fail("--xnnpack-weight-cache must be on or off");
            cfg.xnnpack_weight_cache = weight_cache == "on";
        }
        else if (a.double_value("--test-step-delay-ms", cfg.test_step_delay_ms)) {}
        else Args::fail("unknown flag " + a.peek());
    }
    if (cfg.model_path.empty()) Args::fail("--model is required");
    if (cfg.tokenizer_path.empty()) Args::fail("--tokenizer is required");
    if (flags.ctx) cfg.n_ctx = *flags.ctx;
    if (flags.capacity) cfg.capacity = *flags.capacity;
    const long long prefill_chunk = flags.prefill_chunk.value_or(128);

    setup_process();
    const int cancel_fd = take_cancel_fd(true);
    ExecuTorchEngine engine(cfg);
    if (!engine.error().empty()) {
        // Startup failure: nothing on stdout, the reason on stderr, non-zero status (spec §3).
        std::fprintf(stderr, "trioserve-executorch-worker: %s\n", engine.error().c_str());
        return 1;
    }
    const ExecuTorchSlotReport& rep = engine.report();
    std::fprintf(stderr,
                 "trioserve-executorch-worker: %lld slot(s) of %lld requested on one load of %s (%.1f MB): "
                 "%.2f MB planned memory per slot, %.2f MB resident per extra slot (XNNPACK weight cache %s), "
                 "state %s\n",
                 static_cast<long long>(rep.capacity), static_cast<long long>(rep.requested), cfg.model_path.c_str(),
                 rep.program_bytes / 1e6, rep.planned_bytes_per_slot / 1e6, rep.bytes_per_extra_slot / 1e6,
                 cfg.xnnpack_weight_cache ? "on" : "off", rep.state_layout.c_str());
    char hash[17];
    std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(rep.program_hash));
    nlohmann::json et = {{"slots_requested", rep.requested},
                         {"capacity", rep.capacity},
                         {"program_bytes", rep.program_bytes},
                         {"program_hash", hash},
                         {"planned_bytes_per_slot", rep.planned_bytes_per_slot},
                         {"first_slot_bytes", rep.first_slot_bytes},
                         {"bytes_per_extra_slot", rep.bytes_per_extra_slot},
                         {"memory_budget_bytes", rep.memory_budget_bytes},
                         {"weights_duplicated", rep.weights_duplicated},
                         {"xnnpack_weight_cache", cfg.xnnpack_weight_cache},
                         {"state_layout", rep.state_layout},
                         {"capped", rep.capped_reason.empty() ? nlohmann::json(nullptr) : nlohmann::json(rep.capped_reason)}};
    CancelController cancel;
    FdSink sink(1);
    WorkerOptions opts;
    flags.apply(opts);
    // A state store drains its writes when stdin closes (worker_process.h, spec §6.4).
    if (!opts.state_dir.empty()) g_exit_grace_ms.store(10000);
    opts.prefill_chunk = static_cast<size_t>(prefill_chunk);
    opts.batch_tokens = static_cast<size_t>(flags.batch_tokens.value_or(prefill_chunk + rep.capacity));
    // As the llama.cpp worker on CPU: with other streams decoding, a long prompt's prefill is
    // paced so they are not stalled; one slot has no other stream to keep smooth.
    opts.step_target_ms = flags.step_target_ms ? *flags.step_target_ms : (rep.capacity > 1 ? 1000.0 : 0.0);
    // --heartbeat-ms (flags.apply): progress records carry the step's composition and time;
    // the engine counts no work inside a step (Engine::work_done() is 0), so a long step is
    // judged by the parent's stall and health timeouts as before (spec §4.4).
    opts.supports_cancel = cancel_fd >= 0;
    opts.ready_extra = {{"executorch", et}};
    int rc = 0;
    {
        WorkerLoop loop(engine, cancel, sink, opts);
        // Declared after the loop: its thread is joined before the loop goes, so no cancel
        // frame arrives while the loop is destroyed.
        ProcessWatcher watcher(cancel, cancel_fd);
        loop.write_ready();
        rc = loop.run(0);
    }  // the loop (and every sampler) goes before the engine
    return rc;
}
