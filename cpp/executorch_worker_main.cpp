// trioserve-executorch-worker: serves an ExecuTorch `.pte` LLM program over the worker
// protocol (spec/worker-protocol.md). The main only builds the engine and runs worker_loop.h.
// Built only when the `executorch` wheel's C++ runtime is found (CMakeLists.txt); it links
// that runtime (libexecutorch*.so) and neither libtorch nor libpython.
#include <cstdio>
#include <string>

#include "cli_args.h"
#include "executorch_engine.h"
#include "worker_loop.h"
#include "worker_process.h"

using namespace trioserve;

static const char* kHelp = R"(usage: trioserve-executorch-worker --model PATH --tokenizer PATH [flags]

Serves an ExecuTorch .pte LLM program (exported by export_llama with a KV cache) over the
trioserve worker protocol (stdin/stdout JSONL; see spec/worker-protocol.md). Logs go to stderr.
The program has one KV cache, so the worker hosts ONE slot (capacity 1): one generation at a
time, warm append-only resume of the slot's conversation, no named sessions.

  --model PATH          the .pte program (required; --model_path is accepted too)
  --tokenizer PATH      its Hugging Face tokenizer.json (required; --tokenizer_path too). The
                        worker only decodes with it: prompts arrive as token ids, tokenized by
                        the control plane. A tokenizer_config.json in the same directory
                        supplies the chat template and the BOS/EOS texts.
  --ctx N               context window in tokens (default and maximum: the program's
                        max_context_len)
  --threads N           ExecuTorch thread pool size (default: the runtime's choice)
  --capacity N          must be 1 (accepted so launchers can pass it uniformly)
  --prefill-chunk N     largest prefill chunk the scheduler gives one step (default 128; the
                        engine further splits it into the program's max_seq_len)
  --heartbeat-ms MS     while one step has run MS, write a progress record every MS (spec
                        section 4.4; default 0 = none)
  --test-step-delay-ms MS
                        tests only: sleep MS (abortable) before every forward call, so a
                        cancel can be observed inside a prefill or a decode step
  --help                this text

Environment: TRIOSERVE_CANCEL_FD = read end of the cancel pipe (spec section 7).
)";

int main(int argc, char** argv) {
    ExecuTorchConfig cfg;
    long long v = 0;
    long long prefill_chunk = 128;
    double heartbeat_ms = 0;
    Args a(argc, argv);
    while (!a.done()) {
        if (a.flag("--help") || a.flag("-h")) { std::fputs(kHelp, stdout); return 0; }
        else if (a.value("--model", cfg.model_path) || a.value("--model_path", cfg.model_path)) {}
        else if (a.value("--tokenizer", cfg.tokenizer_path) || a.value("--tokenizer_path", cfg.tokenizer_path)) {}
        else if (a.int_value("--ctx", v, 0)) cfg.n_ctx = v;
        else if (a.int_value("--threads", v, 1)) cfg.n_threads = static_cast<int32_t>(v);
        else if (a.int_value("--capacity", v, 1)) {
            if (v != 1) Args::fail("--capacity must be 1: an ExecuTorch program has one KV cache");
        }
        else if (a.int_value("--prefill-chunk", prefill_chunk, 1)) {}
        else if (a.double_value("--test-step-delay-ms", cfg.test_step_delay_ms)) {}
        else if (a.double_value("--heartbeat-ms", heartbeat_ms)) {}
        else Args::fail("unknown flag " + a.peek());
    }
    if (cfg.model_path.empty()) Args::fail("--model is required");
    if (cfg.tokenizer_path.empty()) Args::fail("--tokenizer is required");

    setup_process();
    const int cancel_fd = take_cancel_fd(true);
    ExecuTorchEngine engine(cfg);
    if (!engine.error().empty()) {
        // Startup failure: nothing on stdout, the reason on stderr, non-zero status (spec §3).
        std::fprintf(stderr, "trioserve-executorch-worker: %s\n", engine.error().c_str());
        return 1;
    }
    CancelController cancel;
    FdSink sink(1);
    WorkerOptions opts;
    opts.prefill_chunk = static_cast<size_t>(prefill_chunk);
    opts.batch_tokens = static_cast<size_t>(prefill_chunk);
    opts.step_target_ms = 0;  // one slot: no other stream to keep smooth
    // Progress records carry the step's composition and time; the engine counts no work
    // inside a step (Engine::work_done() is 0), so a long step is judged by the parent's
    // stall and health timeouts as before (spec §4.4).
    opts.heartbeat_ms = heartbeat_ms;
    opts.supports_cancel = cancel_fd >= 0;
    opts.spill_budget_bytes = 0;  // one slot: no named sessions to evict
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
