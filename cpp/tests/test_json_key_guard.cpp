// Unit tests for JsonKeyGuard (json_key_guard.h): which texts close a repeated key, per object,
// across token boundaries, through escapes and surrogate pairs, after a reasoning block; and
// JsonKeyVeto over the fake engine's byte vocabulary.
#include "check.h"
#include "engines/fake/fake_engine.h"
#include "json_key_guard.h"

#include <initializer_list>
#include <string>

using namespace trioserve;

namespace {

/// A guard that has emitted `tokens` (each one accept()).
JsonKeyGuard after(std::initializer_list<const char*> tokens, JsonKeyOptions opts = {}) {
    JsonKeyGuard g(std::move(opts));
    for (const char* t : tokens) g.accept(t);
    return g;
}

/// Whether the whole text, fed byte by byte, never needs a refusal.
bool clean_bytewise(const std::string& text, JsonKeyOptions opts = {}) {
    JsonKeyGuard g(std::move(opts));
    bool ok = true;
    for (char c : text) {
        ok &= g.allows(std::string(1, c));
        g.accept(std::string(1, c));
    }
    return ok && g.duplicates_admitted() == 0;
}

JsonKeyOptions inside_reasoning() { return {"", "</think>"}; }
JsonKeyOptions optional_reasoning() { return {"<think>", "</think>"}; }

}  // namespace

int main() {
    {   // the closing quote of a repeated key is refused; other continuations are not
        JsonKeyGuard g = after({"{\"", "a", "\": 1, \"", "a"});
        CHECK(g.in_key());
        CHECK(!g.allows("\""));
        CHECK(!g.allows("\":"));
        CHECK(!g.allows("\": 2}"));
        CHECK(g.allows("b\""));   // "ab" is new
        CHECK(g.allows("b"));
        CHECK(g.allows("x\": 2}"));
        CHECK(g.allows("\\\""));  // an escaped quote continues the key
        CHECK_EQ(g.keys_in_innermost_object(), size_t(1));
    }
    {   // a token that opens and closes a key, or several, in one piece
        JsonKeyGuard g = after({"{\"a\": 1, "});
        CHECK(!g.in_key());
        CHECK(!g.allows("\"a\""));
        CHECK(!g.allows("\"a\":"));
        CHECK(g.allows("\"b\""));
        CHECK(!g.allows("\"b\": 2, \"b\""));  // repeats a key the same text produced
        CHECK(g.allows("\"b\": 2, \"c\""));
        JsonKeyGuard fresh;
        CHECK(!fresh.allows("{\"a\":1,\"a\""));
        CHECK(fresh.allows("{\"a\":1,\"b\""));
    }
    {   // allows() changes nothing; accept() of a refused text is counted, not lost
        JsonKeyGuard g = after({"{\"a\": 1, \"a"});
        for (int i = 0; i < 3; ++i) CHECK(!g.allows("\""));
        CHECK(g.in_key());
        g.accept("\"");
        CHECK_EQ(g.duplicates_admitted(), uint64_t(1));
        CHECK(!g.in_key());
    }
    {   // each object has its own keys: nested objects, arrays of objects, siblings
        CHECK(clean_bytewise(R"({"a": {"a": 1, "b": {"a": 2}}, "b": [{"a": 1}, {"a": 2}], "c": 3})"));
        JsonKeyGuard g = after({R"({"a": {"a": 1}, "b": 2, )"});
        CHECK_EQ(g.depth(), size_t(1));
        CHECK(!g.allows("\"a\""));  // the outer object has a and b
        CHECK(!g.allows("\"b\""));
        CHECK(g.allows("\"c\""));
        JsonKeyGuard inner = after({R"({"x": {"a": 1, )"});
        CHECK(!inner.allows("\"a\""));
        CHECK(inner.allows("\"x\""));  // x belongs to the outer object
        CHECK(!inner.allows("\"b\": 1}, \"x\""));  // closing the inner object, then x again outside
        CHECK(inner.allows("\"b\": 1}, \"y\""));
        JsonKeyGuard reopened = after({R"({"o": {"a": 1}, "p": {)"});
        CHECK(reopened.allows("\"a\""));  // a new object at the same depth starts empty
    }
    {   // a reopened object inside one simulated text starts empty too
        JsonKeyGuard g = after({R"({"o": {"a": 1, )"});
        CHECK(g.allows("\"b\": 1}, \"p\": {\"a\""));
        CHECK(!g.allows("\"b\": 1}, \"p\": {\"a\": 1, \"a\""));
    }
    {   // strings that are values, brackets and commas inside strings
        CHECK(clean_bytewise(R"({"a": "a", "b": "a", "c": ["a", "b", {"a": "x,\"y"}], "d": "{\"a\": 1, \"a\": 2}"})"));
        JsonKeyGuard g = after({R"({"a": [1, "b"], "b": "}", )"});
        CHECK(!g.allows("\"b\""));
        CHECK(!g.allows("\"a\""));
        CHECK(g.allows("\"c\""));
        JsonKeyGuard braces = after({R"({"{a,": 1, ")"});
        CHECK(!braces.allows("{a,\""));
    }
    {   // escapes are decoded: the same key spelled differently is the same key
        CHECK(!after({R"({"a": 1, "\u0061)"}).allows("\""));
        CHECK(!after({R"({"\u0061": 1, "a)"}).allows("\""));
        CHECK(!after({R"({"a\"b": 1, "a\"b)"}).allows("\""));
        CHECK(!after({R"({"a\\": 1, "a\\)"}).allows("\""));
        CHECK(!after({R"({"\/": 1, "/)"}).allows("\""));
        CHECK(!after({R"({"\n": 1, "\u000A)"}).allows("\""));
        CHECK(!after({R"({"\u00e9": 1, ")", "\xC3\xA9"}).allows("\""));
        CHECK(after({R"({"a\"b": 1, "a\"c)"}).allows("\""));
        CHECK(after({R"({"\u0061": 1, "\u0062)"}).allows("\""));
        // an escape split across tokens
        CHECK(!after({"{\"ab\": 1, \"a\\", "u00", "62"}).allows("\""));
    }
    {   // surrogate pairs join; a lone surrogate equals only itself
        const char* emoji = "\xF0\x9F\x98\x80";  // U+1F600
        CHECK(!after({"{\"", emoji, "\": 1, \"\\ud83d\\ude00"}).allows("\""));
        CHECK(!after({"{\"\\uD83D\\uDE00\": 1, \"", emoji}).allows("\""));
        CHECK(!after({R"({"\ud83d": 1, "\ud83d)"}).allows("\""));
        CHECK(after({R"({"\ud83d": 1, "\ud83dx)"}).allows("\""));
        CHECK(after({"{\"\\ud83d\": 1, \"", emoji}).allows("\""));
        CHECK(!after({R"({"\ud83dx": 1, "\ud83d)"}).allows("x\""));
    }
    {   // text around the JSON (a tool-call wrapper) and several documents
        JsonKeyGuard g = after({"<tool_call>\n{\"name\": \"f\", \"arguments\": {\"name\": 1, "});
        CHECK(!g.allows("\"name\""));  // arguments already has name
        CHECK(g.allows("\"x\""));
        CHECK(!g.allows("\"x\": 1}, \"name\""));  // back in the call object: name again
        JsonKeyGuard two = after({"{\"a\": 1}\n</tool_call>\n<tool_call>\n{"});
        CHECK(two.allows("\"a\""));  // another call, another object
        JsonKeyGuard mistral = after({"[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", "});
        CHECK(!mistral.allows("\"name\""));
        CHECK(mistral.allows("\"arguments\""));
    }
    {   // the prompt opened a thinking block: everything up to its end is reasoning
        JsonKeyGuard g = after({"I think {\"a\": 1, \"a", "\" is fine </th"}, inside_reasoning());
        CHECK(g.allows("\"a\""));
        CHECK(!g.in_key());
        g.accept("ink>\n{\"a\": 1, ");
        CHECK(!g.allows("\"a\""));
        CHECK(g.allows("\"b\""));
        CHECK(!JsonKeyGuard(inside_reasoning()).allows("x</think>{\"a\":1,\"a\""));
        CHECK(JsonKeyGuard(inside_reasoning()).allows("{\"a\":1,\"a\""));
    }
    {   // an optional thinking block: skipped only when the output opens with it
        JsonKeyGuard none = after({"{\"a\": 1, "}, optional_reasoning());
        CHECK(!none.allows("\"a\""));
        JsonKeyGuard block = after({"<thi", "nk>{\"a\": 1, \"a\" no</think>", "\n{\"a\": 1, "}, optional_reasoning());
        CHECK(!block.allows("\"a\""));
        CHECK(block.allows("\"b\""));
        JsonKeyGuard opened = after({"<think>{\"a\": 1, "}, optional_reasoning());
        CHECK(opened.allows("\"a\""));  // still reasoning
        JsonKeyGuard other = after({"<t", "ool_call>\n{\"a\": 1, "}, optional_reasoning());
        CHECK(!other.allows("\"a\""));  // not the thinking block: JSON from the first byte
        JsonKeyGuard undecided = after({"<"}, optional_reasoning());
        CHECK(!undecided.allows("a>{\"a\":1,\"a\""));
        CHECK(undecided.allows("think>{\"a\":1,\"a\""));
    }
    {   // the veto over the fake engine's vocabulary: only the quote byte is refusable
        FakeEngine engine(FakeConfig{});
        auto texts = TokenTexts::of(engine);
        CHECK_EQ(texts->quoted.size(), size_t(1));
        CHECK_EQ(texts->quoted[0], TokenId('"'));
        JsonKeyVeto veto(JsonKeyOptions{}, texts);
        for (char c : std::string("{\"k\": 1, \"k")) veto.accept(TokenId(static_cast<unsigned char>(c)));
        CHECK(!veto.allows(TokenId('"')));
        CHECK(veto.allows(TokenId('x')));
        CHECK(veto.allows(kFakeEos));
        veto.accept(TokenId('"'));
        CHECK_EQ(veto.yielded(), uint64_t(1));
    }
    return trioserve_test::finish("test_json_key_guard");
}
