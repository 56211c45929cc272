// cancel_controller.h — per-id cancel state of spec §7 (pure, no I/O).
//
// Several generations are in flight at once (protocol 2); a cancel frame names one of them.
// Rules, by the frame's id:
//   * an active (admitted, not finished) generation that is not sealed: its own cancel flag is
//     set; if it takes part in the running step as an abortable item (a prefill chunk), the
//     abort hook runs too (Engine::request_abort) so the step stops early;
//   * an id greater than any request id read so far: latched (a bounded set) and applied the
//     moment that generate is admitted (it then ends at once, cancelled);
//   * a tokenize/detokenize call on the call thread (admit_call): its flag is set;
//   * anything else (finished, sealed, never a generate, id 0): ignored.
// seal(id) is a generation's terminal decision point (EOS, length, stop string): after it,
// frames for it change nothing; a cancel that came before the seal wins.
//
// Thread-safety: every method may be called from any thread. on_frame() runs on the watcher
// thread; the rest on the worker loop thread. A generation polls its own atomic flag (one
// acquire load) at each step boundary, so checking costs nothing on the hot path.
//
// Lifetime: the controller shares ownership of every registered flag (CancelFlag), so a frame
// can never write freed memory, whatever the order in which the generation, the worker loop
// and the watcher thread go away. The loop still unregisters each generation when it ends
// (finish), also every one still in flight when it shuts down: a stale entry would only waste
// memory, never corrupt it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

namespace trioserve {

/// One generation's cancel flag, shared by the generation and the controller.
using CancelFlag = std::shared_ptr<std::atomic<bool>>;

inline CancelFlag make_cancel_flag() { return std::make_shared<std::atomic<bool>>(false); }

class CancelController {
    struct Entry {
        CancelFlag flag;
        bool sealed;
        bool abortable;
    };
    using Map = std::map<uint64_t, Entry>;

public:
    using Hook = std::function<void()>;

    /// A registration prepared ahead of admission (prepare()): it holds the allocated map node,
    /// so admit(Registration&&) allocates nothing and cannot fail (two-phase admission,
    /// loop/admission.h).
    class Registration {
    public:
        Registration() = default;
        bool empty() const { return node_.empty(); }

    private:
        friend class CancelController;
        explicit Registration(Map::node_type node) : node_(std::move(node)) {}
        Map::node_type node_;
    };

    /// Most latched ids kept; a parent that cancels more unread ids than this loses the oldest.
    static constexpr size_t kMaxLatched = 4096;

    /// Installs the frame source's synchronous drain (ProcessWatcher::drain). sync() calls it.
    void set_frame_source(std::function<void()> drain) { drain_ = std::move(drain); }

    /// Installs the hook that aborts the running step (Engine::request_abort). It runs under
    /// the controller's lock: it must be cheap, non-blocking and must not call back in.
    void set_abort_hook(Hook hook) {
        std::lock_guard<std::mutex> lock(mu_);
        abort_hook_ = std::move(hook);
    }

    /// Reads every frame already queued on the cancel pipe, on the calling thread. The loop
    /// calls this before admitting a generate: a frame the parent wrote before the generate
    /// line is then guaranteed to be latched, although it travels on another pipe and the
    /// watcher thread may not have run yet.
    void sync() {
        if (drain_) drain_();
    }

    /// Handles one 8-byte frame (watcher thread, or the loop thread through sync()).
    void on_frame(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        if (id == 0) return;
        auto it = active_.find(id);
        if (it != active_.end()) {
            Entry& e = it->second;
            if (!e.sealed && !e.flag->load(std::memory_order_relaxed)) {
                e.flag->store(true, std::memory_order_release);
                if (e.abortable && abort_hook_) abort_hook_();
            }
            return;
        }
        if (auto c = calls_.find(id); c != calls_.end()) {  // a tokenize/detokenize in flight
            c->second->store(true, std::memory_order_release);
            return;
        }
        if (id > highest_read_) {  // not read yet: latch it
            latched_.insert(id);
            if (latched_.size() > kMaxLatched) latched_.erase(latched_.begin());
        }
    }

    /// The loop read a request line with this valid id that did not become an admitted
    /// generate (another op, or a generate that failed validation). Frames for it, and for any
    /// older id, are ignored from now on.
    void saw(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        advance(id);
    }

    /// Allocates generate `id`'s registration without registering it (may throw bad_alloc;
    /// changes nothing). `flag` must not be null.
    static Registration prepare(uint64_t id, CancelFlag flag) {
        Map scratch;
        scratch.emplace(id, Entry{std::move(flag), false, false});
        return Registration(scratch.extract(scratch.begin()));
    }

    /// Registers a prepared generate (allocates nothing). Returns true when a latched frame
    /// cancels it (its flag is then set). An id already registered keeps its first entry
    /// (ids strictly increase, so the loop never does this).
    bool admit(Registration&& r) {
        std::lock_guard<std::mutex> lock(mu_);
        const uint64_t id = r.node_.key();
        CancelFlag flag = r.node_.mapped().flag;  // a copy: the node may not be inserted
        const bool latched = latched_.erase(id) > 0;
        advance(id);
        active_.insert(std::move(r.node_));
        if (latched) flag->store(true, std::memory_order_release);
        return latched;
    }

    /// prepare() + admit() in one call.
    bool admit(uint64_t id, CancelFlag flag) { return admit(prepare(id, std::move(flag))); }

    /// Takes the terminal decision for `id`: later frames are ignored. Returns whether it was
    /// cancelled before the seal (then the outcome is "cancelled").
    bool seal(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = active_.find(id);
        if (it == active_.end()) return false;
        it->second.sealed = true;
        return it->second.flag->load(std::memory_order_relaxed);
    }

    /// Forgets finished generation `id` (after its terminal record): frames for it are stale.
    void finish(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        active_.erase(id);
    }

    /// Registers call `id` (a tokenize or detokenize handed to the call thread, call_worker.h):
    /// a frame for it sets `flag`, which the call thread polls. Returns true when a latched
    /// frame already cancels it (the flag is then set). Calls are kept apart from generations:
    /// they take no slot and no step. May throw bad_alloc (then nothing changed).
    bool admit_call(uint64_t id, CancelFlag flag) {
        std::lock_guard<std::mutex> lock(mu_);
        calls_.emplace(id, flag);
        const bool latched = latched_.erase(id) > 0;
        advance(id);
        if (latched) flag->store(true, std::memory_order_release);
        return latched;
    }

    /// Forgets call `id` (its reply was written, or it was dropped at shutdown).
    void finish_call(uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        calls_.erase(id);
    }

    size_t call_count() const {
        std::lock_guard<std::mutex> lock(mu_);
        return calls_.size();
    }


    /// Marks the generations whose cancel should abort the step about to run (their prefill
    /// chunks are in it, or their decode is the whole step). If one of them is already
    /// cancelled, the abort hook runs at once.
    void begin_step(const std::vector<uint64_t>& abortable) {
        std::lock_guard<std::mutex> lock(mu_);
        bool fire = false;
        for (uint64_t id : abortable) {
            auto it = active_.find(id);
            if (it == active_.end()) continue;
            it->second.abortable = true;
            fire |= it->second.flag->load(std::memory_order_relaxed) && !it->second.sealed;
        }
        if (fire && abort_hook_) abort_hook_();
    }

    /// The step is over: no generation is abortable any more.
    void end_step() {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& kv : active_) kv.second.abortable = false;
    }

    uint64_t highest_read() const {
        std::lock_guard<std::mutex> lock(mu_);
        return highest_read_;
    }
    size_t latched_count() const {
        std::lock_guard<std::mutex> lock(mu_);
        return latched_.size();
    }
    bool is_latched(uint64_t id) const {
        std::lock_guard<std::mutex> lock(mu_);
        return latched_.count(id) > 0;
    }
    size_t active_count() const {
        std::lock_guard<std::mutex> lock(mu_);
        return active_.size();
    }

private:
    void advance(uint64_t id) {
        if (id > highest_read_) highest_read_ = id;
        latched_.erase(latched_.begin(), latched_.upper_bound(highest_read_));
    }

    mutable std::mutex mu_;
    Map active_;
    std::map<uint64_t, CancelFlag> calls_;  ///< calls on the call thread (admit_call)
    std::set<uint64_t> latched_;
    uint64_t highest_read_ = 0;
    Hook abort_hook_;
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
