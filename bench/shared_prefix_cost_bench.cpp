// What a session that starts from a shared prefix pays beyond its own suffix, on
// llama.cpp directly with the worker's context parameters (make_context_params):
//
//   1. saving a slot's state (llama_state_seq_get_data) into a fresh buffer against one already
//      touched (the worker's spare state buffer, state_buffer.h), and loading it into a slot;
//   2. prefilling a short suffix after the long shared prefix against after a short one, with
//      flash attention on (llama.cpp's default on CPU, which the worker keeps) and off; plus a
//      cold prefill of the prefix and a 4-slot decode step, the costs the choice also moves.
//
// Both flash-attention settings run in one process, interleaved, on one model load; medians.
// Run it like the worker runs (GOMP_SPINCOUNT=1000, trioserve's default, on a shared host):
//
//   GOMP_SPINCOUNT=1000 build/dev/bench_shared_prefix_cost MODEL.gguf [PREFIX SUFFIX REPS]
//
// Prints one line per measurement. A benchmark, not a test: nothing is asserted.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "engines/llama/llama_engine.h"

using namespace trioserve;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

/// Decodes `tokens` for sequence `seq` from position `p0`, in batches of 512, logits last.
void decode(llama_context* ctx, llama_batch& b, int seq, const std::vector<llama_token>& tokens, int p0) {
    for (size_t i = 0; i < tokens.size(); i += 512) {
        b.n_tokens = 0;
        for (size_t j = i; j < std::min(tokens.size(), i + 512); ++j) {
            const int k = b.n_tokens++;
            b.token[k] = tokens[j];
            b.pos[k] = static_cast<llama_pos>(p0 + j);
            b.n_seq_id[k] = 1;
            b.seq_id[k][0] = seq;
            b.logits[k] = j + 1 == tokens.size();
        }
        if (llama_decode(ctx, b) != 0) {
            std::fprintf(stderr, "llama_decode failed\n");
            std::exit(1);
        }
    }
}

std::vector<llama_token> ids(int n, int seed) {
    std::vector<llama_token> v;
    for (int i = 0; i < n; ++i) v.push_back(100 + (i * 7919 + seed * 104729) % 40000);
    return v;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [PREFIX_TOKENS SUFFIX_TOKENS REPS]\n", argv[0]);
        return 2;
    }
    const int n_prefix = argc > 2 ? std::atoi(argv[2]) : 1440;
    const int n_suffix = argc > 3 ? std::atoi(argv[3]) : 18;
    const int reps = argc > 4 ? std::atoi(argv[4]) : 5;
    constexpr int kShort = 20;
    LlamaConfig cfg;
    cfg.model_path = argv[1];
    cfg.n_ctx = 8192;
    cfg.capacity = 4;
    cfg.n_threads = 2;
    install_llama_log(false);
    llama_backend_init();
    llama_model_ptr model(llama_model_load_from_file(cfg.model_path.c_str(), llama_model_default_params()));
    if (!model) return 1;
    llama_context_ptr ctxs[2];  // [0]: flash attention off, [1]: on
    for (int fa = 0; fa < 2; ++fa) {
        llama_context_params cp = make_context_params(cfg, cfg.n_ctx);
        cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        ctxs[fa].reset(llama_init_from_model(model.get(), cp));
        if (!ctxs[fa]) return 1;
    }
    llama_batch b = llama_batch_init(1024, 0, 1);
    const std::vector<llama_token> prefix = ids(n_prefix, 1), suffix = ids(n_suffix, 2), shorter = ids(kShort, 3);

    std::vector<double> cold[2], after_long[2], after_short[2], step4[2], save_fresh, save_touched, load;
    std::vector<uint8_t> touched;
    for (int r = 0; r < reps; ++r) {
        for (int fa = 0; fa < 2; ++fa) {
            llama_context* ctx = ctxs[fa].get();
            llama_memory_t mem = llama_get_memory(ctx);
            for (int s = 0; s < 4; ++s) llama_memory_seq_rm(mem, s, -1, -1);
            auto t0 = Clock::now();
            decode(ctx, b, 0, prefix, 0);
            cold[fa].push_back(ms_since(t0));
            for (int s = 1; s < 4; ++s) decode(ctx, b, s, shorter, 0);
            if (fa == 1) {  // the worker's setting: the copy costs
                const size_t need = llama_state_seq_get_size(ctx, 0);
                t0 = Clock::now();
                std::vector<uint8_t> fresh(need);
                llama_state_seq_get_data(ctx, fresh.data(), fresh.size(), 0);
                save_fresh.push_back(ms_since(t0));
                touched.resize(need);
                t0 = Clock::now();
                llama_state_seq_get_data(ctx, touched.data(), touched.size(), 0);
                save_touched.push_back(ms_since(t0));
                t0 = Clock::now();
                llama_memory_seq_rm(mem, 3, -1, -1);
                llama_state_seq_set_data(ctx, touched.data(), touched.size(), 3);
                load.push_back(ms_since(t0));
                llama_memory_seq_rm(mem, 3, -1, -1);
                decode(ctx, b, 3, shorter, 0);
            }
            t0 = Clock::now();
            decode(ctx, b, 0, suffix, n_prefix);
            after_long[fa].push_back(ms_since(t0));
            llama_memory_seq_rm(mem, 0, n_prefix, -1);
            t0 = Clock::now();
            decode(ctx, b, 1, suffix, kShort);
            after_short[fa].push_back(ms_since(t0));
            llama_memory_seq_rm(mem, 1, kShort, -1);
            b.n_tokens = 0;  // one decode token per slot, as a step of four generations
            for (int s = 0; s < 4; ++s) {
                const int k = b.n_tokens++;
                b.token[k] = 300 + s;
                b.pos[k] = s == 0 ? n_prefix : kShort;
                b.n_seq_id[k] = 1;
                b.seq_id[k][0] = s;
                b.logits[k] = 1;
            }
            t0 = Clock::now();
            if (llama_decode(ctx, b) != 0) return 1;
            step4[fa].push_back(ms_since(t0));
        }
    }
    std::printf("state of %d tokens: %.1f MB; save into a fresh buffer %.1f ms, into a touched one %.1f ms; "
                "load %.1f ms (medians of %d)\n", n_prefix, static_cast<double>(touched.size()) / 1e6,
                median(save_fresh), median(save_touched), median(load), reps);
    for (int fa = 0; fa < 2; ++fa)
        std::printf("flash attention %s: cold prefill of %d: %.0f ms | suffix of %d after %d: %.1f ms, after %d: "
                    "%.1f ms (x%.2f) | 4-slot decode step: %.1f ms\n", fa ? "on " : "off", n_prefix,
                    median(cold[fa]), n_suffix, n_prefix, median(after_long[fa]), kShort, median(after_short[fa]),
                    median(after_long[fa]) / median(after_short[fa]), median(step4[fa]));
    llama_batch_free(b);
    return 0;
}
