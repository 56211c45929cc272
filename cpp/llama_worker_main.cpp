// trioserve-llama-worker: serves a GGUF model through llama.cpp over the worker protocol
// (spec/worker-protocol.md). The main only builds the engine and runs worker_loop.h.
//
// Why --capacity defaults to 4: the reference host is a 2-core CPU machine serving small
// models, where a step's cost grows with the tokens in it, so more than a few concurrent
// streams only slows each of them; and the KV memory of 4 x n_ctx for a small model is small
// (SmolLM2-135M: ~90 MiB per 4096-token slot at f16). On a GPU a batch of 8-32 streams costs
// little more than one, so raise it there (spec section 10).
#include <cstdio>
#include <string>

#include "cli_args.h"
#include "llama_engine.h"
#include "worker_loop.h"
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
  --step-target-ms MS   while streams decode, size each step's prefill share so the step
                        takes about MS (measured rate; at least 16 prompt tokens a step), so
                        admitting a long prompt does not stall them for several seconds;
                        0 = off (default 1000 on CPU: on the reference 2-core host it cut the
                        stall from ~5 s to ~1.3 s for a 20-45% longer long-prompt TTFT; smaller
                        targets trade more prompt TTFT for smoother streams; 0 with
                        --gpu-layers, where a full budget takes milliseconds)
  --verbose             forward llama.cpp info logs (and its abort messages) to stderr
  --help                this text

Environment: TRIOSERVE_CANCEL_FD = read end of the cancel pipe (spec section 7).
)";

int main(int argc, char** argv) {
    LlamaConfig cfg;
    long long v = 0;
    long long spill_budget = 1LL << 30, min_shared_prefix = 16;
    double step_target_ms = -1;  // -1 = the default for the device (see --help)
    Args a(argc, argv);
    while (!a.done()) {
        if (a.flag("--help") || a.flag("-h")) { std::fputs(kHelp, stdout); return 0; }
        else if (a.value("--model", cfg.model_path)) {}
        else if (a.int_value("--ctx", v, 0)) cfg.n_ctx = v;
        else if (a.int_value("--kv-budget-bytes", v, 1)) cfg.kv_budget_bytes = static_cast<uint64_t>(v);
        else if (a.int_value("--threads", v, 1)) cfg.n_threads = static_cast<int32_t>(v);
        else if (a.int_value("--gpu-layers", v, -1)) cfg.n_gpu_layers = static_cast<int32_t>(v);
        else if (a.int_value("--capacity", v, 1)) cfg.capacity = v;
        else if (a.int_value("--prefill-chunk", v, 1)) cfg.prefill_chunk = v;
        else if (a.int_value("--spill-budget-bytes", spill_budget, 0)) {}
        else if (a.int_value("--batch-tokens", v, 1)) cfg.batch_tokens = v;
        else if (a.int_value("--min-shared-prefix", min_shared_prefix, 0)) {}
        else if (a.double_value("--step-target-ms", step_target_ms)) {}
        else if (a.flag("--verbose")) cfg.verbose = true;
        else Args::fail("unknown flag " + a.peek());
    }
    if (cfg.model_path.empty()) Args::fail("--model is required");

    setup_process();
    const int cancel_fd = take_cancel_fd(true);
    install_llama_log(cfg.verbose);
    LlamaEngine engine(cfg);
    if (!engine.error().empty()) {
        // Startup failure: nothing on stdout, the reason on stderr, non-zero status (spec §3).
        std::fprintf(stderr, "trioserve-llama-worker: %s\n", engine.error().c_str());
        return 1;
    }
    CancelController cancel;
    FdSink sink(1);
    WorkerOptions opts;
    opts.prefill_chunk = static_cast<size_t>(cfg.prefill_chunk);
    opts.batch_tokens = static_cast<size_t>(cfg.batch_tokens);
    opts.step_target_ms = step_target_ms >= 0 ? step_target_ms : (cfg.n_gpu_layers == 0 ? 1000.0 : 0.0);
    opts.supports_cancel = cancel_fd >= 0;
    opts.spill_budget_bytes = static_cast<uint64_t>(spill_budget);
    opts.min_shared_prefix = static_cast<size_t>(min_shared_prefix);
    int rc = 0;
    {
        WorkerLoop loop(engine, cancel, sink, opts);
        // Declared after the loop: its thread is joined before the loop goes, so no cancel
        // frame arrives while the loop is destroyed (the controller keeps flags alive anyway).
        ProcessWatcher watcher(cancel, cancel_fd);
        loop.write_ready();
        rc = loop.run(0);
    }  // the loop (and every sampler) goes before the engine
    return rc;
}
