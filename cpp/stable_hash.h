// stable_hash.h — one 64-bit hash stable across builds and runs (std::hash is neither), for
// what is written to disk or compared between processes: state files' checksums and names
// (state_store.h) and the kernel probe memory's keys (engines/llama/probe_memory.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace trioserve {

/// 64-bit checksum of `n` bytes (FNV-1a over 8-byte words, then the tail bytes, then a
/// final mix): fast enough for hundreds of MB per second on the writer thread and at load.
/// Detects corruption, not tampering (files are the server user's own, mode 0600).
inline uint64_t state_hash(const uint8_t* p, size_t n, uint64_t seed = 0) {
    uint64_t h = 0xcbf29ce484222325ull ^ seed;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
    h ^= n;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

/// state_hash() of a string's bytes.
inline uint64_t state_hash(const std::string& s) {
    return state_hash(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

}  // namespace trioserve
