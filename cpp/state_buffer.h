// state_buffer.h — a spare buffer for engine states (shared-prefix copies, spills), allocated
// and touched while the worker is idle so that saving a state on a request's path does not
// fault in fresh memory.
//
// Why: a slot's state is tens to hundreds of MB (SmolLM2-135M: 23 KiB a token, 33 MB for a
// 1,450-token system prompt). Saving it into a new std::vector costs a page fault and a zero
// fill per 4 KiB page: measured ~90 ms for 33 MB on the 2-core dev VM (load ~10), against
// 5–10 ms for the same llama_state_seq_get_data into a buffer already touched. That was most of
// a shared-prefix copy and of an eviction's spill, both on the path of a new session's first
// token.
//
// Use: take() before a save (the spare, or an empty vector), give() a buffer back when its
// bytes are no longer needed (a copy's scratch), note_size() after a save so that the next
// refill() prepares as much. Small states (< kMinBytes) are left to the allocator: its free
// lists reuse touched memory below the mmap threshold, and the fake engine's tests see no
// change. Memory: at most one state of the size last saved (itself at most one slot's KV),
// held while idle. Single-threaded (the loop thread).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace trioserve {

class SpareStateBuffer {
public:
    static constexpr size_t kMinBytes = size_t(1) << 20;
    /// refill() touches this much between two stop() checks: a line that arrives meanwhile
    /// waits at most for one piece (a few ms).
    static constexpr size_t kRefillPiece = size_t(4) << 20;

    /// The spare for a save (moved out; the spare is empty until give() or refill()). Its
    /// size is whatever was touched; the engine resizes it to the state (no reallocation
    /// when the capacity suffices).
    std::vector<uint8_t> take() { return std::move(spare_); }

    /// Keeps `buf` as the spare when it is at least as large as the current one (a copy's
    /// scratch comes back here; a spilled state does not).
    void give(std::vector<uint8_t>&& buf) {
        if (buf.capacity() >= spare_.capacity() && buf.capacity() >= kMinBytes) spare_ = std::move(buf);
    }

    /// A state of `bytes` was just saved: a spare smaller than that is refilled to that much
    /// rounded up to a MiB (so states that grow by a few tokens still fit); below kMinBytes,
    /// nothing.
    void note_size(size_t bytes) {
        needed_ = bytes < kMinBytes ? 0 : bytes;
        target_ = (needed_ + kMinBytes - 1) / kMinBytes * kMinBytes;
        if (target_ == 0) spare_ = std::vector<uint8_t>();
    }

    /// Whether refill() has work: the spare is smaller than the last state saved. A spare that
    /// holds it but not the rounded target (a copy's scratch given back: exactly the state's
    /// size) is kept as it is: replacing it by a larger, not yet touched buffer would make the
    /// next save fault its pages in again when no idle moment comes between two requests.
    bool needs_refill() const { return spare_.size() < needed_; }

    /// When needs_refill(): grows and touches the spare towards the target, a piece at a time,
    /// calling `stop()` before each piece; returns early (keeping what was touched) when it
    /// says true. May throw bad_alloc (nothing is lost: the spare is a cache).
    template <class Stop>
    void refill(Stop&& stop) {
        if (!needs_refill()) return;
        if (spare_.capacity() < target_) {
            std::vector<uint8_t> grown;
            grown.reserve(target_);  // no copy of the old spare's bytes: they mean nothing
            spare_ = std::move(grown);
        }
        while (spare_.size() < target_ && !stop())  // (to the target, now that it grows anyway)
            spare_.resize(std::min(target_, spare_.size() + kRefillPiece));  // zero fill = touch
    }

    size_t capacity() const { return spare_.capacity(); }
    size_t target() const { return target_; }

private:
    std::vector<uint8_t> spare_;
    size_t needed_ = 0;  ///< the last state's size (0: below kMinBytes)
    size_t target_ = 0;  ///< needed_ rounded up to a MiB: what a refill prepares
};

}  // namespace trioserve
