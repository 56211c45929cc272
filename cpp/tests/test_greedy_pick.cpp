// The llama engine's greedy fast path (engines/llama/llama_engine.h greedy_pick) against
// llama.cpp's own greedy sampler over a candidates array in id order (what the engine ran
// before the fast path): the same token on random rows, rows with ties (the first maximum
// wins in both), rows of -inf with one finite logit, a maximum at either end, and a
// vocabulary-sized row; and, for the vectorized scan (cpp/greedy_pick.h), every size around
// its four-lane blocks, NaN entries (skipped, but a NaN at index 0 stays the pick), signed
// zeros (equal: the first wins) and rows of -inf, against the scalar loop too. No model
// needed: the greedy sampler reads only the array.
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
    const auto n = static_cast<int32_t>(row.size());
    CHECK_EQ(greedy_pick(row.data(), n), reference(row));
    CHECK_EQ(greedy_pick_scalar(row.data(), n), reference(row));
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
    const float kNaN = std::nanf("");
    for (int i = 0; i < 2000; ++i) {  // small sizes (every block and tail split), with NaN, +-0, +-inf
        std::vector<float> row(1 + rng() % 40);
        for (float& x : row) {
            const unsigned k = rng() % 8;
            x = k == 0 ? kNaN : k == 1 ? 0.0f : k == 2 ? -0.0f : k == 3 ? -INFINITY : k == 4 ? INFINITY
                                                                                               : logit(rng);
        }
        agree(row);
    }
    {
        std::vector<float> row(49152, 1.0f);  // NaN at index 0 stays the pick
        row[0] = kNaN;
        row[100] = 9.0f;
        agree(row);
        CHECK_EQ(greedy_pick(row.data(), 49152), 0);
        row[0] = 1.0f;  // NaN elsewhere is skipped
        row[99] = kNaN;
        agree(row);
        CHECK_EQ(greedy_pick(row.data(), 49152), 100);
    }
    {
        std::vector<float> row(49153, -INFINITY);  // all -inf: id 0; -0 then +0 maxima: the first
        agree(row);
        CHECK_EQ(greedy_pick(row.data(), 49153), 0);
        row[40000] = -0.0f;
        row[40001] = 0.0f;
        row[49152] = 0.0f;  // in the tail: equal, not greater
        agree(row);
        CHECK_EQ(greedy_pick(row.data(), 49153), 40000);
    }
    return trioserve_test::finish("test_greedy_pick");
}
