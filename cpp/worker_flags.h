// worker_flags.h — the flags every worker main shares (slots, step budget, pacing, liveness,
// spill, shared prefixes, the window cache, speculation), parsed in one place into one struct
// with cli_args.h's Args. Each main parses its engine's own flags on top and copies what it
// needs into its engine config; apply() sets the WorkerOptions these flags own. The flag
// names, errors and defaults are the protocol's (spec/worker-protocol.md §10, §11; the parent
// builds the argv in trioserve/config.py worker_argv()), so changing one here changes every
// worker that takes it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "cli_args.h"
#include "kv_cache_type.h"
#include "loop/worker_loop.h"
#include "speculation.h"
#include "swa_cache.h"

namespace trioserve {

/// Groups of shared flags. A worker takes the groups its engine supports; a flag of another
/// group stays an unknown flag for it (refused, never silently ignored).
enum WorkerFlagGroup : unsigned {
    /// --ctx, --capacity, --prefill-chunk, --batch-tokens, --spill-budget-bytes,
    /// --min-shared-prefix, --step-target-ms, --heartbeat-ms, --stream-interval-ms,
    /// --state-dir, --state-dir-bytes (spec §6.4)
    kSlotFlags = 1u << 0,
    /// --max-step-ms
    kStepBoundFlags = 1u << 1,
    /// --swa-cache, --checkpoints / --swa-checkpoints (spec §6.3)
    kWindowFlags = 1u << 2,
    /// --speculative, --draft-max, --global-draft-tokens, --log-drafts, --measure-step-cost (spec §4.6)
    kSpeculativeFlags = 1u << 3,
    /// --kv-cache-type f16|q8_0|q4_0 (kv_cache_type.h; spec §10, §11): engines whose KV cache
    /// the worker allocates (llama; the fake scales its reported bytes), not ExecuTorch's.
    kKvCacheFlags = 1u << 4,
    kAllWorkerFlags = kSlotFlags | kStepBoundFlags | kWindowFlags | kSpeculativeFlags | kKvCacheFlags,
};

struct WorkerFlags {
    // Unset: the worker's own default (they differ per engine: the main decides).
    std::optional<long long> ctx;            ///< --ctx N (>= 0)
    std::optional<long long> capacity;       ///< --capacity N (>= 1)
    std::optional<long long> prefill_chunk;  ///< --prefill-chunk N (>= 1)
    std::optional<long long> batch_tokens;   ///< --batch-tokens N (>= 1)
    std::optional<double> step_target_ms;    ///< --step-target-ms MS (>= 0)
    // Same default in every worker.
    long long spill_budget_bytes = 1LL << 30;  ///< --spill-budget-bytes N (>= 0)
    long long min_shared_prefix = 16;          ///< --min-shared-prefix N (>= 0)
    double heartbeat_ms = 0;                   ///< --heartbeat-ms MS
    double stream_interval_ms = 0;             ///< --stream-interval-ms MS (0..1000)
    double max_step_ms = 0;                    ///< --max-step-ms MS
    SwaCacheMode swa_cache = SwaCacheMode::automatic;  ///< --swa-cache full|checkpoints|auto
    long long swa_checkpoints = 4;             ///< --swa-checkpoints N (>= 0)
    bool speculative = false;                  ///< --speculative auto|off
    long long draft_max = 12;                  ///< --draft-max N (>= 1)
    long long global_draft_tokens = 262144;    ///< --global-draft-tokens N (>= 0)
    bool log_drafts = false;                   ///< --log-drafts
    bool measure_step_cost = false;            ///< --measure-step-cost
    KvCacheType kv_cache_type = KvCacheType::f16;  ///< --kv-cache-type f16|q8_0|q4_0
    std::string state_dir;                     ///< --state-dir DIR (empty: no persistent store)
    long long state_dir_bytes = 8LL << 30;     ///< --state-dir-bytes N (>= 0): the store's bound

    /// If the flag at `a`'s position is a shared flag of one of `groups`, consumes it (and its
    /// value) and returns true; a bad value exits with status 2 (Args::fail). Otherwise
    /// consumes nothing and returns false.
    bool parse(Args& a, unsigned groups) {
        long long v = 0;
        double d = 0;
        std::string s;
        if (groups & kSlotFlags) {
            if (a.int_value("--ctx", v, 0)) { ctx = v; return true; }
            if (a.int_value("--capacity", v, 1)) { capacity = v; return true; }
            if (a.int_value("--prefill-chunk", v, 1)) { prefill_chunk = v; return true; }
            if (a.int_value("--batch-tokens", v, 1)) { batch_tokens = v; return true; }
            if (a.int_value("--spill-budget-bytes", spill_budget_bytes, 0)) return true;
            if (a.int_value("--min-shared-prefix", min_shared_prefix, 0)) return true;
            if (a.value("--state-dir", state_dir)) return true;
            if (a.int_value("--state-dir-bytes", state_dir_bytes, 0)) return true;
            if (a.double_value("--step-target-ms", d)) { step_target_ms = d; return true; }
            if (a.double_value("--heartbeat-ms", heartbeat_ms)) return true;
            if (a.double_value("--stream-interval-ms", stream_interval_ms)) {
                if (stream_interval_ms < 0 || stream_interval_ms > 1000) Args::fail("--stream-interval-ms must be in [0, 1000]");
                return true;
            }
        }
        if (groups & kStepBoundFlags) {
            if (a.double_value("--max-step-ms", max_step_ms)) return true;
        }
        if (groups & kWindowFlags) {
            if (a.value("--swa-cache", s)) {
                if (!parse_swa_cache_mode(s, swa_cache)) Args::fail("--swa-cache must be full, checkpoints or auto");
                return true;
            }
            // --checkpoints: the name for every kind (window, recurrent); --swa-checkpoints stays.
            if (a.int_value("--checkpoints", swa_checkpoints, 0)) return true;
            if (a.int_value("--swa-checkpoints", swa_checkpoints, 0)) return true;
        }
        if (groups & kSpeculativeFlags) {
            if (a.value("--speculative", s)) {
                if (s != "auto" && s != "off") Args::fail("--speculative must be auto or off");
                speculative = s == "auto";
                return true;
            }
            if (a.int_value("--draft-max", draft_max, 1)) return true;
            if (a.int_value("--global-draft-tokens", global_draft_tokens, 0)) return true;
            if (a.flag("--log-drafts")) { log_drafts = true; return true; }
            if (a.flag("--measure-step-cost")) { measure_step_cost = true; return true; }
        }
        if (groups & kKvCacheFlags) {
            if (a.value("--kv-cache-type", s)) {
                if (!parse_kv_cache_type(s, kv_cache_type)) Args::fail("--kv-cache-type must be f16, q8_0 or q4_0");
                return true;
            }
        }
        return false;
    }

    /// Sets the loop options these flags own (not prefill_chunk, batch_tokens, step_target_ms:
    /// their defaults are the worker's). A main may narrow them afterwards (llama:
    /// --deterministic turns speculation off).
    void apply(WorkerOptions& o) const {
        o.spill_budget_bytes = static_cast<uint64_t>(spill_budget_bytes);
        o.min_shared_prefix = static_cast<size_t>(min_shared_prefix);
        o.state_dir = state_dir;
        o.state_dir_bytes = static_cast<uint64_t>(state_dir_bytes);
        o.heartbeat_ms = heartbeat_ms;
        o.stream_interval_ms = stream_interval_ms;
        o.max_step_ms = max_step_ms;
        o.checkpoints_per_slot = static_cast<size_t>(swa_checkpoints);
        o.speculative = speculative ? SpeculativeMode::automatic : SpeculativeMode::off;
        o.draft_max = static_cast<size_t>(draft_max);
        o.global_draft_tokens = static_cast<size_t>(global_draft_tokens);
        o.log_drafts = log_drafts;
        o.measure_step_cost = measure_step_cost;
    }
};

}  // namespace trioserve
