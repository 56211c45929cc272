// trioserve-llama-worker: serves a GGUF model through llama.cpp over the worker protocol
// (spec/worker-protocol.md). The main only builds the engine and runs worker_loop.h.
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
  --ctx N               context window per session in tokens (default 4096, capped at the
                        model's training context; 0 = the training context)
  --threads N           CPU threads for decode and prefill (default: all hardware threads)
  --gpu-layers N        layers to offload to a GPU (needs a CUDA/Metal build of llama.cpp;
                        -1 = all; default 0)
  --capacity N          isolated sessions on one weight load (llama.cpp sequences), the
                        anonymous session included (default 4)
  --prefill-chunk N     tokens per llama_decode call during prefill; a cancel is also checked
                        between chunks (default 512)
  --verbose             forward llama.cpp info logs to stderr
  --help                this text

Environment: TRIOSERVE_CANCEL_FD = read end of the cancel pipe (spec section 7).
)";

int main(int argc, char** argv) {
    LlamaConfig cfg;
    long long v = 0;
    Args a(argc, argv);
    while (!a.done()) {
        if (a.flag("--help") || a.flag("-h")) { std::fputs(kHelp, stdout); return 0; }
        else if (a.value("--model", cfg.model_path)) {}
        else if (a.int_value("--ctx", v, 0)) cfg.n_ctx = v;
        else if (a.int_value("--threads", v, 1)) cfg.n_threads = static_cast<int32_t>(v);
        else if (a.int_value("--gpu-layers", v, -1)) cfg.n_gpu_layers = static_cast<int32_t>(v);
        else if (a.int_value("--capacity", v, 1)) cfg.capacity = v;
        else if (a.int_value("--prefill-chunk", v, 1)) cfg.prefill_chunk = v;
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
    opts.supports_cancel = cancel_fd >= 0;
    ProcessWatcher watcher(cancel, cancel_fd);
    int rc = 0;
    {
        WorkerLoop loop(engine, cancel, sink, opts);
        loop.write_ready();
        LineReader reader(read_stdin);
        rc = loop.run(reader);
    }  // sessions are released before the engine
    return rc;
}
