// stop_matcher.h — stop strings matched across token boundaries (spec §4.1).
//
// CONTRACT: a stop string is never emitted, and text is held back only while it could still
// become the start of a stop string (the longest suffix of the held text that is a proper
// prefix of some stop). When several stops occur, the one that starts earliest wins (ties:
// the longest). Input must be valid UTF-8 (the output of Utf8Assembler): a held suffix then
// always starts on a character boundary, so emitted text is valid UTF-8 too.
// Pinned by cpp/tests/test_stop_matcher.cpp and tests/worker_process/test_fake_worker.py.
//
// Thread-safety: none; one matcher per generation.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace trioserve {

class StopMatcher {
public:
    StopMatcher() = default;
    explicit StopMatcher(std::vector<std::string> stops) { reset(std::move(stops)); }

    /// Replaces the stop list (empty strings are ignored) and clears held text.
    void reset(std::vector<std::string> stops) {
        stops_.clear();
        max_len_ = 0;
        for (auto& s : stops) {
            if (s.empty()) continue;
            max_len_ = std::max(max_len_, s.size());
            stops_.push_back(std::move(s));
        }
        held_.clear();
        hit_ = -1;
    }

    /// Feeds text. Appends to `emit` what is safe to show now. Returns true when a stop string
    /// matched: `emit` then got the text before it, and everything from the stop on is dropped.
    /// After a hit, further pushes are ignored.
    bool push(std::string_view text, std::string& emit) {
        if (hit_ >= 0) return true;
        if (stops_.empty()) { emit.append(text); return false; }
        held_.append(text);
        size_t best_pos = std::string::npos;
        for (size_t k = 0; k < stops_.size(); ++k) {
            size_t p = held_.find(stops_[k]);
            if (p == std::string::npos) continue;
            if (p < best_pos || (p == best_pos && stops_[k].size() > stops_[hit_].size())) {
                best_pos = p;
                hit_ = static_cast<int>(k);
            }
        }
        if (hit_ >= 0) {
            emit.append(held_, 0, best_pos);
            held_.clear();
            return true;
        }
        size_t keep = held_suffix_len();
        emit.append(held_, 0, held_.size() - keep);
        held_.erase(0, held_.size() - keep);
        return false;
    }

    /// Ends the stream without a hit: appends the held text to `emit`.
    void flush(std::string& emit) {
        if (hit_ < 0) emit.append(held_);
        held_.clear();
    }

    /// Index of the matched stop, or -1.
    int hit_index() const { return hit_; }
    const std::string& stop(size_t k) const { return stops_[k]; }
    size_t held_size() const { return held_.size(); }

private:
    // Longest suffix of held_ that is a proper prefix of some stop.
    size_t held_suffix_len() const {
        size_t limit = std::min(held_.size(), max_len_ - 1);
        for (size_t len = limit; len > 0; --len) {
            std::string_view suffix(held_.data() + held_.size() - len, len);
            for (const auto& s : stops_) {
                if (s.size() > len && std::string_view(s).substr(0, len) == suffix) return len;
            }
        }
        return 0;
    }

    std::vector<std::string> stops_;
    size_t max_len_ = 0;
    std::string held_;
    int hit_ = -1;
};

}  // namespace trioserve
