// Unit tests for the context clamp and the warm-resume plan.
#include "check.h"
#include "prefill_plan.h"

#include <string>

using namespace trioserve;

int main() {
    // Context clamp.
    CHECK_EQ(clamp_max_new(10, 100, -1), int64_t(90));
    CHECK_EQ(clamp_max_new(10, 100, 5), int64_t(5));
    CHECK_EQ(clamp_max_new(10, 100, 500), int64_t(90));
    CHECK_EQ(clamp_max_new(99, 100, -1), int64_t(1));
    CHECK_EQ(clamp_max_new(100, 100, 5), int64_t(-1));   // no room: context_length_exceeded
    CHECK_EQ(clamp_max_new(150, 100, 5), int64_t(-1));

    using V = std::vector<int32_t>;
    // Dirty / new: full reset.
    CHECK(plan_prefill({1, 2}, {1, 2, 3}, true, true).reset);
    CHECK(!plan_prefill({1, 2}, {1, 2, 3}, false, true).reset);
    CHECK(plan_prefill({}, {1, 2, 3}, false, true).reset);
    {   // exact prefix: keep all resident, prefill the suffix
        PrefillPlan p = plan_prefill(V{1, 2}, V{1, 2, 3, 4}, false, false);
        CHECK(!p.reset);
        CHECK_EQ(p.keep, size_t(2));
    }
    {   // equal prompt: keep all but one (its logits are needed)
        PrefillPlan p = plan_prefill(V{1, 2, 3}, V{1, 2, 3}, false, true);
        CHECK(!p.reset);
        CHECK_EQ(p.keep, size_t(2));
        CHECK(plan_prefill(V{1, 2, 3}, V{1, 2, 3}, false, false).reset);  // needs truncation
    }
    {   // divergence: trim to the common prefix when truncation works, else reset
        PrefillPlan p = plan_prefill(V{1, 2, 9, 9}, V{1, 2, 3}, false, true);
        CHECK(!p.reset);
        CHECK_EQ(p.keep, size_t(2));
        CHECK(plan_prefill(V{1, 2, 9}, V{1, 2, 3}, false, false).reset);
        CHECK(plan_prefill(V{7}, V{1, 2, 3}, false, true).reset);  // nothing shared
    }
    {   // resident longer than the prompt, prompt a prefix of it
        PrefillPlan p = plan_prefill(V{1, 2, 3, 4}, V{1, 2}, false, true);
        CHECK_EQ(p.keep, size_t(1));
    }
    {   // deterministic grid: the kept prefix is cut back to a multiple of the grid
        V resident(150), prompt(200);
        for (int i = 0; i < 150; ++i) resident[static_cast<size_t>(i)] = i;
        for (int i = 0; i < 200; ++i) prompt[static_cast<size_t>(i)] = i < 140 ? i : 1000 + i;
        PrefillPlan p = plan_prefill(resident, prompt, false, true, 64);
        CHECK(!p.reset);
        CHECK_EQ(p.keep, size_t(128));  // common prefix 140 -> 128
        CHECK_EQ(std::string(p.reason), std::string("trimmed"));
        V r128(resident.begin(), resident.begin() + 128);
        p = plan_prefill(r128, prompt, false, false, 64);  // all of it, on the grid: no truncation
        CHECK(!p.reset && p.keep == 128 && std::string(p.reason) == "exact_prefix");
        V short_prefix(prompt.begin(), prompt.begin() + 63);  // under one piece: nothing kept
        p = plan_prefill(short_prefix, prompt, false, true, 64);
        CHECK(p.reset);
        CHECK_EQ(plan_prefill(resident, prompt, false, true, 0).keep, size_t(140));  // no grid
    }
    return trioserve_test::finish("test_prefill_plan");
}
