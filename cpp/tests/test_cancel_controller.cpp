// Unit tests for CancelController (per-id: active, latched, stale, sealed, step abort) and
// FrameAssembler.
#include "cancel_controller.h"
#include "check.h"

#include <atomic>
#include <thread>
#include <vector>

using trioserve::CancelController;
using trioserve::FrameAssembler;

int main() {
    {   // cancel of one active generation leaves the others alone
        CancelController c;
        trioserve::CancelFlag a = trioserve::make_cancel_flag(), b = trioserve::make_cancel_flag();
        CHECK(!c.admit(1, a));
        CHECK(!c.admit(2, b));
        c.on_frame(2);
        CHECK(!a->load());
        CHECK(b->load());
        CHECK(c.seal(2));
        CHECK(!c.seal(1));
        c.finish(1);
        c.finish(2);
        CHECK_EQ(c.active_count(), size_t(0));
    }
    {   // latched: a frame for an id not read yet cancels that generate at admission
        CancelController c;
        trioserve::CancelFlag f = trioserve::make_cancel_flag();
        c.on_frame(5);
        CHECK(c.is_latched(5));
        CHECK(c.admit(5, f));
        CHECK(f->load());
        CHECK_EQ(c.latched_count(), size_t(0));
        c.finish(5);
    }
    {   // several latched ids; reading a line drops latches at or below its id
        CancelController c;
        trioserve::CancelFlag f6 = trioserve::make_cancel_flag(), f9 = trioserve::make_cancel_flag();
        c.on_frame(7);
        c.on_frame(9);
        c.on_frame(8);
        CHECK_EQ(c.latched_count(), size_t(3));
        CHECK(!c.admit(6, f6));   // not latched itself; 7, 8, 9 still are
        CHECK_EQ(c.latched_count(), size_t(3));
        c.saw(8);                  // a ping with id 8: 7 and 8 were never generates
        CHECK_EQ(c.latched_count(), size_t(1));
        CHECK(c.admit(9, f9));
        CHECK(f9->load());
        CHECK(!f6->load());
    }
    {   // stale frames (finished, failed, never a generate) and id 0 are ignored
        CancelController c;
        trioserve::CancelFlag f = trioserve::make_cancel_flag(), g = trioserve::make_cancel_flag();
        c.admit(3, f);
        c.finish(3);
        c.on_frame(3);   // finished
        c.saw(4);        // a generate 4 that failed validation
        c.on_frame(4);
        c.on_frame(2);   // older, never active
        c.on_frame(0);
        CHECK_EQ(c.latched_count(), size_t(0));
        CHECK(!c.admit(5, g));
        CHECK(!g->load());
        CHECK_EQ(c.highest_read(), uint64_t(5));
    }
    {   // sealed: a cancel after the terminal decision changes nothing
        CancelController c;
        trioserve::CancelFlag f = trioserve::make_cancel_flag();
        int aborts = 0;
        c.set_abort_hook([&] { ++aborts; });
        c.admit(10, f);
        CHECK(!c.seal(10));
        c.on_frame(10);
        CHECK(!f->load());
        CHECK_EQ(aborts, 0);
        c.finish(10);
    }
    {   // the abort hook runs only for a generation that is abortable in the running step
        CancelController c;
        trioserve::CancelFlag a = trioserve::make_cancel_flag(), b = trioserve::make_cancel_flag();
        int aborts = 0;
        c.set_abort_hook([&] { ++aborts; });
        c.admit(11, a);
        c.admit(12, b);
        c.begin_step({12});
        c.on_frame(11);  // decoding, not abortable: flag only
        CHECK(a->load());
        CHECK_EQ(aborts, 0);
        c.on_frame(12);
        c.on_frame(12);  // duplicate: hook once
        CHECK(b->load());
        CHECK_EQ(aborts, 1);
        c.end_step();
        c.finish(11);
        c.finish(12);
    }
    {   // a generation already cancelled when its step begins aborts that step at once
        CancelController c;
        trioserve::CancelFlag a = trioserve::make_cancel_flag();
        int aborts = 0;
        c.set_abort_hook([&] { ++aborts; });
        c.admit(20, a);
        c.on_frame(20);
        CHECK_EQ(aborts, 0);
        c.begin_step({20});
        CHECK_EQ(aborts, 1);
        c.end_step();
        c.on_frame(20);
        CHECK_EQ(aborts, 1);
    }
    {   // the latch set is bounded: the oldest latched id is dropped
        CancelController c;
        for (uint64_t i = 1; i <= CancelController::kMaxLatched + 5; ++i) c.on_frame(100 + i);
        CHECK_EQ(c.latched_count(), CancelController::kMaxLatched);
        CHECK(!c.is_latched(101));
        CHECK(c.is_latched(100 + CancelController::kMaxLatched + 5));
    }
    {   // concurrent frames from another thread (TSan-friendly smoke test)
        CancelController c;
        trioserve::CancelFlag f = trioserve::make_cancel_flag();
        c.admit(100, f);
        std::thread t([&] { for (uint64_t i = 90; i <= 110; ++i) c.on_frame(i); });
        t.join();
        CHECK(f->load());
        CHECK_EQ(c.latched_count(), size_t(10));  // 101..110 were not read yet
    }
    {   // lifetime: the controller shares each flag, so a frame for a generation whose owner
        // is gone (not yet unregistered) writes live memory; finish() lets go of it
        CancelController c;
        std::weak_ptr<std::atomic<bool>> seen;
        {
            trioserve::CancelFlag f = trioserve::make_cancel_flag();
            seen = f;
            c.admit(30, f);
        }                       // the generation's own reference is gone
        c.on_frame(30);         // ASan would report a write to freed memory with a raw pointer
        CHECK(!seen.expired());
        CHECK(seen.lock()->load());
        c.admit(31, trioserve::make_cancel_flag());
        CHECK_EQ(c.active_count(), size_t(2));
        c.finish(30);
        c.finish(31);
        CHECK_EQ(c.active_count(), size_t(0));
        CHECK(seen.expired());  // unregistered: the controller let go of the flag
        c.on_frame(31);         // stale now: ignored, not latched (31 was read)
        CHECK_EQ(c.latched_count(), size_t(0));
    }
    {   // two-phase registration: prepare() changes nothing; admit() applies a latched frame
        CancelController c;
        c.on_frame(41);
        trioserve::CancelFlag f = trioserve::make_cancel_flag();
        CancelController::Registration r = CancelController::prepare(41, f);
        CHECK(!r.empty());
        CHECK_EQ(c.active_count(), size_t(0));
        CHECK(c.is_latched(41));
        CHECK(!f->load());
        CHECK(c.admit(std::move(r)));
        CHECK(f->load());
        CHECK_EQ(c.active_count(), size_t(1));
        CHECK_EQ(c.highest_read(), uint64_t(41));
        CancelController::Registration unused = CancelController::prepare(42, trioserve::make_cancel_flag());
        CHECK_EQ(c.active_count(), size_t(1));  // dropping a prepared registration registers nothing
    }
    {   // frames assembled from arbitrary chunks, little-endian
        FrameAssembler fa;
        std::vector<uint64_t> ids;
        const unsigned char bytes[] = {1, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x01, 0, 0, 0, 0, 0, 0x80};
        fa.feed(bytes, 3, [&](uint64_t id) { ids.push_back(id); });
        fa.feed(bytes + 3, 10, [&](uint64_t id) { ids.push_back(id); });
        fa.feed(bytes + 13, 3, [&](uint64_t id) { ids.push_back(id); });
        CHECK_EQ(ids.size(), size_t(2));
        CHECK_EQ(ids[0], uint64_t(1));
        CHECK_EQ(ids[1], uint64_t(0x8000000000000102ull));
    }
    return trioserve_test::finish("test_cancel_controller");
}
