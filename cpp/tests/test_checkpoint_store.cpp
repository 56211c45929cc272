// Unit tests for sliding-window checkpoints: the per-slot store (checkpoint_store.h), the
// window-cache choice (swa_cache.h), and the fake engine's window model that the worker tests
// rely on (fake_engine.h --swa).
#include "check.h"
#include "checkpoint_store.h"
#include "engines/fake/fake_engine.h"
#include "swa_cache.h"

using namespace trioserve;
using V = std::vector<TokenId>;

namespace {

V ids(size_t n, TokenId first = 1) {
    V v;
    for (size_t i = 0; i < n; ++i) v.push_back(first + static_cast<TokenId>(i));
    return v;
}

SlotCheckpoint ckpt(const V& tokens) { return SlotCheckpoint{tokens, std::vector<uint8_t>(8, 0)}; }

V prefix(const V& v, size_t n) { return V(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n)); }

}  // namespace

int main() {
    const V conv = ids(100);
    {   // best(): the highest position <= limit whose ids are a prefix of the prompt
        CheckpointStore s(2, 4);
        s.add(0, ckpt(prefix(conv, 20)));
        s.add(0, ckpt(prefix(conv, 50)));
        s.add(0, ckpt(prefix(conv, 80)));
        CHECK_EQ(s.count(0), size_t(3));
        CHECK_EQ(s.count(1), size_t(0));
        CHECK_EQ(s.best(0, conv, 79)->tokens.size(), size_t(50));
        CHECK_EQ(s.best(0, conv, 80)->tokens.size(), size_t(80));
        CHECK_EQ(s.best(0, conv, 99)->tokens.size(), size_t(80));
        CHECK(s.best(0, conv, 19) == nullptr);
        CHECK(s.best(1, conv, 99) == nullptr);  // per slot
        V edited = conv;
        edited[30] = 999;  // diverges at 30: only the checkpoint at 20 is a prefix
        CHECK_EQ(s.best(0, edited, 99)->tokens.size(), size_t(20));
        CHECK(s.bytes() == (20 + 50 + 80) * sizeof(TokenId) + 3 * 8);
    }
    {   // add(): beyond per_slot the oldest goes, the shortest (the system prompt's end) kept;
        // the same ids replace the older entry
        CheckpointStore s(1, 3);
        s.add(0, ckpt(prefix(conv, 10)));
        s.add(0, ckpt(prefix(conv, 20)));
        s.add(0, ckpt(prefix(conv, 30)));
        s.add(0, ckpt(prefix(conv, 40)));
        CHECK_EQ(s.count(0), size_t(3));
        CHECK_EQ(s.best(0, conv, 15)->tokens.size(), size_t(10));  // the shortest stays
        CHECK_EQ(s.best(0, conv, 25)->tokens.size(), size_t(10));  // the oldest other one (20) went
        s.add(0, ckpt(prefix(conv, 50)));
        CHECK_EQ(s.best(0, conv, 35)->tokens.size(), size_t(10));  // then 30
        s.add(0, ckpt(prefix(conv, 50)));
        CHECK_EQ(s.count(0), size_t(3));
        CHECK_EQ(s.best(0, conv, 45)->tokens.size(), size_t(40));  // 40 survived the duplicate
        CheckpointStore two(1, 2);
        two.add(0, ckpt(prefix(conv, 30)));
        two.add(0, ckpt(prefix(conv, 20)));
        two.add(0, ckpt(prefix(conv, 10)));  // shorter than every kept one: the oldest goes
        CHECK(two.best(0, conv, 35)->tokens.size() == size_t(20) && two.count(0) == size_t(2));
        CheckpointStore one(1, 1);
        one.add(0, ckpt(prefix(conv, 10)));
        one.add(0, ckpt(prefix(conv, 20)));
        CHECK(one.count(0) == size_t(1) && one.best(0, conv, 99)->tokens.size() == size_t(20));
        CheckpointStore none(1, 0);
        none.add(0, ckpt(prefix(conv, 10)));
        CHECK_EQ(none.count(0), size_t(0));
    }
    {   // keep_prefixes_of(): drop what the slot's ids no longer start with
        CheckpointStore s(1, 4);
        s.add(0, ckpt(prefix(conv, 20)));
        s.add(0, ckpt(prefix(conv, 50)));
        s.add(0, ckpt(prefix(conv, 80)));
        V now = prefix(conv, 60);
        now.push_back(7);
        s.keep_prefixes_of(0, now);  // diverged at 60: the one at 80 goes
        CHECK_EQ(s.count(0), size_t(2));
        s.keep_prefixes_of(0, ids(40, 500));  // something else entirely
        CHECK_EQ(s.count(0), size_t(0));
    }
    {   // the window-cache choice
        SwaCacheMode m = SwaCacheMode::full;
        CHECK(parse_swa_cache_mode("auto", m) && m == SwaCacheMode::automatic);
        CHECK(parse_swa_cache_mode("checkpoints", m) && m == SwaCacheMode::checkpoints);
        CHECK(!parse_swa_cache_mode("small", m));
        CHECK(keep_full_swa_cache(SwaCacheMode::automatic, 100, 100));
        CHECK(!keep_full_swa_cache(SwaCacheMode::automatic, 101, 100));
        CHECK(keep_full_swa_cache(SwaCacheMode::automatic, 101, 0));
        CHECK(keep_full_swa_cache(SwaCacheMode::full, 101, 100));
        CHECK(!keep_full_swa_cache(SwaCacheMode::checkpoints, 1, 100));
    }
    {   // the fake engine's small window: truncate only within it; checkpoints bring older
        // positions back, and only onto the same ids
        FakeConfig cfg;
        cfg.capacity = 2;
        cfg.swa = 8;
        FakeEngine e(cfg);
        CHECK(e.info().supports_checkpoints && !e.info().trims_any_state && e.info().n_swa == 8);
        const V p = ids(30);
        StepItem it{0, p.data(), 20, false, true};
        CHECK(e.step(&it, 1) == Status::ok);
        std::vector<uint8_t> at20;
        CHECK(e.save_checkpoint(0, at20) == Status::ok);
        StepItem more{0, p.data() + 20, 10, false, true};
        CHECK(e.step(&more, 1) == Status::ok);
        CHECK_EQ(e.window_start(0), int64_t(22));
        CHECK(e.can_truncate(0, 25) && e.can_truncate(0, 0) && !e.can_truncate(0, 20));
        CHECK(e.truncate(0, 20) == Status::unsupported);
        CHECK_EQ(e.position(0), int64_t(30));
        CHECK(e.restore_checkpoint(0, 20, at20) == Status::ok);
        CHECK_EQ(e.position(0), int64_t(20));
        CHECK_EQ(e.window_start(0), int64_t(12));
        CHECK(e.can_truncate(0, 15));
        // A checkpoint onto other ids is refused loudly (the slot is reset).
        const V q = ids(30, 100);
        StepItem other{1, q.data(), 30, false, true};
        CHECK(e.step(&other, 1) == Status::ok);
        CHECK(e.restore_checkpoint(1, 20, at20) == Status::engine_error);
        CHECK_EQ(e.position(1), int64_t(0));
        // A saved (spilled) state keeps its window: loaded, it cuts back no further.
        std::vector<uint8_t> whole;
        CHECK(e.step(&more, 1) == Status::ok);  // slot 0 back at 30 (window 22)
        CHECK(e.save_state(0, whole) == Status::ok);
        CHECK(e.load_state(1, whole) == Status::ok);
        CHECK_EQ(e.position(1), int64_t(30));
        CHECK(!e.can_truncate(1, 20) && e.can_truncate(1, 22));
        // The full-size window cache cuts back anywhere and has no checkpoints.
        cfg.swa_full = true;
        FakeEngine full(cfg);
        CHECK(!full.info().supports_checkpoints && full.info().swa_cache == "full");
        CHECK(full.step(&it, 1) == Status::ok && full.step(&more, 1) == Status::ok);
        CHECK(full.truncate(0, 5) == Status::ok);
        CHECK(full.save_checkpoint(0, at20) == Status::unsupported);
    }
    return trioserve_test::finish("test_checkpoint_store");
}
