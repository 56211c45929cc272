// swa_cache.h — how a sliding-window model's window cache is kept (spec §6.3, §10).
//
// llama.cpp keeps the sliding-window layers' cache full-size by default (swa_full: n_ctx cells
// per slot, like a full-attention layer), so every position stays reachable by truncation, at
// the memory of a full-attention layer. With a small cache (the last window plus a batch) those
// layers cost a fraction of it, but a slot can then be cut back only within its window; the
// worker saves checkpoints at turn boundaries to reach older positions (checkpoint_store.h).
//   full         always the full-size cache
//   checkpoints  always the small cache + checkpoints
//   auto         the full-size cache when capacity x n_ctx cells of every layer at full size fit
//                the KV budget, else the small one (the default)
#pragma once

#include <cstdint>
#include <string>

namespace trioserve {

enum class SwaCacheMode { full, checkpoints, automatic };

/// Parses "full" | "checkpoints" | "auto"; false for anything else.
inline bool parse_swa_cache_mode(const std::string& s, SwaCacheMode& out) {
    if (s == "full") out = SwaCacheMode::full;
    else if (s == "checkpoints") out = SwaCacheMode::checkpoints;
    else if (s == "auto") out = SwaCacheMode::automatic;
    else return false;
    return true;
}

/// Whether to keep the full-size window cache: `full_bytes` is the KV memory with every layer at
/// n_ctx cells, `budget` the KV budget (0: none, so it fits).
inline bool keep_full_swa_cache(SwaCacheMode mode, uint64_t full_bytes, uint64_t budget) {
    switch (mode) {
        case SwaCacheMode::full: return true;
        case SwaCacheMode::checkpoints: return false;
        case SwaCacheMode::automatic: return budget == 0 || full_bytes <= budget;
    }
    return true;
}

}  // namespace trioserve
