// trioserve-llama-direct: the benchmark baseline. A straight greedy loop over llama.h with the
// same library, model, context parameters and thread count as trioserve-llama-worker, no
// protocol. Prints one JSON object on stdout (timings, generated ids).
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.h"
#include "engines/llama/kernel_path.h"
#include "engines/llama/llama_engine.h"

using namespace trioserve;

static const char* kHelp = R"(usage: trioserve-llama-direct --model PATH [--prompt TEXT] [--n N] [--ctx N]
                            [--threads N] [--capacity N] [--prefill-chunk N] [--gpu-layers N]
                            [--warmup] [--cpu-extra-buffers auto|on|off]

Greedy-decodes N tokens (EOS ignored: exactly N) after PROMPT (tokenized like the worker: no
BOS added, special tokens parsed) and prints {"prefill_ms", "decode_ms", "decode_tok_s", ...}.
decode_ms runs from the start of decoding to the last sampled token, like the worker's;
decode_ms_after_first from the first sampled token on (n-1 steps), the benchmark's measure.
--warmup first prefills the prompt and decodes a few tokens untimed, then clears the memory, so
the timed run starts warm (weights paged in, buffers allocated) like a serving worker's request.
The CPU kernels are the worker's: the same rule (kernel_path.h; --cpu-extra-buffers as the
worker's, probes run by the trioserve-llama-worker beside this program), reported as
"kernel_path" in the output.
)";

int main(int argc, char** argv) {
    LlamaConfig cfg;
    cfg.capacity = 1;
    std::string prompt = "<|im_start|>user\nTell me a long story about a robot.<|im_end|>\n<|im_start|>assistant\n";
    long long n_gen = 128, v = 0;
    bool warmup = false;
    std::string extra_mode = "auto";
    Args a(argc, argv);
    while (!a.done()) {
        if (a.flag("--help")) { std::fputs(kHelp, stdout); return 0; }
        else if (a.value("--model", cfg.model_path)) {}
        else if (a.value("--prompt", prompt)) {}
        else if (a.flag("--warmup")) warmup = true;
        else if (a.int_value("--n", n_gen, 1)) {}
        else if (a.int_value("--ctx", v, 0)) cfg.n_ctx = v;
        else if (a.int_value("--threads", v, 1)) cfg.n_threads = static_cast<int32_t>(v);
        else if (a.int_value("--capacity", v, 1)) cfg.capacity = v;
        else if (a.int_value("--prefill-chunk", v, 1)) cfg.prefill_chunk = v;
        else if (a.int_value("--gpu-layers", v, -1)) cfg.n_gpu_layers = static_cast<int32_t>(v);
        else if (a.value("--cpu-extra-buffers", extra_mode)) {
            if (extra_mode != "auto" && extra_mode != "on" && extra_mode != "off")
                Args::fail("--cpu-extra-buffers must be auto, on or off");
        }
        else Args::fail("unknown flag " + a.peek());
    }
    if (cfg.model_path.empty()) Args::fail("--model is required");
    install_llama_log(false);
    // Same CPU kernels as the worker: a run-time-selected build loads its module first, then
    // the worker's rule picks the variant and the extra buffer types.
    CpuBackendInfo cpu = ensure_cpu_backend();
    if (!cpu.error.empty()) {
        std::fprintf(stderr, "trioserve-llama-direct: %s\n", cpu.error.c_str());
        return 1;
    }
    ProbeSettings probe;
    probe.worker_exe = program_dir() + "/trioserve-llama-worker";
    probe.model_path = cfg.model_path;
    probe.threads = cfg.n_threads;
    const std::vector<std::string> offered = cfg.n_gpu_layers == 0 ? cpu_extra_buffer_types() : std::vector<std::string>{};
    const KernelPath chosen = choose_kernel_path(cpu, extra_mode, offered, probe_launcher(probe));
    if (!chosen.error.empty()) {
        std::fprintf(stderr, "trioserve-llama-direct: %s\n", chosen.error.c_str());
        return 1;
    }
    nlohmann::json kernel_path = kernel_path_json(chosen);
    if (!cpu.variant.empty()) kernel_path["cpu_variant"] = cpu.variant;
    llama_backend_init();

    // Load.
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = cfg.n_gpu_layers < 0 ? 999 : cfg.n_gpu_layers;
    mp.use_extra_bufts = chosen.use_extra_bufts();
    llama_model_ptr model(llama_model_load_from_file(cfg.model_path.c_str(), mp));
    if (!model) { std::fprintf(stderr, "%s: failed to load %s\n", __func__, cfg.model_path.c_str()); return 1; }
    const llama_vocab* vocab = llama_model_get_vocab(model.get());

    // Context (same parameters as the worker).
    const int64_t n_ctx = resolve_n_ctx(cfg, model.get());
    cfg.flash_attn = resolve_flash_attn(cfg, model.get(), n_ctx);
    llama_context_ptr ctx(llama_init_from_model(model.get(), make_context_params(cfg, n_ctx)));
    if (!ctx) { std::fprintf(stderr, "%s: failed to create context\n", __func__); return 1; }

    // Tokenize.
    int32_t n = -llama_tokenize(vocab, prompt.data(), static_cast<int32_t>(prompt.size()), nullptr, 0, false, true);
    std::vector<llama_token> ids(static_cast<size_t>(n));
    if (llama_tokenize(vocab, prompt.data(), static_cast<int32_t>(prompt.size()), ids.data(), n, false, true) < 0) {
        std::fprintf(stderr, "%s: tokenize failed\n", __func__);
        return 1;
    }
    if (static_cast<int64_t>(ids.size()) + n_gen > n_ctx) { std::fprintf(stderr, "%s: prompt + n exceeds ctx\n", __func__); return 1; }

    // Sampler: greedy, like the worker at temperature 0.
    llama_sampler_ptr smpl(llama_sampler_chain_init(llama_sampler_chain_default_params()));
    llama_sampler_chain_add(smpl.get(), llama_sampler_init_greedy());

    using Clock = std::chrono::steady_clock;
    auto ms = [](Clock::time_point a0, Clock::time_point b0) { return std::chrono::duration<double, std::milli>(b0 - a0).count(); };

    // Prefill (in prefill_chunk pieces, like the worker).
    llama_batch batch = llama_batch_init(static_cast<int32_t>(std::max<int64_t>(cfg.prefill_chunk, 1)), 0, 1);
    auto fill = [&](const llama_token* t, size_t k, int64_t pos0) {
        batch.n_tokens = static_cast<int32_t>(k);
        for (size_t i = 0; i < k; ++i) {
            batch.token[i] = t[i];
            batch.pos[i] = static_cast<llama_pos>(pos0 + static_cast<int64_t>(i));
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = (i + 1 == k);
        }
    };
    int64_t pos = 0;
    auto prefill = [&]() {
        pos = 0;
        for (size_t done = 0; done < ids.size();) {
            size_t k = std::min(ids.size() - done, static_cast<size_t>(std::max<int64_t>(cfg.prefill_chunk, 1)));
            fill(ids.data() + done, k, pos);
            if (llama_decode(ctx.get(), batch) != 0) return false;
            done += k;
            pos += static_cast<int64_t>(k);
        }
        return true;
    };
    if (warmup) {
        if (!prefill()) { std::fprintf(stderr, "%s: warm-up prefill failed\n", __func__); return 1; }
        for (int i = 0; i < 4; ++i) {
            llama_token t = llama_sampler_sample(smpl.get(), ctx.get(), -1);
            fill(&t, 1, pos++);
            if (llama_decode(ctx.get(), batch) != 0) { std::fprintf(stderr, "%s: warm-up decode failed\n", __func__); return 1; }
        }
        llama_memory_clear(llama_get_memory(ctx.get()), true);
        llama_sampler_reset(smpl.get());
    }
    const auto t0 = Clock::now();
    if (!prefill()) { std::fprintf(stderr, "%s: prefill failed\n", __func__); return 1; }
    const auto t1 = Clock::now();

    // Decode: sample, (stop at n), decode — the same step order as the worker loop.
    std::vector<llama_token> out;
    out.reserve(static_cast<size_t>(n_gen));
    Clock::time_point t_first = t1;
    for (long long i = 0; i < n_gen; ++i) {
        llama_token t = llama_sampler_sample(smpl.get(), ctx.get(), -1);
        if (i == 0) t_first = Clock::now();
        out.push_back(t);
        if (i + 1 == n_gen) break;
        fill(&t, 1, pos);
        if (llama_decode(ctx.get(), batch) != 0) { std::fprintf(stderr, "%s: decode failed\n", __func__); return 1; }
        ++pos;
    }
    const auto t2 = Clock::now();
    llama_batch_free(batch);

    const double pms = ms(t0, t1), dms = ms(t1, t2), after_first = ms(t_first, t2);
    nlohmann::json j{{"prompt_tokens", ids.size()}, {"n", out.size()}, {"threads", default_threads(cfg.n_threads)},
                     {"prefill_ms", pms}, {"decode_ms", dms},
                     {"prefill_tok_s", pms > 0 ? ids.size() * 1000.0 / pms : 0.0},
                     {"decode_tok_s", dms > 0 ? out.size() * 1000.0 / dms : 0.0},
                     // From the first sampled token to the last: n-1 steps. This is what a client
                     // of the worker can measure (first token record -> done record).
                     {"decode_ms_after_first", after_first},
                     {"decode_tok_s_after_first", after_first > 0 ? (out.size() - 1) * 1000.0 / after_first : 0.0},
                     {"token_ids", out}, {"kernel_path", kernel_path}};
    std::printf("%s\n", j.dump().c_str());
    smpl.reset();
    ctx.reset();
    model.reset();
    llama_backend_free();
    return 0;
}
