// Unit tests of ExecuTorchEngine's slot state on the committed tiny programs (argv[1]: the
// tests/data/executorch directory): a state saved from one slot and loaded into another
// continues exactly like the original; copy_state() is a complete copy; truncate() then a new
// suffix equals a fresh prefill; states of another program, cut short or with a damaged
// header are refused (unsupported) and leave the slot as it was.
#include "check.h"
#include "engines/executorch/executorch_engine.h"

#include <string>
#include <vector>

using namespace trioserve;

namespace {

struct Greedy {
    ExecuTorchEngine& e;
    std::unique_ptr<Sampler> sampler;
    explicit Greedy(ExecuTorchEngine& engine) : e(engine) {
        std::string err;
        sampler = e.new_sampler(SamplingParams{}, "", err);
    }
    /// Appends `tokens` to `slot`, then decodes `n` greedy tokens; returns them (empty on error).
    std::vector<TokenId> run(int32_t slot, const std::vector<TokenId>& tokens, int n) {
        std::vector<TokenId> out;
        StepItem it{slot, tokens.data(), tokens.size(), true, true};
        if (e.step(&it, 1) != Status::ok) return {};
        for (int i = 0; i < n; ++i) {
            TokenId t = 0;
            if (e.sample(slot, *sampler, &t) != Status::ok) return {};
            out.push_back(t);
            StepItem d{slot, &out.back(), 1, true, false};
            if (e.step(&d, 1) != Status::ok) return {};
        }
        return out;
    }
};

ExecuTorchConfig config(const std::string& dir, const char* program, int64_t capacity) {
    ExecuTorchConfig c;
    c.model_path = dir + "/" + program;
    c.tokenizer_path = dir + "/tokenizer.json";
    c.n_threads = 1;
    c.capacity = capacity;
    return c;
}

void check_program(const std::string& dir, const char* program, const char* other) {
    std::fprintf(stderr, "-- %s\n", program);
    ExecuTorchEngine e(config(dir, program, 3));
    CHECK(e.error().empty());
    if (!e.error().empty()) return;
    CHECK_EQ(e.info().capacity, int64_t(3));
    Greedy g(e);
    const std::vector<TokenId> prompt = {10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120};
    const std::vector<TokenId> more = {33, 44, 55};

    // Reference: one uninterrupted run in slot 0.
    const std::vector<TokenId> head = g.run(0, prompt, 6);
    const std::vector<TokenId> tail = g.run(0, more, 6);
    CHECK_EQ(head.size(), size_t(6));
    CHECK_EQ(tail.size(), size_t(6));

    // Save slot 0 after the prompt + head, load into slot 1 (after other work there), continue.
    CHECK(e.reset(0) == Status::ok);
    g.run(0, prompt, 6);
    std::vector<uint8_t> saved;
    CHECK(e.save_state(0, saved) == Status::ok);
    g.run(1, {7, 8, 9}, 3);  // slot 1 holds something else first
    CHECK(e.load_state(1, saved) == Status::ok);
    CHECK_EQ(e.position(1), e.position(0));
    g.run(0, {1, 2, 3, 4}, 4);  // slot 0 moves on: the loaded copy must not depend on it
    CHECK(g.run(1, more, 6) == tail);

    // copy_state: slot 2 from slot 1 (both at prompt+head+more+tail), then each continues alike.
    std::vector<uint8_t> scratch;
    CHECK(e.copy_state(1, 2, scratch) == Status::ok);
    CHECK_EQ(e.position(2), e.position(1));
    const std::vector<TokenId> from1 = g.run(1, {61, 62}, 5);
    const std::vector<TokenId> from2 = g.run(2, {61, 62}, 5);
    CHECK(!from1.empty() && from1 == from2);

    // truncate back to the prompt and take the other branch again: the same tail.
    const int64_t after_prompt = static_cast<int64_t>(prompt.size());
    CHECK(e.truncate(2, after_prompt) == Status::ok);
    // The reference fed every head token as a decode step, then `more`: one prefill of both.
    std::vector<TokenId> feed = head;
    feed.insert(feed.end(), more.begin(), more.end());
    CHECK(g.run(2, feed, 6) == tail);

    // Refusals: cut short, damaged header, another program. The slot is unchanged.
    const int64_t before = e.position(1);
    std::vector<uint8_t> shortened(saved.begin(), saved.end() - 1);
    CHECK(e.load_state(1, shortened) == Status::unsupported);
    std::vector<uint8_t> damaged = saved;
    damaged[9] ^= 0x5a;  // inside the program hash
    CHECK(e.load_state(1, damaged) == Status::unsupported);
    CHECK(e.load_state(1, std::vector<uint8_t>{1, 2, 3}) == Status::unsupported);
    CHECK_EQ(e.position(1), before);

    ExecuTorchEngine o(config(dir, other, 1));
    CHECK(o.error().empty());
    if (o.error().empty()) {
        Greedy go(o);
        go.run(0, prompt, 2);
        std::vector<uint8_t> foreign;
        CHECK(o.save_state(0, foreign) == Status::ok);
        CHECK(e.load_state(1, foreign) == Status::unsupported);
        CHECK_EQ(e.position(1), before);
        CHECK(o.report().program_hash != e.report().program_hash);
    }
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: test_executorch_state <tests/data/executorch>\n");
        return 2;
    }
    const std::string dir = argv[1];
    check_program(dir, "tiny.pte", "tiny_sdpa.pte");
    check_program(dir, "tiny_sdpa.pte", "tiny.pte");
    return trioserve_test::finish("test_executorch_state");
}
