// The llama engine's greedy fast path (engines/llama/llama_engine.h greedy_pick) against
// llama.cpp's own greedy sampler over a candidates array in id order (what the engine ran
// before the fast path): the same token on random rows, rows with ties (the first maximum
// wins in both), rows of -inf with one finite logit, a maximum at either end, and a
// vocabulary-sized row. No model needed: the greedy sampler reads only the array.
#include "check.h"
#include "engines/llama/llama_engine.h"

#include <cmath>
#include <random>
#include <vector>

using namespace trioserve;

namespace {

llama_token reference(const std::vector<float>& row) {
    std::vector<llama_token_data> cand(row.size());
    for (size_t t = 0; t < row.size(); ++t) cand[t] = llama_token_data{static_cast<llama_token>(t), row[t], 0.0f};
    llama_token_data_array cur{cand.data(), cand.size(), -1, false};
    llama_sampler* greedy = llama_sampler_init_greedy();
    llama_sampler_apply(greedy, &cur);
    llama_sampler_free(greedy);
    return cur.data[cur.selected].id;
}

void agree(const std::vector<float>& row) {
    CHECK_EQ(greedy_pick(row.data(), static_cast<int32_t>(row.size())), reference(row));
}

}  // namespace

int main() {
    std::mt19937 rng(7);
    std::normal_distribution<float> logit(0.0f, 4.0f);
    for (int i = 0; i < 200; ++i) {  // random rows of random sizes
        std::vector<float> row(1 + rng() % 3000);
        for (float& x : row) x = logit(rng);
        agree(row);
    }
    for (int i = 0; i < 200; ++i) {  // coarse logits: many ties, the first maximum must win
        std::vector<float> row(1 + rng() % 200);
        for (float& x : row) x = static_cast<float>(static_cast<int>(rng() % 5));
        agree(row);
    }
    {
        std::vector<float> row(49152, -INFINITY);  // a masked row: one finite logit
        row[31000] = -3.0f;
        agree(row);
        CHECK_EQ(greedy_pick(row.data(), static_cast<int32_t>(row.size())), 31000);
    }
    {
        std::vector<float> row(49152, 0.5f);  // all equal: id 0
        agree(row);
        CHECK_EQ(greedy_pick(row.data(), 49152), 0);
        row.back() = 0.75f;  // the maximum last
        agree(row);
        CHECK_EQ(greedy_pick(row.data(), 49152), 49151);
    }
    {
        std::vector<float> row{2.0f};  // one entry
        agree(row);
    }
    return trioserve_test::finish("test_greedy_pick");
}
