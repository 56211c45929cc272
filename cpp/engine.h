// engine.h — the model-agnostic Engine/Session contract every trioserve worker implements.
//
// An Engine loads weights once and hosts up to `capacity` isolated Sessions on that single
// weight load (llama.cpp: one llama_context, one sequence id per session). A Session is one
// KV/recurrent state: reset, prefill ids, sample + decode one token, truncate, stop.
//
// Threading model: the worker loop (worker_loop.h) calls every method from one thread, one
// request at a time. The only exception is Session::request_stop(), which any thread may call
// at any time (the cancel watcher does). No method throws; failures are Status codes.
// Engines never write to stdout (it carries protocol records only); logs go to stderr.
// Protocol: spec/worker-protocol.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace trioserve {

using TokenId = int32_t;

enum class Status {
    ok = 0,
    aborted,          ///< request_stop() interrupted the call; the session is in an unknown state
    invalid_token,    ///< an id outside the vocabulary
    context_full,     ///< no room left in the session's context
    unsupported,      ///< the operation is not supported by this engine/state (e.g. truncate)
    engine_error,     ///< anything else; the session may be partially mutated
};

inline const char* status_name(Status s) {
    switch (s) {
        case Status::ok: return "ok";
        case Status::aborted: return "aborted";
        case Status::invalid_token: return "invalid_token";
        case Status::context_full: return "context_full";
        case Status::unsupported: return "unsupported";
        case Status::engine_error: return "engine_error";
    }
    return "?";
}

/// Sampling parameters of one generation (validated by the worker loop).
struct SamplingParams {
    float temperature = 0.0f;  ///< >= 0; 0 = greedy (argmax)
    float top_p = 1.0f;        ///< (0, 1]; 1 = off
    int32_t top_k = 0;         ///< >= 0; 0 = off
    uint32_t seed = 0;         ///< RNG seed (the loop picks a random one when the request has none)
};

/// Static facts about a loaded engine (reported in the ready record).
struct EngineInfo {
    std::string engine;        ///< "llama" | "fake"
    std::string model_name;    ///< GGUF general.name, else the file stem
    std::string architecture;  ///< GGUF general.architecture
    std::string model_path;
    int64_t n_ctx = 0;         ///< context window of every session, tokens
    int64_t capacity = 1;      ///< isolated sessions on one weight load (>= 1)
    int64_t n_vocab = 0;       ///< valid ids are [0, n_vocab)
    bool supports_truncate = false;
    std::optional<std::string> bos_text, eos_text;
    std::optional<TokenId> bos_id, eos_id;
    std::optional<std::string> chat_template;
};

class Session {
public:
    virtual ~Session() = default;

    /// Clears all state (position 0). Returns ok or engine_error (state unknown: caller marks
    /// the session dirty).
    virtual Status reset() = 0;

    /// Number of tokens resident in the session's state.
    virtual int64_t position() const = 0;

    /// Drops every token at position >= pos (0 <= pos <= position()). Returns ok, unsupported
    /// (state unchanged; the caller resets instead) or engine_error.
    virtual Status truncate(int64_t pos) = 0;

    /// Appends `n` (>= 1) tokens at position() and computes what is needed to sample the next
    /// token. Returns ok; aborted (request_stop() was called: some of the tokens may be
    /// resident, the caller marks the session dirty); invalid_token; context_full; engine_error
    /// (partially mutated: caller marks dirty).
    virtual Status prefill(const TokenId* ids, size_t n) = 0;

    /// Prepares sampling for a new generation (sampler chain, seed). Called after the prefill
    /// and before the first sample().
    virtual Status start_generation(const SamplingParams& params) = 0;

    /// Samples the next token from the state left by the last prefill()/decode(). Does not
    /// change position(). Returns ok or engine_error.
    virtual Status sample(TokenId* out) = 0;

    /// Appends one sampled token (position() + 1) so the next one can be sampled. Returns ok,
    /// aborted, context_full or engine_error (dirty on anything but ok).
    virtual Status decode(TokenId token) = 0;

    /// Thread-safe, async-signal-unsafe, non-blocking: asks a running or future prefill()/
    /// decode() to return `aborted` as soon as it can. Sticky until clear_stop().
    virtual void request_stop() = 0;

    /// Clears a pending stop request (worker loop thread, before a request starts).
    virtual void clear_stop() = 0;
};

class Engine {
public:
    virtual ~Engine() = default;

    virtual const EngineInfo& info() const = 0;

    /// Creates one of `capacity` sessions. Returns nullptr when every slot is taken. The
    /// session must be destroyed before the engine; destroying it frees its slot.
    virtual std::unique_ptr<Session> create_session() = 0;

    /// Tokenizes already-rendered text: no BOS/EOS added, special tokens parsed. Appends to
    /// `out`. Returns ok or engine_error.
    virtual Status tokenize(const std::string& text, std::vector<TokenId>& out) const = 0;

    /// Appends the raw bytes of token `id` to `out` (may be partial UTF-8 or empty).
    virtual void token_bytes(TokenId id, std::string& out) const = 0;

    /// Whether `id` ends generation (EOS/EOT): never emitted, never counted.
    virtual bool is_end_of_generation(TokenId id) const = 0;
};

}  // namespace trioserve
