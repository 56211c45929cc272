// engine.h — the model-agnostic, batched Engine contract every trioserve worker implements.
//
// An Engine loads weights once and hosts `capacity` slots on that single weight load
// (llama.cpp: one llama_context, slot i = sequence id i, non-unified KV so every slot has its
// own n_ctx cells). A slot is one KV/recurrent state. The worker loop (cpp/loop/) decides
// which generation runs in which slot; the engine only knows slots.
//
// One step() advances many slots in one forward pass (llama.cpp: one llama_batch over many
// sequence ids, one llama_decode): per slot a run of tokens appended at its position (one
// sampled token for a decoding generation, a bounded prefill chunk for a starting one), with
// logits requested only where a sample follows. Sampling is per generation afterwards:
// sample(slot, sampler) reads that slot's logits from the last step. A Sampler is one
// generation's own sampling state (chain, RNG, grammar); the generation owns it.
//
// Threading model: every method is called from the worker loop thread, except
// request_abort(), which any thread may call at any time (the cancel watcher does), the
// methods marked THREAD-SAFE (the input reader thread validates and tokenizes), and
// finish_sample(), which the loop's sampler thread runs on one generation's Sampler. No method
// throws; failures are Status codes. Engines never write to stdout (it carries protocol
// records only); logs go to stderr. Protocol: spec/worker-protocol.md.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trioserve {

using TokenId = int32_t;

enum class Status {
    ok = 0,
    aborted,          ///< request_abort() interrupted step(); every slot is as before the step
    invalid_token,    ///< an id outside the vocabulary
    context_full,     ///< no room left in a slot's context
    unsupported,      ///< the operation is not supported by this engine/state (e.g. truncate)
    engine_error,     ///< anything else; the slots of the call may be partially mutated
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

/// Sampling parameters of one generation (validated by the record codec).
struct SamplingParams {
    float temperature = 0.0f;  ///< >= 0; 0 = greedy (argmax)
    float top_p = 1.0f;        ///< (0, 1]; 1 = off
    int32_t top_k = 0;         ///< >= 0; 0 = off
    uint32_t seed = 0;         ///< RNG seed (the loop picks a random one when the request has none)
    /// Added to a token's logit before any other stage (OpenAI `logit_bias`): (id, bias) pairs,
    /// ids distinct and in [0, n_vocab), biases in [-100, 100]; empty = off. Only an engine
    /// that reports `supports_logit_bias` gets a non-empty list (the loop refuses it first).
    std::vector<std::pair<TokenId, float>> logit_bias;
};

/// Static facts about a loaded engine (reported in the ready record).
struct EngineInfo {
    std::string engine;        ///< "llama" | "executorch" | "fake"
    std::string model_name;    ///< GGUF general.name, else the file stem
    std::string architecture;  ///< GGUF general.architecture
    std::string model_path;
    int64_t n_ctx = 0;         ///< context window of every slot, tokens
    int64_t n_ctx_train = 0;   ///< the model's training context (0: unknown)
    uint64_t kv_cache_bytes = 0;  ///< memory of every slot's KV cells together (estimate; 0: unknown)
    uint64_t recurrent_state_bytes = 0;  ///< every slot's recurrent state (a recurrent or hybrid model; 0: none)
    uint64_t attention_matrix_bytes = 0;  ///< host memory a step's attention matrix takes (0: none; llama without flash attention)
    std::string kv_cache_type;  ///< the KV cache element type (kv_cache_type.h); empty: the engine's own (null)
    int64_t capacity = 1;      ///< slots on one weight load (>= 1)
    int64_t n_vocab = 0;       ///< valid ids are [0, n_vocab)
    int64_t max_step_tokens = 512;  ///< most tokens one step() accepts (sum over items)
    bool supports_truncate = false;
    /// Any state, also one loaded from host memory, can be cut back to a shorter prefix (false
    /// for recurrent/hybrid state and sliding-window caches: spec §6.2, prefix_index.h).
    bool trims_any_state = false;
    /// Sliding-window attention: the window in tokens (0: none). `swa_cache` says how its
    /// cache is kept: "full" (n_ctx cells per slot, every position reachable by truncate) or
    /// "checkpoints" (the last window only; earlier positions are reached through checkpoints,
    /// spec §6.3); empty when n_swa is 0.
    int64_t n_swa = 0;
    std::string swa_cache;
    /// save_checkpoint()/restore_checkpoint() work (spec §6.3): a slot's state has a part that
    /// truncate() cannot bring back (a small sliding-window cache, a recurrent state).
    bool supports_checkpoints = false;
    /// What a checkpoint holds (ready record `checkpoint_kind`): "window" (the sliding-window
    /// layers' cells), "recurrent" (the recurrent state: recurrent and hybrid models), or
    /// "recurrent+window"; empty without checkpoints.
    std::string checkpoint_kind;
    bool supports_grammar = false;  ///< new_sampler() accepts a GBNF grammar
    bool supports_token_veto = false;  ///< sample() applies a Sampler's TokenVeto
    bool supports_logit_bias = false;  ///< sampling applies SamplingParams::logit_bias
    /// StepItem::all_logits and sample_draft() work (speculative decoding, speculation.h), and
    /// truncate() can drop the last few positions of any slot (rejected draft tokens).
    bool supports_speculation = false;
    std::optional<std::string> bos_text, eos_text;
    std::optional<TokenId> bos_id, eos_id;
    /// Fill-in-the-middle control tokens (prefix, suffix, middle), when the model has them:
    /// the parent builds infill prompts from these ids (spec §3).
    std::optional<TokenId> fim_pre_id, fim_suf_id, fim_mid_id;
    std::optional<std::string> chat_template;
    /// Texts the tokenizer turns into one control token when it parses special tokens
    /// (llama.cpp: CONTROL, USER_DEFINED and UNKNOWN tokens). The control plane needs them to
    /// check that request text never reaches a special-parsed segment (spec §5.5).
    std::vector<std::string> control_texts;
    /// The longest token's text in bytes (0: unknown). A text of B bytes is at least
    /// B / max_token_bytes tokens: the worker refuses a prompt that cannot fit from that
    /// bound, before tokenizing it (spec §4: context_length_exceeded with "lower_bound").
    int64_t max_token_bytes = 0;
};

/// One slot's part of a step: `n` (>= 1) tokens appended at the slot's position.
struct StepItem {
    int32_t slot = 0;
    const TokenId* tokens = nullptr;
    size_t n = 0;
    bool logits = false;   ///< compute the last token's logits: sample(slot) follows this step
    bool prefill = false;  ///< prompt tokens (informational: the fake engine's delays use it)
    /// Logits at EVERY position of the item, not only the last (speculative verification,
    /// speculation.h): sample_draft(slot, i, ...) then reads position i. Implies `logits`.
    bool all_logits = false;
};

/// A per-generation stage after the grammar that may refuse some tokens (json_key_guard.h:
/// a JSON object never repeats a key). An engine that reports `supports_token_veto` applies it
/// in sample(): the picked token must be allowed; when it is not, every id of refusable() that
/// allows() refuses is masked next to the grammar's mask and the pick is made again. When that
/// would leave no candidate at all, the veto yields (the grammar alone decides) rather than
/// fail the generation. The chosen token is passed to accept().
class TokenVeto {
public:
    virtual ~TokenVeto() = default;
    /// The only ids allows() can refuse (ascending); every other id is always allowed.
    virtual const std::vector<TokenId>& refusable() const = 0;
    /// Whether `id` may come next (no state change).
    virtual bool allows(TokenId id) const = 0;
    /// `id` was emitted.
    virtual void accept(TokenId id) = 0;
    /// Tokens accepted although refused (the veto yielded): diagnostics.
    virtual uint64_t yielded() const = 0;
};

/// One generation's sampling state. Opaque: only the engine that made it uses it, except for
/// the optional veto, which the worker loop attaches after new_sampler().
class Sampler {
public:
    virtual ~Sampler() = default;

    void set_veto(std::unique_ptr<TokenVeto> veto) { veto_ = std::move(veto); }
    TokenVeto* veto() const { return veto_.get(); }  ///< null: none

private:
    std::unique_ptr<TokenVeto> veto_;
};

class Engine {
public:
    virtual ~Engine() = default;

    virtual const EngineInfo& info() const = 0;

    /// Tokens resident in `slot`.
    virtual int64_t position(int32_t slot) const = 0;

    /// Clears `slot` (position 0). Returns ok or engine_error (state unknown: caller marks the
    /// slot dirty).
    virtual Status reset(int32_t slot) = 0;

    /// Drops every token of `slot` at position >= pos (0 <= pos <= position()). Returns ok,
    /// unsupported (state unchanged; the caller resets instead) or engine_error.
    virtual Status truncate(int32_t slot, int64_t pos) = 0;

    /// Whether truncate(slot, pos) would succeed now (no mutation). Recurrent state and a
    /// sliding-window cache that already dropped the cells needed say no.
    virtual bool can_truncate(int32_t slot, int64_t pos) const {
        return pos == position(slot) || (info().supports_truncate && pos >= 0 && pos <= position(slot));
    }

    /// Replaces `dst`'s state by a copy of `src`'s (the shared-prefix copy, spec §6.2); `src`
    /// is unchanged and the copy is complete when this returns (no deferred work that a later
    /// change of `src` could disturb). `scratch` is caller-owned reusable memory. Default: a
    /// round trip through host memory (save_state + load_state). Returns ok, unsupported
    /// (`dst` unchanged) or engine_error (`dst` reset: position 0).
    virtual Status copy_state(int32_t src, int32_t dst, std::vector<uint8_t>& scratch) {
        const Status st = save_state(src, scratch);
        if (st != Status::ok) return st == Status::unsupported ? st : Status::unsupported;
        return load_state(dst, scratch);
    }

    /// Copies `slot`'s whole state (KV/recurrent cells of its resident tokens) into host memory
    /// (spill, spec §6.1). The slot is unchanged. Returns ok, unsupported (this engine cannot
    /// serialize state) or engine_error (`out` unspecified).
    virtual Status save_state(int32_t slot, std::vector<uint8_t>& out) {
        (void)slot; (void)out;
        return Status::unsupported;
    }

    /// Replaces `slot`'s state by bytes from save_state() (restore, spec §6.1); the position
    /// becomes the number of tokens saved. Returns ok, unsupported or engine_error (the slot
    /// is then reset: position 0).
    virtual Status load_state(int32_t slot, const std::vector<uint8_t>& in) {
        (void)slot; (void)in;
        return Status::unsupported;
    }

    /// What makes this engine's saved states (save_state()) loadable only by an engine like
    /// it: model file identity, engine, KV cache type, context size, anything that changes the
    /// bits of a state. The persistent state store (state_store.h, spec §6.4) keeps it in every
    /// file's header and loads only files whose fingerprint is this one. Empty (the default):
    /// this engine's states are never stored on disk.
    virtual std::string state_fingerprint() const { return {}; }

    /// Checkpoints (spec §6.3). Saves the part of `slot`'s state at its current position P that
    /// truncate() cannot recover later (llama.cpp: the sliding-window layers' cells and/or the
    /// recurrent state, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY). The slot is unchanged. Returns ok, unsupported or
    /// engine_error (`out` unspecified).
    virtual Status save_checkpoint(int32_t slot, std::vector<uint8_t>& out) {
        (void)slot; (void)out;
        return Status::unsupported;
    }

    /// Brings `slot` back to position `pos` with bytes save_checkpoint() wrote at that position
    /// in a state whose first `pos` tokens are the ones `slot` holds now (the caller checks the
    /// ids; position(slot) >= pos). Everything at positions >= pos is dropped. Returns ok
    /// (position() == pos), unsupported (slot unchanged) or engine_error (slot reset: position 0).
    virtual Status restore_checkpoint(int32_t slot, int64_t pos, const std::vector<uint8_t>& in) {
        (void)slot; (void)pos; (void)in;
        return Status::unsupported;
    }

    /// Appends every item's tokens (each slot at most once per call; total <= max_step_tokens)
    /// in one forward pass and keeps the logits of items with `logits` until the next step.
    /// Returns ok (all appended); aborted (request_abort() was called since the last
    /// clear_abort(): NOTHING appended, every slot rolled back to its pre-step position);
    /// invalid_token; context_full (nothing appended); engine_error (the slots of the call may
    /// be partly appended; position() must report where each one is, so the caller can
    /// truncate it back and retry the step without the failing item, loop/step.h).
    virtual Status step(const StepItem* items, size_t n) = 0;

    /// Makes the sampling state of one generation. `grammar` empty = unconstrained. Returns
    /// nullptr and sets `error` when the grammar does not parse (or grammars are unsupported).
    virtual std::unique_ptr<Sampler> new_sampler(const SamplingParams& params, const std::string& grammar,
                                                 std::string& error) = 0;

    /// Whether `grammar` (non-empty GBNF, start rule `root`) parses; sets `error` when not.
    /// THREAD-SAFE: the input reader thread calls it while the loop thread runs step() (fast
    /// refusals, spec §4). Default: true (engines without grammars never get here).
    virtual bool validate_grammar(const std::string& grammar, std::string& error) const {
        (void)grammar; (void)error;
        return true;
    }

    /// Samples the next token of the generation in `slot` from the logits its item of the last
    /// step() requested (and advances the sampler's state: RNG, grammar). Returns ok or
    /// engine_error (no logits for that slot in the last step).
    virtual Status sample(int32_t slot, Sampler& sampler, TokenId* out) = 0;

    /// Sampling in two parts, so that the costly part can leave the loop thread (loop/step.h:
    /// a grammar's full-vocabulary mask must not hold up the other generations' steps).
    ///
    /// begin_sample() is the cheap part, on the loop thread right after step(), like sample():
    /// either it samples (`*deferred` false, `*out` set, the sampler advanced) or, when only the
    /// costly part can decide (llama: the grammar or the veto refused the chain's pick, so the
    /// whole vocabulary must be masked), it keeps in `sampler` what that part needs (a copy of
    /// the slot's logits row: the next step() overwrites the engine's) and sets `*deferred`.
    /// Returns ok or engine_error (no logits for that slot); may throw like sample().
    ///
    /// finish_sample() is the costly part of a deferred sample. THREAD-SAFE in this sense: it
    /// may run on any thread while the loop thread calls every other method (step() included),
    /// because it touches only `sampler` and engine data that never changes after load (the
    /// vocabulary); nothing else may use `sampler` until it returns. Together the two parts
    /// give exactly sample()'s token and leave the sampler exactly as sample() would (same
    /// token for the same seed, greedy unchanged).
    ///
    /// Default: sample() alone, never deferred (engines without grammars).
    virtual Status begin_sample(int32_t slot, Sampler& sampler, TokenId* out, bool* deferred) {
        *deferred = false;
        return sample(slot, sampler, out);
    }

    /// See begin_sample(). Returns ok or engine_error; may throw (a grammar left with no
    /// allowed token).
    virtual Status finish_sample(Sampler& sampler, TokenId* out) const {
        (void)sampler; (void)out;
        return Status::engine_error;  // never called: the default begin_sample() never defers
    }

protected:
    /// sample() for an engine that overrides begin_sample()/finish_sample(): both parts, on
    /// this thread (exactly the token of the one-thread sequence, by their contract).
    Status sample_in_both_parts(int32_t slot, Sampler& sampler, TokenId* out) {
        bool deferred = false;
        Status st = begin_sample(slot, sampler, out, &deferred);
        if (st == Status::ok && deferred) st = finish_sample(sampler, out);
        return st;
    }

public:

    /// Speculative verification (speculation.h, spec/worker-protocol.md §4.6). After a step in
    /// which `slot`'s item had `all_logits`, samples the token that follows position `i` of
    /// that item (0 = its first token) exactly as sample() samples from the last position:
    /// same chain, same RNG stream, the sampler advanced. The caller accepts the draft token
    /// iff it equals the result (the exact rule for a point-mass draft, speculation.h). Never
    /// deferred: generations with a grammar or a veto are not drafted. Returns ok,
    /// engine_error (no logits at i) or unsupported (the default: no speculation).
    virtual Status sample_draft(int32_t slot, size_t i, Sampler& sampler, TokenId* out) {
        (void)slot; (void)i; (void)sampler; (void)out;
        return Status::unsupported;
    }

    /// Speculation's exactness self-check (spec/worker-protocol.md §4.6), run once at start-up
    /// while no generation is in flight. In `slot` (reset before and after): a context of
    /// ids[0, depth), then ids[depth, depth + n) decoded one token per step, then the same n
    /// tokens again as one verify item (`all_logits`). Sets `same` to whether every position's
    /// logits are bit-identical in the two; when not, `detail` names the first position that
    /// differs. A kernel that computes one query differently from several (llama.cpp's CPU
    /// flash attention splits a single query's KV range across threads) makes verified tokens
    /// differ from plain decoding. Returns ok, an error of a step, or unsupported (the default:
    /// an engine whose verification is exact by construction, the fake, or that does not verify).
    virtual Status check_verify_exact(int32_t slot, const std::vector<TokenId>& ids, size_t depth, size_t n,
                                      bool* same, std::string& detail) {
        (void)slot; (void)ids; (void)depth; (void)n; (void)detail;
        *same = true;
        return Status::unsupported;
    }

    /// Thread-safe, non-blocking: makes a running or the next step() return `aborted` as soon
    /// as it can. Sticky until clear_abort().
    virtual void request_abort() = 0;

    /// Clears a pending abort (loop thread, before a step).
    virtual void clear_abort() = 0;

    /// THREAD-SAFE, non-blocking (the worker's heartbeat thread reads it while step() runs,
    /// heartbeat.h): units of work computed over the engine's life, never decreasing. It moves
    /// while a step computes and stands still while a step is stuck (llama.cpp: graph nodes
    /// computed, counted in the per-node abort callback of CPU backends). Default 0: the engine
    /// reports no progress inside a step (spec §4.4).
    virtual uint64_t work_done() const { return 0; }

    /// THREAD-SAFE like validate_grammar() (the input reader thread tokenizes prompts while
    /// the loop thread steps). Tokenizes already-rendered text: no BOS/EOS added; special tokens (e.g. `<|im_start|>`)
    /// parsed as control tokens only when `parse_special`. Appends to `out`. Returns ok or
    /// engine_error.
    virtual Status tokenize(const std::string& text, bool parse_special, std::vector<TokenId>& out) const = 0;

    /// tokenize() that gives up when `stop` becomes true (checked between the pieces the
    /// engine tokenizes anyway, so between a few KiB of text at most where it can): returns
    /// `aborted` then, with `out` partly appended. THREAD-SAFE like tokenize(); the worker's
    /// call thread (call_worker.h) uses it for the tokenize op, which the parent may cancel.
    /// Default: one uncancellable tokenize() (still bounded by the line size).
    virtual Status tokenize_cancellable(const std::string& text, bool parse_special, std::vector<TokenId>& out,
                                        const std::atomic<bool>& stop) const {
        if (stop.load(std::memory_order_acquire)) return Status::aborted;
        return tokenize(text, parse_special, out);
    }

    /// Appends the raw bytes of token `id` to `out` (may be partial UTF-8 or empty).
    /// THREAD-SAFE: reads only the vocabulary loaded at startup (the call thread detokenizes
    /// while the loop thread steps).
    virtual void token_bytes(TokenId id, std::string& out) const = 0;

    /// Whether `id` ends generation (EOS/EOT): never emitted, never counted.
    virtual bool is_end_of_generation(TokenId id) const = 0;
};

}  // namespace trioserve
