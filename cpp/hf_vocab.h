// hf_vocab.h — the decoding half of a Hugging Face `tokenizer.json`: token id -> raw bytes.
//
// The ExecuTorch worker does not tokenize text (the control plane does, with the `tokenizers`
// library, and sends `{"ids": [...]}` segments; see docs/executorch.md): it only has to turn
// the ids it samples back into bytes, for the token records, stop strings and UTF-8 assembly.
// That needs the vocabulary and the decoder kind, nothing else:
//   - byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen): every character of a vocabulary
//     entry stands for one byte through the GPT-2 byte<->unicode table;
//   - SentencePiece-style BPE (Llama 2, Mistral): U+2581 stands for a space and `<0xHH>`
//     entries are single bytes (byte fallback).
// Added tokens (`added_tokens`, e.g. `<|im_end|>`) decode to their content verbatim, so a
// control token the model emits stays visible as text, like the llama engine's.
// Anything else (WordPiece, Unigram, a missing decoder) is rejected at load with a message:
// guessing would emit wrong text.
//
// A `tokenizer_config.json` next to the tokenizer supplies what `tokenizer.json` lacks: the
// chat template and the BOS/EOS token texts.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace trioserve {

class HfVocab {
public:
    /// Loads `tokenizer_path` (and `tokenizer_config.json` in its directory when present).
    /// Returns false and sets `error` when the file is unreadable, not JSON, or of a kind this
    /// class cannot decode.
    bool load(const std::string& tokenizer_path, std::string& error) {
        nlohmann::json tok;
        if (!read_json(tokenizer_path, tok, error)) return false;
        const nlohmann::json* model = find(tok, "model");
        if (!model || !model->is_object()) { error = tokenizer_path + ": no \"model\" object"; return false; }
        const std::string type = model->value("type", std::string());
        if (type != "BPE") {
            error = tokenizer_path + ": tokenizer model type '" + type + "' is not supported (BPE only)";
            return false;
        }
        const nlohmann::json* decoder = find(tok, "decoder");
        if (mentions(decoder, "ByteLevel")) {
            kind_ = Kind::byte_level;
        } else if (mentions(decoder, "ByteFallback") || mentions(decoder, "Metaspace") || mentions(decoder, "\xE2\x96\x81")) {
            kind_ = Kind::sentencepiece;
        } else {
            error = tokenizer_path + ": unsupported decoder (byte-level or SentencePiece-style BPE only)";
            return false;
        }
        const nlohmann::json* vocab = find(*model, "vocab");
        if (!vocab || !vocab->is_object()) { error = tokenizer_path + ": model.vocab is not an object"; return false; }
        std::map<int64_t, std::string> by_id;
        for (auto it = vocab->begin(); it != vocab->end(); ++it) {
            if (!it.value().is_number_integer()) continue;
            by_id[it.value().get<int64_t>()] = decode_piece(it.key());
        }
        if (const nlohmann::json* added = find(tok, "added_tokens"); added && added->is_array()) {
            for (const auto& a : *added) {
                if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
                    !a["content"].is_string())
                    continue;
                const int64_t id = a["id"].get<int64_t>();
                const std::string content = a["content"].get<std::string>();
                by_id[id] = content;  // verbatim: control tokens stay visible as text
                added_[content] = static_cast<int32_t>(id);
            }
        }
        if (by_id.empty() || by_id.begin()->first < 0 || by_id.rbegin()->first > (int64_t(1) << 24)) {
            error = tokenizer_path + ": empty vocabulary or ids out of range";
            return false;
        }
        pieces_.assign(static_cast<size_t>(by_id.rbegin()->first + 1), std::string());
        for (auto& [id, bytes] : by_id) pieces_[static_cast<size_t>(id)] = std::move(bytes);
        load_config(tokenizer_path);
        return true;
    }

    /// Ids [0, size()) have an entry (gaps decode to nothing).
    size_t size() const { return pieces_.size(); }

    /// Appends the bytes of `id` (nothing for an id outside the vocabulary).
    void append_bytes(int32_t id, std::string& out) const {
        if (id >= 0 && static_cast<size_t>(id) < pieces_.size()) out += pieces_[static_cast<size_t>(id)];
    }

    /// The id of a token text: an added token's content or a vocabulary entry's decoded bytes.
    std::optional<int32_t> id_of(const std::string& text) const {
        if (auto it = added_.find(text); it != added_.end()) return it->second;
        for (size_t i = 0; i < pieces_.size(); ++i)
            if (pieces_[i] == text) return static_cast<int32_t>(i);
        return std::nullopt;
    }

    const std::optional<std::string>& chat_template() const { return chat_template_; }
    const std::optional<std::string>& bos_text() const { return bos_text_; }
    const std::optional<std::string>& eos_text() const { return eos_text_; }

private:
    enum class Kind { byte_level, sentencepiece };

    static bool read_json(const std::string& path, nlohmann::json& out, std::string& error) {
        std::ifstream f(path, std::ios::binary);
        if (!f) { error = "cannot read " + path; return false; }
        std::stringstream ss;
        ss << f.rdbuf();
        out = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
        if (out.is_discarded()) { error = path + ": not valid JSON"; return false; }
        return true;
    }

    static const nlohmann::json* find(const nlohmann::json& j, const char* key) {
        if (!j.is_object()) return nullptr;
        auto it = j.find(key);
        return it == j.end() || it->is_null() ? nullptr : &*it;
    }

    /// Whether `text` occurs anywhere in `j`'s serialization (decoder kinds nest in Sequence).
    static bool mentions(const nlohmann::json* j, const char* text) {
        return j != nullptr && j->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).find(text) != std::string::npos;
    }

    /// The GPT-2 byte-level table, inverted: code point -> byte. Printable Latin-1 bytes map to
    /// themselves; the other 68 bytes to U+0100.. in byte order.
    static const std::unordered_map<uint32_t, uint8_t>& byte_of_codepoint() {
        static const std::unordered_map<uint32_t, uint8_t> table = [] {
            std::unordered_map<uint32_t, uint8_t> t;
            uint32_t next = 256;
            for (uint32_t b = 0; b < 256; ++b) {
                const bool direct = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
                t[direct ? b : next++] = static_cast<uint8_t>(b);
            }
            return t;
        }();
        return table;
    }

    /// Next code point of UTF-8 `s` at `i` (advances `i`); a malformed byte is returned as is.
    static uint32_t next_codepoint(const std::string& s, size_t& i) {
        const auto c = static_cast<unsigned char>(s[i]);
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
        if (i + static_cast<size_t>(len) > s.size()) len = 1;
        uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1Fu) : len == 3 ? (c & 0x0Fu) : (c & 0x07u);
        for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + static_cast<size_t>(k)]) & 0x3Fu);
        i += static_cast<size_t>(len);
        return cp;
    }

    std::string decode_piece(const std::string& piece) const {
        std::string out;
        if (kind_ == Kind::byte_level) {
            const auto& table = byte_of_codepoint();
            size_t i = 0;
            while (i < piece.size()) {
                const size_t start = i;
                const uint32_t cp = next_codepoint(piece, i);
                auto it = table.find(cp);
                if (it != table.end()) out.push_back(static_cast<char>(it->second));
                else out.append(piece, start, i - start);  // not from the table: keep the text
            }
            return out;
        }
        // SentencePiece style: <0xHH> is one byte; U+2581 is a space.
        if (piece.size() == 6 && piece.compare(0, 3, "<0x") == 0 && piece[5] == '>') {
            const std::string hex = piece.substr(3, 2);
            char* end = nullptr;
            const long v = std::strtol(hex.c_str(), &end, 16);
            if (end && *end == '\0') return std::string(1, static_cast<char>(v));
        }
        static const std::string kSpace = "\xE2\x96\x81";
        size_t i = 0;
        while (i < piece.size()) {
            if (piece.compare(i, kSpace.size(), kSpace) == 0) { out.push_back(' '); i += kSpace.size(); }
            else out.push_back(piece[i++]);
        }
        return out;
    }

    static std::optional<std::string> token_text(const nlohmann::json& cfg, const char* key) {
        const nlohmann::json* v = find(cfg, key);
        if (!v) return std::nullopt;
        if (v->is_string()) return v->get<std::string>();
        if (v->is_object() && v->contains("content") && (*v)["content"].is_string()) return (*v)["content"].get<std::string>();
        return std::nullopt;
    }

    /// Reads the chat template and BOS/EOS texts from tokenizer_config.json beside the tokenizer
    /// (missing or malformed: none of them, which the control plane reports as usual).
    void load_config(const std::string& tokenizer_path) {
        const size_t slash = tokenizer_path.find_last_of('/');
        const std::string dir = slash == std::string::npos ? std::string(".") : tokenizer_path.substr(0, slash);
        nlohmann::json cfg;
        std::string ignored;
        if (!read_json(dir + "/tokenizer_config.json", cfg, ignored) || !cfg.is_object()) return;
        if (const nlohmann::json* t = find(cfg, "chat_template")) {
            if (t->is_string()) {
                chat_template_ = t->get<std::string>();
            } else if (t->is_array()) {  // [{"name": ..., "template": ...}]: the default one
                for (const auto& e : *t)
                    if (e.is_object() && e.value("name", std::string()) == "default" && e.contains("template") &&
                        e["template"].is_string())
                        chat_template_ = e["template"].get<std::string>();
            }
        }
        bos_text_ = token_text(cfg, "bos_token");
        eos_text_ = token_text(cfg, "eos_token");
    }

    Kind kind_ = Kind::byte_level;
    std::vector<std::string> pieces_;
    std::unordered_map<std::string, int32_t> added_;
    std::optional<std::string> chat_template_, bos_text_, eos_text_;
};

}  // namespace trioserve
