// json_key_guard_bench — what the unique-keys stage (cpp/json_key_guard.h) costs per sampling
// step, on a real vocabulary (the GGUF's tokenizer only; no weights are loaded).
//
//   bench_json_key_guard MODEL.gguf [passes]
//
// Prints a table:
//   - the vocabulary table (every token's text, the ids holding a quote): size and build time
//     (once per worker);
//   - the common step: veto->allows(picked) + veto->accept(picked) over a tokenized JSON answer
//     (what every constrained step pays), ns per token, also for the tokens holding a quote;
//   - a refusal: the masking loop over every quote-holding id at a position inside a key (what
//     a step pays only when the picked token would repeat a key), µs per refusal.
// Built with the C++ tests when llama is built (CMake target bench_json_key_guard).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "json_key_guard.h"
#include "llama.h"

using namespace trioserve;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A JSON answer like the ones the embedded model writes for a json_object request, with
// nesting, arrays of objects, escapes and non-ASCII text.
const char* kAnswer =
    "{\"name\": \"Kitty\", \"age\": 3, \"color\": \"orange \\\"tabby\\\"\", \"owner\": {\"name\": \"Ana\", "
    "\"city\": \"S\xC3\xA3o Paulo\", \"phones\": [\"+55 11 5555-0101\", \"+55 11 5555-0102\"]}, "
    "\"toys\": [{\"name\": \"ball\", \"color\": \"red\", \"size\": 4}, {\"name\": \"mouse\", \"color\": "
    "\"grey\", \"size\": 2}, {\"name\": \"string\", \"color\": \"white\", \"size\": 9}], \"vaccinated\": true, "
    "\"weight_kg\": 4.2, \"favorite_foods\": [\"tuna\", \"chicken\", \"salmon\"], \"notes\": \"likes "
    "boxes; sleeps 16 h a day\", \"microchip\": null, \"siblings\": [{\"name\": \"Tom\", \"age\": 3}, "
    "{\"name\": \"Felix\", \"age\": 4}], \"indoor\": false, \"\\u00e9tat\": \"ok\"}";

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [passes]\n", argv[0]);
        return 2;
    }
    const int passes = argc > 2 ? std::atoi(argv[2]) : 2000;
    llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model* model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab* vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    auto bytes = [vocab](TokenId id, std::string& out) {
        char buf[256];
        const int32_t n = llama_token_to_piece(vocab, id, buf, sizeof buf, 0, true);
        if (n > 0) out.append(buf, static_cast<size_t>(n));
    };

    auto t0 = Clock::now();
    auto texts = TokenTexts::of(static_cast<size_t>(n_vocab), bytes);
    const double table_ms = ms_since(t0);

    std::vector<llama_token> ids(4096);
    const std::string answer = kAnswer;
    const int32_t n_ids = llama_tokenize(vocab, answer.data(), static_cast<int32_t>(answer.size()), ids.data(),
                                         static_cast<int32_t>(ids.size()), false, false);
    if (n_ids <= 0) return 1;
    ids.resize(static_cast<size_t>(n_ids));
    size_t quoted_in_answer = 0;
    for (llama_token id : ids) quoted_in_answer += texts->text[static_cast<size_t>(id)].find('"') != std::string::npos;

    // The common step, over the whole answer, `passes` times (a fresh guard each pass).
    size_t sink = 0;
    t0 = Clock::now();
    for (int p = 0; p < passes; ++p) {
        JsonKeyVeto veto(JsonKeyOptions{}, texts);
        for (llama_token id : ids) {
            sink += veto.allows(id);
            veto.accept(id);
        }
    }
    const double step_ns = ms_since(t0) * 1e6 / (static_cast<double>(passes) * static_cast<double>(ids.size()));

    // A refusal: mask every quote-holding id, at each position inside a key.
    size_t refusals = 0, masked = 0;
    const int mask_passes = passes / 50 > 0 ? passes / 50 : 1;
    t0 = Clock::now();
    for (int p = 0; p < mask_passes; ++p) {
        JsonKeyVeto veto(JsonKeyOptions{}, texts);
        for (llama_token id : ids) {
            if (veto.guard().in_key()) {
                ++refusals;
                for (TokenId t : veto.refusable()) masked += !veto.allows(t);
            }
            veto.accept(id);
        }
    }
    const double mask_us = ms_since(t0) * 1e3 / static_cast<double>(refusals ? refusals : 1);

    std::printf("vocabulary                         %d tokens, %zu hold a quote\n", n_vocab, texts->quoted.size());
    std::printf("vocabulary table (once per worker) %.1f ms\n", table_ms);
    std::printf("answer                             %zu bytes, %zu tokens, %zu hold a quote\n", answer.size(),
                ids.size(), quoted_in_answer);
    std::printf("common step (check + accept)       %.0f ns per token (mean over %d passes)\n", step_ns, passes);
    std::printf("refusal (mask the quote ids)       %.1f us per masking pass (timed at all %zu positions inside a key)\n",
                mask_us, refusals);
    std::printf("{\"n_vocab\": %d, \"quoted\": %zu, \"table_ms\": %.2f, \"step_ns\": %.1f, \"refusal_us\": %.2f}\n",
                n_vocab, texts->quoted.size(), table_ms, step_ns, mask_us);
    llama_model_free(model);
    llama_backend_free();
    return sink == 0 || masked > refusals * texts->quoted.size() ? 1 : 0;
}
