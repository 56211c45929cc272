// cancel_controller.h — the per-request cancel state machine of spec §7 (pure, no I/O).
//
// The cancel watcher thread (cancel_watcher.h) feeds it frames; the decode loop brackets each
// generate with begin()/end() and polls cancelled() at every decode step. Rules:
//   * a frame for the active request cancels it (unless the request is already sealed);
//   * a frame for an id newer than any started is latched (one slot; a later frame replaces
//     an earlier one) and cancels that request the moment begin() activates it;
//   * a frame for an id <= the last finished one, or older than the active one, is stale and
//     ignored; id 0 is ignored;
//   * seal() is the terminal decision point: after it, frames change nothing.
//
// Thread-safety: every method may be called from any thread. on_frame() runs on the watcher
// thread; the rest on the decode loop thread. cancelled() is one relaxed-acquire atomic load so
// the decode loop can poll it every step for free.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>

namespace trioserve {

class CancelController {
public:
    using StopHook = std::function<void()>;

    /// Installs the frame source's synchronous drain (ProcessWatcher::drain). sync() calls it.
    void set_frame_source(std::function<void()> drain) { drain_ = std::move(drain); }

    /// Reads every frame already queued on the cancel pipe, on the calling thread. The loop
    /// calls this right before a generate starts: a frame the parent wrote before writing the
    /// generate line is then guaranteed to be seen (latched) even though it travels on
    /// another pipe than the request and the watcher thread may not have run yet.
    void sync() {
        if (drain_) drain_();
    }

    /// Handles one 8-byte frame (watcher thread).
    void on_frame(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        if (id == 0 || id <= last_finished_) return;
        if (active_ != 0 && id == active_) {
            if (!sealed_ && !cancelled_.load(std::memory_order_relaxed)) {
                cancelled_.store(true, std::memory_order_release);
                if (hook_) hook_();
            }
            return;
        }
        if (id > active_) pending_ = id;  // newer than anything started: latch it
        // else: older than the active request and not finished: it never ran here; ignore.
    }

    /// Activates request `id` (decode loop). Applies a latched cancel for exactly this id.
    void begin(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        active_ = id;
        sealed_ = false;
        hook_ = nullptr;
        bool latched = (pending_ == id);
        if (pending_ <= id) pending_ = 0;
        cancelled_.store(latched, std::memory_order_release);
    }

    /// Installs a hook called (under the controller's lock, from whichever thread observes the
    /// cancel) when the active request gets cancelled — e.g. Session::request_stop(), which
    /// interrupts a running prefill. Called at once if the request is already cancelled.
    /// The hook must be cheap, non-blocking and must not call back into the controller.
    void set_stop_hook(StopHook hook) {
        std::lock_guard<std::mutex> lock(mu_);
        hook_ = std::move(hook);
        if (hook_ && cancelled_.load(std::memory_order_relaxed) && !sealed_) hook_();
    }

    /// Hot path: has the active request been cancelled?
    bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

    /// Takes the terminal decision: later frames are ignored. Returns whether the request was
    /// cancelled before the seal (then the cancel wins and the outcome is "cancelled").
    bool seal() {
        std::lock_guard<std::mutex> lock(mu_);
        sealed_ = true;
        return cancelled_.load(std::memory_order_relaxed);
    }

    /// Finishes request `id`: it and every older id become stale. Drops the stop hook.
    void end(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        if (id > last_finished_) last_finished_ = id;
        if (pending_ <= last_finished_) pending_ = 0;
        active_ = 0;
        sealed_ = true;
        hook_ = nullptr;
        cancelled_.store(false, std::memory_order_release);
    }

    uint64_t last_finished() const {
        std::lock_guard<std::mutex> lock(mu_);
        return last_finished_;
    }
    uint64_t pending() const {
        std::lock_guard<std::mutex> lock(mu_);
        return pending_;
    }

private:
    mutable std::mutex mu_;
    std::atomic<bool> cancelled_{false};
    uint64_t active_ = 0;
    uint64_t last_finished_ = 0;
    uint64_t pending_ = 0;
    bool sealed_ = true;
    StopHook hook_;
    std::function<void()> drain_;  ///< set once before the loop starts; not guarded
};

/// Assembles 8-byte little-endian frames from arbitrary read chunks (watcher thread).
class FrameAssembler {
public:
    template <typename F>
    void feed(const unsigned char* data, size_t n, F&& on_id) {
        for (size_t i = 0; i < n; ++i) {
            buf_[len_++] = data[i];
            if (len_ == 8) {
                uint64_t id = 0;
                for (int b = 7; b >= 0; --b) id = (id << 8) | buf_[b];
                len_ = 0;
                on_id(id);
            }
        }
    }

private:
    unsigned char buf_[8] = {};
    size_t len_ = 0;
};

}  // namespace trioserve
