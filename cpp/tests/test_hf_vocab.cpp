// Unit tests for HfVocab: byte-level and SentencePiece-style decoding, added tokens verbatim,
// tokenizer_config.json (template, EOS), and the files it must refuse.
#include "check.h"
#include "hf_vocab.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

using trioserve::HfVocab;

static std::vector<std::string> g_dirs;  // removed at the end

static std::string make_dir() {
    char tmpl[] = "/tmp/hf_vocab_test_XXXXXX";
    const char* d = mkdtemp(tmpl);
    if (!d) { std::fprintf(stderr, "mkdtemp failed\n"); std::exit(1); }
    g_dirs.emplace_back(d);
    return g_dirs.back();
}

static void write(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
}

static std::string bytes(const HfVocab& v, int32_t id) {
    std::string s;
    v.append_bytes(id, s);
    return s;
}

int main() {
    {   // byte-level BPE (GPT-2 table): Ġ = space, Ċ = newline, Ã© = the two bytes of é
        const std::string dir = make_dir();
        write(dir + "/tokenizer.json", R"({
          "model": {"type": "BPE", "vocab": {"a": 0, "\u0120b": 1, "\u010a": 2, "\u00c3\u00a9": 3, "\u00c3": 4}},
          "decoder": {"type": "ByteLevel"},
          "added_tokens": [{"id": 5, "content": "<|im_end|>", "special": true}]})");
        write(dir + "/tokenizer_config.json", R"({"eos_token": {"content": "<|im_end|>"}, "chat_template": "T"})");
        HfVocab v;
        std::string err;
        CHECK(v.load(dir + "/tokenizer.json", err));
        CHECK_EQ(v.size(), size_t(6));
        CHECK_EQ(bytes(v, 0), std::string("a"));
        CHECK_EQ(bytes(v, 1), std::string(" b"));
        CHECK_EQ(bytes(v, 2), std::string("\n"));
        CHECK_EQ(bytes(v, 3), std::string("\xC3\xA9"));
        CHECK_EQ(bytes(v, 4), std::string("\xC3"));  // half a character: the assembler's job
        CHECK_EQ(bytes(v, 5), std::string("<|im_end|>"));
        CHECK_EQ(bytes(v, 99), std::string());       // outside the vocabulary: nothing
        CHECK(v.chat_template() && *v.chat_template() == "T");
        CHECK(v.eos_text() && *v.eos_text() == "<|im_end|>");
        CHECK(v.id_of("<|im_end|>") && *v.id_of("<|im_end|>") == 5);
        CHECK(!v.bos_text());
    }
    {   // SentencePiece-style BPE: U+2581 = space, <0xHH> = one byte; template list form
        const std::string dir = make_dir();
        write(dir + "/tokenizer.json", R"({
          "model": {"type": "BPE", "vocab": {"<unk>": 0, "\u2581hello": 1, "<0x0A>": 2, "x\u2581y": 3}},
          "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                      {"type": "ByteFallback"}, {"type": "Fuse"}]}})");
        write(dir + "/tokenizer_config.json",
              R"({"chat_template": [{"name": "tool_use", "template": "U"}, {"name": "default", "template": "D"}]})");
        HfVocab v;
        std::string err;
        CHECK(v.load(dir + "/tokenizer.json", err));
        CHECK_EQ(bytes(v, 1), std::string(" hello"));
        CHECK_EQ(bytes(v, 2), std::string("\n"));
        CHECK_EQ(bytes(v, 3), std::string("x y"));
        CHECK(v.chat_template() && *v.chat_template() == "D");
    }
    {   // refused: not JSON, missing, WordPiece, no decoder kind we know
        const std::string dir = make_dir();
        HfVocab v;
        std::string err;
        write(dir + "/bad.json", "{not json");
        CHECK(!v.load(dir + "/bad.json", err) && err.find("not valid JSON") != std::string::npos);
        CHECK(!v.load(dir + "/missing.json", err) && err.find("cannot read") != std::string::npos);
        write(dir + "/wp.json", R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}, "decoder": {"type": "WordPiece"}})");
        CHECK(!v.load(dir + "/wp.json", err) && err.find("not supported") != std::string::npos);
        write(dir + "/nodec.json", R"({"model": {"type": "BPE", "vocab": {"a": 0}}})");
        CHECK(!v.load(dir + "/nodec.json", err) && err.find("unsupported decoder") != std::string::npos);
    }
    for (const auto& d : g_dirs) std::filesystem::remove_all(d);
    return trioserve_test::finish("hf_vocab");
}
