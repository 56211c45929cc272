// draft_index.h — where speculative drafts come from when there is no draft model (pure;
// unit-tested in cpp/tests/test_speculation.cpp). Spec: spec/worker-protocol.md §4.6.
//
// Two sources, both n-gram tables that answer "the last n tokens occurred before: what
// followed them there?":
//   RequestDraftIndex  one generation's own tokens (prompt, which carries the session's earlier
//                      turns, then its output so far). An agent that re-emits a file it read,
//                      or a patch whose context lines come from the prompt, drafts from here.
//                      Built at admission, grows with the output, dies with the generation:
//                      nothing leaks into an unrelated request.
//   GlobalDraftIndex   the recent outputs of every generation of this worker, in a fixed ring
//                      of tokens with a fixed hash table (bounded memory, reported in the ready
//                      record); the oldest output is overwritten first (aged FIFO), and an
//                      entry whose tokens were overwritten is recognised as stale by
//                      comparing ids, never trusted. A fleet of agents doing similar edits
//                      drafts from each other's outputs here.
// The longest match wins (a longer matched suffix predicts its continuation better); the
// request's own tokens win a tie.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "engine.h"

namespace trioserve {

namespace draft_detail {

/// Hash of ids[0..n) (FNV-1a over the 32-bit ids, then a final mix).
inline uint64_t hash_ids(const TokenId* ids, size_t n) {
    uint64_t h = 1469598103934665603ull ^ n;
    for (size_t i = 0; i < n; ++i) {
        h ^= static_cast<uint32_t>(ids[i]);
        h *= 1099511628211ull;
    }
    h ^= h >> 29;
    return h;
}

}  // namespace draft_detail

/// A draft: up to `max` tokens that followed an earlier occurrence of the current suffix.
struct Draft {
    size_t match = 0;  ///< length of the matched suffix (0: no draft)
    std::vector<TokenId> tokens;
    enum class Source { none, request, global } source = Source::none;
};

/// N-gram sizes both indexes use, longest first: a suffix of 8 ids matched again is almost
/// surely a copy; 2 is the shortest that still predicts better than chance in code.
inline constexpr size_t kDraftNgrams[] = {8, 4, 2};

/// One generation's tokens with, for each n-gram size, where each n-gram last ended (the
/// position of the token that followed it). O(1) per appended token (one insert per size).
class RequestDraftIndex {
public:
    /// Appends `t` and indexes the n-grams that end just before it (so the current suffix is
    /// never its own match: its continuation is not known yet).
    void append(TokenId t) {
        const size_t at = ids_.size();
        for (size_t s = 0; s < kSizes; ++s) {
            const size_t n = kDraftNgrams[s];
            if (at >= n) maps_[s][draft_detail::hash_ids(ids_.data() + at - n, n)] = static_cast<uint32_t>(at);
        }
        ids_.push_back(t);
    }
    void append(const TokenId* t, size_t n) {
        for (size_t i = 0; i < n; ++i) append(t[i]);
    }

    size_t size() const { return ids_.size(); }

    /// The longest indexed suffix of the tokens that occurred before, and up to `max` tokens
    /// that followed its most recent earlier occurrence. Ids are compared: a hash collision
    /// gives no draft, never a wrong match length.
    Draft draft(size_t max) const {
        Draft d;
        const size_t len = ids_.size();
        if (max == 0) return d;
        for (size_t s = 0; s < kSizes; ++s) {
            const size_t n = kDraftNgrams[s];
            if (len < n) continue;
            const auto it = maps_[s].find(draft_detail::hash_ids(ids_.data() + len - n, n));
            if (it == maps_[s].end()) continue;
            const size_t cont = it->second;  // the earlier occurrence ends at cont - 1
            if (cont < n || cont >= len || !std::equal(ids_.begin() + static_cast<std::ptrdiff_t>(cont - n),
                                                       ids_.begin() + static_cast<std::ptrdiff_t>(cont),
                                                       ids_.begin() + static_cast<std::ptrdiff_t>(len - n)))
                continue;
            d.match = n;
            d.source = Draft::Source::request;
            const size_t end = std::min(len, cont + max);
            d.tokens.assign(ids_.begin() + static_cast<std::ptrdiff_t>(cont), ids_.begin() + static_cast<std::ptrdiff_t>(end));
            return d;
        }
        return d;
    }

    /// The last `n` ids (fewer when shorter).
    const TokenId* tail(size_t n, size_t& got) const {
        got = std::min(n, ids_.size());
        return ids_.data() + ids_.size() - got;
    }

private:
    static constexpr size_t kSizes = sizeof(kDraftNgrams) / sizeof(kDraftNgrams[0]);
    std::vector<TokenId> ids_;
    std::unordered_map<uint64_t, uint32_t> maps_[kSizes];
};

/// Recent outputs of all generations: a ring of `capacity` ids (absolute positions, the
/// oldest overwritten first) and an open-addressed table of `capacity` entries (n-gram hash →
/// absolute position of the token that followed it; a newer n-gram overwrites its bucket).
/// Memory: capacity × (4 + 16) bytes, fixed at construction. Outputs are separated by a
/// boundary id (-1) that matches no token, so a continuation never runs into another output.
/// Only the longer n-grams are indexed here: across requests a short match is mostly chance.
class GlobalDraftIndex {
public:
    explicit GlobalDraftIndex(size_t capacity) : cap_(capacity) {
        if (cap_ == 0) return;
        ring_.assign(cap_, kBoundary);
        table_.assign(cap_, Entry{});
    }

    size_t capacity_tokens() const { return cap_; }
    uint64_t bytes() const { return static_cast<uint64_t>(cap_) * (sizeof(TokenId) + sizeof(Entry)); }
    uint64_t outputs_added() const { return outputs_; }

    /// Adds one finished output (its generated ids; the `context` ids before it, e.g. the
    /// prompt's last few, let a later request's matching context draft its first tokens).
    void add_output(const TokenId* context, size_t n_context, const TokenId* ids, size_t n) {
        if (cap_ == 0 || n == 0) return;
        ++outputs_;
        const uint64_t start = next_;
        for (size_t i = 0; i < n_context; ++i) push(context[i], start);
        for (size_t i = 0; i < n; ++i) push(ids[i], start);
        push(kBoundary, start);
    }

    /// Like RequestDraftIndex::draft() over the ring, for the suffix `tail[0..n)` of a
    /// request's tokens; only n-grams of kMinGlobalNgram ids or more.
    Draft draft(const TokenId* tail, size_t n, size_t max) const {
        Draft d;
        if (cap_ == 0 || max == 0) return d;
        for (const size_t g : kDraftNgrams) {
            if (g < kMinGlobalNgram || n < g) continue;
            const TokenId* suffix = tail + n - g;
            const uint64_t h = draft_detail::hash_ids(suffix, g);
            const Entry& e = table_[h % cap_];
            if (e.hash != h || e.pos == 0) continue;
            const uint64_t cont = e.pos;  // absolute position after the n-gram
            if (cont < g || cont + cap_ <= next_ + g || cont >= next_) continue;  // overwritten or not followed yet
            bool same = true;
            for (size_t k = 0; k < g && same; ++k) same = at(cont - g + k) == suffix[k];
            if (!same) continue;
            d.match = g;
            d.source = Draft::Source::global;
            for (uint64_t p = cont; p < next_ && d.tokens.size() < max; ++p) {
                const TokenId t = at(p);
                if (t == kBoundary) break;
                d.tokens.push_back(t);
            }
            if (d.tokens.empty()) d.match = 0;
            return d;
        }
        return d;
    }

private:
    static constexpr TokenId kBoundary = -1;
    static constexpr size_t kMinGlobalNgram = 4;
    struct Entry {
        uint64_t hash = 0;
        uint64_t pos = 0;  ///< absolute position of the continuation (0: empty)
    };

    TokenId at(uint64_t abs) const { return ring_[abs % cap_]; }

    /// Appends `t` at the next absolute position, indexing the n-grams (within the output
    /// that began at `start`) that end just before it.
    void push(TokenId t, uint64_t start) {
        const uint64_t p = next_;
        if (p > start) {
            for (const size_t g : kDraftNgrams) {
                if (g < kMinGlobalNgram || p - start < g) continue;
                TokenId buf[8];
                for (size_t k = 0; k < g; ++k) buf[k] = at(p - g + k);
                const uint64_t h = draft_detail::hash_ids(buf, g);
                table_[h % cap_] = Entry{h, p};
            }
        }
        ring_[p % cap_] = t;
        ++next_;
    }

    size_t cap_;
    std::vector<TokenId> ring_;
    std::vector<Entry> table_;
    uint64_t next_ = 1;  ///< absolute position of the next id (0 marks an empty entry)
    uint64_t outputs_ = 0;
};

}  // namespace trioserve
