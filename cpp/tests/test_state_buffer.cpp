// Unit tests for the spare state buffer: refill to the size last saved, stop between pieces,
// small states left to the allocator, give() keeps the larger buffer.
#include "check.h"
#include "state_buffer.h"

using namespace trioserve;

int main() {
    constexpr size_t MiB = size_t(1) << 20;
    {   // nothing saved yet: no work, take() is empty
        SpareStateBuffer b;
        CHECK(!b.needs_refill());
        CHECK(b.take().empty());
    }
    {   // a large state: the refill prepares it, rounded up to a MiB, and take() hands it out
        SpareStateBuffer b;
        b.note_size(9 * MiB + 5);
        CHECK_EQ(b.target(), 10 * MiB);
        CHECK(b.needs_refill());
        b.refill([] { return false; });
        CHECK(!b.needs_refill());
        std::vector<uint8_t> v = b.take();
        CHECK_EQ(v.size(), 10 * MiB);
        CHECK(b.needs_refill());  // taken: the next idle refill prepares another one
        b.give(std::move(v));     // a copy's scratch comes back
        CHECK(!b.needs_refill());
    }
    {   // a copy's scratch given back holds exactly the last state: kept as it is, not replaced
        // by a larger buffer that a save would have to fault in again (back-to-back copies)
        SpareStateBuffer b;
        std::vector<uint8_t> scratch(9 * MiB + 5);
        const uint8_t* data = scratch.data();
        b.note_size(scratch.size());
        b.give(std::move(scratch));
        CHECK(!b.needs_refill());
        int asked = 0;
        b.refill([&asked] { return ++asked > 0; });
        std::vector<uint8_t> again = b.take();
        CHECK(again.data() == data);
        CHECK_EQ(again.size(), 9 * MiB + 5);
        b.give(std::move(again));
        b.note_size(9 * MiB + 100);  // a slightly larger state: the refill grows to the target
        CHECK(b.needs_refill());
        b.refill([] { return false; });
        CHECK(!b.needs_refill());
        CHECK_EQ(b.take().size(), 10 * MiB);
    }
    {   // stop() is asked before every piece: an arriving line interrupts the refill
        SpareStateBuffer b;
        b.note_size(3 * SpareStateBuffer::kRefillPiece);
        int asked = 0;
        b.refill([&asked] { return ++asked > 1; });  // one piece, then stop
        CHECK_EQ(asked, 2);
        CHECK(b.needs_refill());
        CHECK(b.capacity() >= b.target());  // reserved once; the rest is touched later
        b.refill([] { return false; });
        CHECK(!b.needs_refill());
    }
    {   // small states (the fake engine's) keep no spare
        SpareStateBuffer b;
        b.note_size(4 * MiB);
        b.refill([] { return false; });
        b.note_size(1000);
        CHECK(!b.needs_refill());
        CHECK_EQ(b.capacity(), size_t(0));
        b.give(std::vector<uint8_t>(1000));
        CHECK_EQ(b.capacity(), size_t(0));
    }
    {   // give() keeps the larger of the two
        SpareStateBuffer b;
        b.give(std::vector<uint8_t>(2 * MiB));
        b.give(std::vector<uint8_t>(MiB));
        CHECK_EQ(b.capacity(), 2 * MiB);
    }
    return trioserve_test::finish("test_state_buffer");
}
