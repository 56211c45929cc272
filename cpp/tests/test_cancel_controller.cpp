// Unit tests for CancelController (latch, seal, stale) and FrameAssembler.
#include "cancel_controller.h"
#include "check.h"

#include <thread>
#include <vector>

using trioserve::CancelController;
using trioserve::FrameAssembler;

int main() {
    {   // cancel of the active request
        CancelController c;
        c.begin(1);
        CHECK(!c.cancelled());
        c.on_frame(1);
        CHECK(c.cancelled());
        CHECK(c.seal());
        c.end(1);
        CHECK(!c.cancelled());
    }
    {   // latched: a frame before its request starts cancels it at begin()
        CancelController c;
        c.on_frame(5);
        CHECK_EQ(c.pending(), uint64_t(5));
        c.begin(5);
        CHECK(c.cancelled());
        c.end(5);
        CHECK_EQ(c.pending(), uint64_t(0));
    }
    {   // latched for a later id survives an earlier request; a later frame replaces it
        CancelController c;
        c.on_frame(7);
        c.begin(6);
        CHECK(!c.cancelled());
        c.on_frame(8);  // newer than the active one: latched, replacing 7
        CHECK(!c.cancelled());
        c.end(6);
        CHECK_EQ(c.pending(), uint64_t(8));
        c.begin(7);
        CHECK(!c.cancelled());
        c.end(7);
        c.begin(8);
        CHECK(c.cancelled());
        c.end(8);
    }
    {   // stale frames (finished ids) and id 0 are ignored
        CancelController c;
        c.begin(3);
        c.end(3);
        c.on_frame(3);
        c.on_frame(2);
        c.on_frame(0);
        CHECK_EQ(c.pending(), uint64_t(0));
        c.begin(4);
        CHECK(!c.cancelled());
        c.end(4);
    }
    {   // sealed: a cancel after the terminal decision changes nothing
        CancelController c;
        int hooks = 0;
        c.begin(10);
        c.set_stop_hook([&] { ++hooks; });
        CHECK(!c.seal());
        c.on_frame(10);
        CHECK(!c.cancelled());
        CHECK_EQ(hooks, 0);
        c.end(10);
    }
    {   // stop hook runs on cancel, and at once when installed after a latched cancel
        CancelController c;
        int hooks = 0;
        c.begin(11);
        c.set_stop_hook([&] { ++hooks; });
        c.on_frame(11);
        c.on_frame(11);  // duplicate: hook once
        CHECK_EQ(hooks, 1);
        c.end(11);
        c.on_frame(12);
        c.begin(12);
        c.set_stop_hook([&] { ++hooks; });
        CHECK_EQ(hooks, 2);
        c.end(12);
    }
    {   // concurrent frames from another thread (TSan-friendly smoke test)
        CancelController c;
        c.begin(100);
        std::thread t([&] { for (uint64_t i = 90; i <= 100; ++i) c.on_frame(i); });
        t.join();
        CHECK(c.cancelled());
        c.end(100);
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
