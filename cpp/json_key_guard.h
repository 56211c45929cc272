// json_key_guard.h — keeps a JSON-constrained generation from repeating a key within one object
// (spec §5.6; worker protocol `unique_keys`). Pure: no engine calls (tests:
// cpp/tests/test_json_key_guard.cpp).
//
// A GBNF grammar cannot remember which keys an object already holds, so this stage runs after
// the grammar's masking: it follows the emitted bytes with a small explicit state machine and
// refuses a token whose text would *close* a key string equal to a key already produced in the
// same object. Only a `"` can close a string, so only tokens whose text holds one are ever
// refused: the engine checks the picked token (one short simulation) and masks the candidates
// (the precomputed list of quote-holding ids) only when that pick is refused.
//
// The state machine knows just enough JSON to tell keys from values:
//   - a stack of open containers (object / array) and, for each object, whether the next string
//     is a key (after `{` and `,`) and the set of keys it already produced;
//   - the string being read: key or value, escape state (`\x`, `\uXXXX`), and for a key its
//     bytes so far, DECODED (escapes resolved, surrogate pairs joined) so that `"a"` and
//     `"\u0061"` are the same key, as every JSON parser reads them. A lone surrogate is kept
//     as its 3-byte form, so it equals only itself (Python's json does the same).
// Text outside any container (a tool-call wrapper such as `<tool_call>\n` around the JSON) is
// ignored unless it holds a bracket or a quote; the grammar decides what the text is, this
// stage only reads it. It never makes the output longer or shorter: it only changes which
// allowed token is chosen at the end of a key.
//
// Reasoning before the JSON (spec §5.6): with `reasoning_end` set, the bytes up to and including
// the first `reasoning_end` are skipped (the prompt opened the thinking block); with
// `reasoning_start` set too, that skip applies only when the output starts with
// `reasoning_start` (an optional thinking block); otherwise the JSON starts at the first byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine.h"

namespace trioserve {

/// Where the constrained JSON starts in the output (the generate record's `unique_keys`).
struct JsonKeyOptions {
    std::string reasoning_start;  ///< non-empty: an optional block opening with this text comes first
    std::string reasoning_end;    ///< non-empty: skip the output up to and including this text
};

class JsonKeyGuard {
public:
    explicit JsonKeyGuard(JsonKeyOptions opts = {}) : opts_(std::move(opts)) {
        state_.phase = opts_.reasoning_end.empty() ? Phase::json
                       : opts_.reasoning_start.empty() ? Phase::reasoning
                                                       : Phase::undecided;
    }

    /// Whether emitting `text` next keeps every object free of repeated keys: false when, read
    /// from the current state, `text` closes a key string equal to a key already produced in
    /// the same object (also one `text` itself produced). Does not change the state.
    bool allows(std::string_view text) const {
        if (text.find('"') == std::string_view::npos) return true;  // only a quote closes a key
        sim_ = state_;  // reuses sim_'s buffers: no allocation once they have grown
        Overlay store{*this};
        return run(sim_, store, text);
    }

    /// Advances over `text` (the token actually emitted). If it repeats a key (the stage yielded
    /// because nothing else was allowed), it is counted in duplicates_admitted().
    void accept(std::string_view text) {
        Real store{*this};
        if (!run(state_, store, text)) ++duplicates_;
    }

    size_t depth() const { return state_.frames.size(); }
    /// Inside a key string (the only place a refusal can start).
    bool in_key() const { return state_.phase == Phase::json && state_.in_string && state_.is_key; }
    /// Keys produced so far by the innermost open object (tests).
    size_t keys_in_innermost_object() const {
        return state_.frames.empty() ? 0 : keys_[state_.frames.size() - 1].size();
    }
    uint64_t duplicates_admitted() const { return duplicates_; }

private:
    enum class Phase : uint8_t { undecided, reasoning, json };
    struct Frame {
        bool object = false;
        bool expect_key = false;  ///< object: the next string is a key (after `{` or `,`)
    };
    /// Everything but the key sets: cheap to copy for a simulation.
    struct State {
        Phase phase = Phase::json;
        std::string held;  ///< undecided: the bytes so far; reasoning: the last bytes, to find the end
        std::vector<Frame> frames;
        bool in_string = false;
        bool is_key = false;
        uint8_t escape = 0;  ///< 0 none; 1 after `\`; 2..5 reading hex digit (escape - 2) of `\u`
        uint32_t hex = 0;
        uint32_t high = 0;   ///< a decoded high surrogate waiting for its low half (0: none)
        std::string key;     ///< the key being read, decoded
    };

    /// Key sets as accept() sees them: the real ones, updated.
    struct Real {
        JsonKeyGuard& g;
        void pushed(size_t index) {
            if (g.keys_.size() <= index) g.keys_.resize(index + 1);
            g.keys_[index].clear();
        }
        void popped(size_t) {}
        /// Records `key` in the object at `index`; false when it was there already.
        bool add(size_t index, const std::string& key) { return g.keys_[index].insert(key).second; }
    };

    /// Key sets as allows() sees them: the real sets of the objects still open from before the
    /// text (index below `floor`) plus what the text added, in a scratch list.
    struct Overlay {
        const JsonKeyGuard& g;
        size_t floor;
        explicit Overlay(const JsonKeyGuard& guard) : g(guard), floor(guard.state_.frames.size()) {
            g.added_.clear();
        }
        void pushed(size_t) {}
        void popped(size_t index) { floor = index < floor ? index : floor; }
        bool add(size_t index, const std::string& key) {
            if (index < floor && g.keys_[index].count(key) != 0) return false;
            for (const auto& [i, k] : g.added_)
                if (i == index && k == key) return false;
            g.added_.emplace_back(index, key);
            return true;
        }
    };

    /// Feeds `text` to `s`; false as soon as a key closes that `store` already holds (the rest
    /// of the text is still fed, so accept() stays in step with the output).
    template <class Store>
    bool run(State& s, Store& store, std::string_view text) const {
        bool ok = true;
        for (char c : text) ok &= byte(s, store, c);
        return ok;
    }

    template <class Store>
    bool byte(State& s, Store& store, char c) const {
        switch (s.phase) {
            case Phase::json:
                return json_byte(s, store, c);
            case Phase::reasoning: {
                const std::string& end = opts_.reasoning_end;
                s.held.push_back(c);
                if (s.held.size() >= end.size() &&
                    s.held.compare(s.held.size() - end.size(), end.size(), end) == 0) {
                    s.held.clear();
                    s.phase = Phase::json;
                } else if (s.held.size() >= end.size()) {
                    s.held.erase(0, s.held.size() - (end.size() - 1));
                }
                return true;
            }
            case Phase::undecided: {
                const std::string& start = opts_.reasoning_start;
                s.held.push_back(c);
                if (s.held == start) {
                    s.held.clear();
                    s.phase = Phase::reasoning;
                    return true;
                }
                if (start.compare(0, s.held.size(), s.held) == 0) return true;
                // No thinking block: the bytes so far were already the answer.
                std::string replay;
                replay.swap(s.held);
                s.phase = Phase::json;
                bool ok = true;
                for (char r : replay) ok &= json_byte(s, store, r);
                return ok;
            }
        }
        return true;
    }

    template <class Store>
    bool json_byte(State& s, Store& store, char c) const {
        if (s.in_string) {
            if (s.escape == 1) {
                s.escape = 0;
                switch (c) {
                    case 'u': s.escape = 2; s.hex = 0; return true;
                    case 'b': key_unit(s, '\b'); return true;
                    case 'f': key_unit(s, '\f'); return true;
                    case 'n': key_unit(s, '\n'); return true;
                    case 'r': key_unit(s, '\r'); return true;
                    case 't': key_unit(s, '\t'); return true;
                    default: key_unit(s, static_cast<unsigned char>(c)); return true;  // `"` `\` `/`
                }
            }
            if (s.escape >= 2) {
                s.hex = (s.hex << 4) | hex_value(c);
                if (++s.escape == 6) {
                    s.escape = 0;
                    key_unit(s, s.hex);
                }
                return true;
            }
            if (c == '\\') { s.escape = 1; return true; }
            if (c == '"') {
                s.in_string = false;
                if (!s.is_key) return true;
                flush_high(s);
                return store.add(s.frames.size() - 1, s.key);
            }
            if (s.is_key) {  // a raw byte (UTF-8 stays as it is)
                flush_high(s);
                s.key.push_back(c);
            }
            return true;
        }
        switch (c) {
            case '"': {
                s.in_string = true;
                s.escape = 0;
                s.is_key = !s.frames.empty() && s.frames.back().object && s.frames.back().expect_key;
                if (s.is_key) {
                    s.frames.back().expect_key = false;
                    s.key.clear();
                    s.high = 0;
                }
                return true;
            }
            case '{':
            case '[':
                s.frames.push_back(Frame{c == '{', c == '{'});
                store.pushed(s.frames.size() - 1);
                return true;
            case '}':
            case ']':
                if (!s.frames.empty()) {
                    s.frames.pop_back();
                    store.popped(s.frames.size());
                }
                return true;
            case ',':
                if (!s.frames.empty() && s.frames.back().object) s.frames.back().expect_key = true;
                return true;
            default:
                return true;
        }
    }

    static uint32_t hex_value(char c) {
        if (c >= '0' && c <= '9') return static_cast<uint32_t>(c - '0');
        if (c >= 'a' && c <= 'f') return static_cast<uint32_t>(c - 'a' + 10);
        if (c >= 'A' && c <= 'F') return static_cast<uint32_t>(c - 'A' + 10);
        return 0;  // the grammar admits hex digits only
    }

    /// One decoded code unit of a key (a byte value below 0x80, or a `\u` unit).
    static void key_unit(State& s, uint32_t u) {
        if (!s.is_key) return;
        if (s.high != 0 && u >= 0xDC00 && u <= 0xDFFF) {
            const uint32_t cp = 0x10000 + ((s.high - 0xD800) << 10) + (u - 0xDC00);
            s.high = 0;
            append_utf8(s.key, cp);
            return;
        }
        flush_high(s);
        if (u >= 0xD800 && u <= 0xDBFF) {
            s.high = u;
            return;
        }
        append_utf8(s.key, u);
    }

    static void flush_high(State& s) {
        if (s.high == 0) return;
        append_utf8(s.key, s.high);  // a lone surrogate, as its 3-byte form
        s.high = 0;
    }

    static void append_utf8(std::string& out, uint32_t cp) {
        if (cp < 0x80) {
            out.push_back(static_cast<char>(cp));
        } else if (cp < 0x800) {
            out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
            out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
        } else if (cp < 0x10000) {
            out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
            out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
            out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
        } else {
            out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
            out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
            out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
            out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
        }
    }

    JsonKeyOptions opts_;
    State state_;
    std::vector<std::unordered_set<std::string>> keys_;  ///< per frame index (objects' keys)
    uint64_t duplicates_ = 0;
    // Scratch of allows() (const: a check changes no observable state).
    mutable State sim_;
    mutable std::vector<std::pair<size_t, std::string>> added_;
};

/// Each token's text and the ids whose text holds a `"` (the only ones a JsonKeyGuard can
/// refuse), made once per vocabulary and shared by every generation's JsonKeyVeto.
struct TokenTexts {
    std::vector<std::string> text;   ///< by id
    std::vector<TokenId> quoted;     ///< ascending

    /// `bytes(id, out)` appends token `id`'s raw bytes to `out`, for ids in [0, n_vocab).
    template <class Bytes>
    static std::shared_ptr<const TokenTexts> of(size_t n_vocab, Bytes&& bytes) {
        auto t = std::make_shared<TokenTexts>();
        t->text.resize(n_vocab);
        for (size_t id = 0; id < n_vocab; ++id) {
            bytes(static_cast<TokenId>(id), t->text[id]);
            if (t->text[id].find('"') != std::string::npos) t->quoted.push_back(static_cast<TokenId>(id));
        }
        return t;
    }

    static std::shared_ptr<const TokenTexts> of(const Engine& engine) {
        return of(static_cast<size_t>(engine.info().n_vocab),
                  [&engine](TokenId id, std::string& out) { engine.token_bytes(id, out); });
    }
};

/// The engine-facing side (engine.h TokenVeto): a JsonKeyGuard over token ids.
class JsonKeyVeto : public TokenVeto {
public:
    JsonKeyVeto(JsonKeyOptions opts, std::shared_ptr<const TokenTexts> texts)
        : guard_(std::move(opts)), texts_(std::move(texts)) {}

    const std::vector<TokenId>& refusable() const override { return texts_->quoted; }
    bool allows(TokenId id) const override { return guard_.allows(text(id)); }
    void accept(TokenId id) override { guard_.accept(text(id)); }
    uint64_t yielded() const override { return guard_.duplicates_admitted(); }

    const JsonKeyGuard& guard() const { return guard_; }

private:
    std::string_view text(TokenId id) const {
        return id >= 0 && static_cast<size_t>(id) < texts_->text.size() ? std::string_view(texts_->text[static_cast<size_t>(id)])
                                                                       : std::string_view();
    }
    JsonKeyGuard guard_;
    std::shared_ptr<const TokenTexts> texts_;
};

}  // namespace trioserve
