// Unit tests for the prefix source choice (prefix_index.h): which slot or spilled session a
// prompt starts from when its own slot holds less.
#include "check.h"
#include "prefix_index.h"

using namespace trioserve;
using V = std::vector<TokenId>;

namespace {

V seq(std::initializer_list<TokenId> a, size_t repeat_first = 0) {
    V v;
    for (size_t i = 0; i < repeat_first; ++i) v.push_back(*a.begin());
    v.insert(v.end(), a.begin(), a.end());
    return v;
}

const auto trim_all = [](int32_t, size_t) { return true; };
const auto trim_none = [](int32_t, size_t) { return false; };

}  // namespace

int main() {
    const V sys = seq({1}, 40);                 // a 41-token "system prompt" of 1s
    V prompt = sys; prompt.insert(prompt.end(), {7, 8, 9});
    V other = sys; other.insert(other.end(), {5, 5, 5, 5});

    {   // another slot holds the system prompt + a different turn: copy it, trimmed to 41
        SlotTable t(4);
        SpillStore sp(1 << 20);
        t.at(2).resident = other;
        PrefixSource s = find_prefix_source(t, sp, prompt, /*own=*/0, /*own_keep=*/0, 16, trim_all, true);
        CHECK(s.kind == PrefixSource::Kind::slot);
        CHECK_EQ(s.slot, int32_t(2));
        CHECK_EQ(s.keep, sys.size());
        // the same source cannot be cut back (recurrent): not usable
        s = find_prefix_source(t, sp, prompt, 0, 0, 16, trim_none, true);
        CHECK(s.kind == PrefixSource::Kind::none);
        // ... unless all of it is a prefix of the prompt
        t.at(2).resident = sys;
        s = find_prefix_source(t, sp, prompt, 0, 0, 16, trim_none, true);
        CHECK(s.kind == PrefixSource::Kind::slot);
        CHECK_EQ(s.keep, sys.size());
    }
    {   // the own slot already holds as much (or nearly as much): no copy
        SlotTable t(3);
        SpillStore sp(1 << 20);
        t.at(1).resident = other;
        CHECK(find_prefix_source(t, sp, prompt, 0, sys.size(), 16, trim_all, true).kind == PrefixSource::Kind::none);
        CHECK(find_prefix_source(t, sp, prompt, 0, sys.size() - 10, 16, trim_all, true).kind ==
              PrefixSource::Kind::none);  // gain 10 < 16
        CHECK(find_prefix_source(t, sp, prompt, 0, sys.size() - 20, 16, trim_all, true).kind ==
              PrefixSource::Kind::slot);
        // the own slot itself is never a source
        CHECK(find_prefix_source(t, sp, prompt, 1, 0, 16, trim_all, true).kind == PrefixSource::Kind::none);
        // a dirty slot is never a source
        t.at(1).dirty = true;
        CHECK(find_prefix_source(t, sp, prompt, 0, 0, 16, trim_all, true).kind == PrefixSource::Kind::none);
    }
    {   // the spill store: the longest prefix wins over a shorter slot; ties prefer the slot
        SlotTable t(2);
        SpillStore sp(1 << 20);
        V half(sys.begin(), sys.begin() + 30);
        t.at(1).resident = half;
        SpilledSession e;
        e.resident = other;
        e.state.assign(other.size() * 4, 0);
        CHECK(sp.put("a", std::move(e)));
        PrefixSource s = find_prefix_source(t, sp, prompt, 0, 0, 16, trim_all, /*spill_trimmable=*/true);
        CHECK(s.kind == PrefixSource::Kind::spill);
        CHECK(s.session == "a");
        CHECK_EQ(s.keep, sys.size());
        // a spilled state that cannot be cut back is usable only whole: the slot wins then
        s = find_prefix_source(t, sp, prompt, 0, 0, 16, trim_all, /*spill_trimmable=*/false);
        CHECK(s.kind == PrefixSource::Kind::slot);
        CHECK_EQ(s.keep, size_t(30));
        t.at(1).resident = sys;  // tie at 41: the slot (no host-memory load)
        s = find_prefix_source(t, sp, prompt, 0, 0, 16, trim_all, true);
        CHECK(s.kind == PrefixSource::Kind::slot);
    }
    {   // the same prompt resident elsewhere: keep all but the last token (its logits)
        SlotTable t(2);
        SpillStore sp(1 << 20);
        t.at(1).resident = prompt;
        PrefixSource s = find_prefix_source(t, sp, prompt, 0, 0, 16, trim_all, true);
        CHECK_EQ(s.keep, prompt.size() - 1);
        // not cut-able: a whole-state-only source longer than what may be kept is unusable
        CHECK(find_prefix_source(t, sp, prompt, 0, 0, 16, trim_none, true).kind == PrefixSource::Kind::none);
    }
    {   // prefill grid: shared prefixes are whole pieces, a slot's limited to its exact tokens
        const V big = seq({1}, 140);  // 141 ones
        V p2 = big; p2.insert(p2.end(), {7, 8, 9});
        SlotTable t(4);
        SpillStore sp(1 << 20);
        t.at(1).resident = big;
        PrefixSource s = find_prefix_source(t, sp, p2, 0, 0, 16, trim_all, true, 64);
        CHECK(s.kind == PrefixSource::Kind::slot && s.keep == 128);
        s = find_prefix_source(t, sp, p2, 0, 0, 16, trim_all, true, 64,
                               [](int32_t) { return size_t(64); });  // only 64 computed in whole pieces
        CHECK(s.kind == PrefixSource::Kind::slot && s.keep == 64);
        s = find_prefix_source(t, sp, p2, 0, 64, 16, trim_all, true, 64,
                               [](int32_t) { return size_t(64); });  // no better than own slot
        CHECK(s.kind == PrefixSource::Kind::none);
        CHECK_EQ(usable_prefix(big, p2, 64, 100), size_t(64));
        CHECK_EQ(usable_prefix(big, p2), size_t(141));
    }
    return trioserve_test::finish("test_prefix_index");
}
