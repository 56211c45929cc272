// Unit tests for WorkerLoop over FakeEngine with string sinks (no processes).
#include "check.h"
#include "fake_engine.h"
#include "worker_loop.h"

#include <sstream>

using namespace trioserve;
using nlohmann::json;

struct Harness {
    explicit Harness(FakeConfig cfg = {}) : engine(std::move(cfg)), loop(engine, cancel, sink, WorkerOptions{4, true}) {}
    /// Sends one line; returns the records it produced.
    std::vector<json> send(const std::string& line) {
        sink.data.clear();
        loop.handle_line(line);
        std::vector<json> out;
        std::istringstream in(sink.data);
        std::string l;
        while (std::getline(in, l)) out.push_back(json::parse(l));
        return out;
    }
    std::string text_of(const std::vector<json>& recs) {
        std::string s;
        for (auto& r : recs) if (r["type"] == "token") {
            CHECK(!r["text"].get<std::string>().empty());
            s += r["text"].get<std::string>();
        }
        return s;
    }
    FakeEngine engine;
    CancelController cancel;
    StringSink sink;
    WorkerLoop loop;
};

int main() {
    {   // ready record
        Harness h;
        json r = h.loop.ready_record();
        CHECK_EQ(r["protocol"], 1);
        CHECK_EQ(r["capabilities"]["supports_cancel"], true);
        CHECK_EQ(r["capacity"], 4);
    }
    {   // UTF-8 split across byte tokens; EOS neither emitted nor counted
        FakeConfig cfg;
        cfg.script = {"h\xC3\xA9\xF0\x9F\x98\x80!"};
        Harness h(cfg);
        auto recs = h.send(R"({"op":"generate","id":1,"prompt":"x"})");
        CHECK_EQ(h.text_of(recs), cfg.script[0]);
        for (auto& r : recs) if (r["type"] == "token") CHECK(is_valid_utf8(r["text"].get<std::string>()));
        json d = recs.back();
        CHECK_EQ(d["type"], "done");
        CHECK_EQ(d["completion_tokens"], 8);
        CHECK_EQ(d["finish_reason"], "stop");
        CHECK_EQ(d["generated_token_ids"].size(), size_t(8));
    }
    {   // stop string straddling tokens: cut, not emitted, ids omitted
        FakeConfig cfg;
        cfg.script = {"abc<END>def"};
        Harness h(cfg);
        auto recs = h.send(R"({"op":"generate","id":1,"prompt":"x","stop":["<END>"]})");
        CHECK_EQ(h.text_of(recs), std::string("abc"));
        CHECK_EQ(recs.back()["stop_string"], "<END>");
        CHECK(!recs.back().contains("generated_token_ids"));
    }
    {   // length and context clamp
        FakeConfig cfg;
        cfg.n_ctx = 8;
        cfg.script = {"0123456789"};
        Harness h(cfg);
        auto recs = h.send(R"({"op":"generate","id":1,"prompt":"abcde"})");
        CHECK_EQ(recs.back()["finish_reason"], "length");
        CHECK_EQ(recs.back()["completion_tokens"], 3);
        recs = h.send(R"({"op":"generate","id":2,"prompt":"abcdefgh"})");
        CHECK_EQ(recs.back()["code"], "context_length_exceeded");
        CHECK_EQ(recs.back()["prompt_tokens"], 8);
    }
    {   // warm resume on a named session
        FakeConfig cfg;
        cfg.script = {"ok"};
        Harness h(cfg);
        auto recs = h.send(R"({"op":"generate","id":1,"prompt":"hello","session_id":"s"})");
        CHECK_EQ(recs.back()["reused_prompt_tokens"], 0);
        recs = h.send(R"({"op":"generate","id":2,"prompt":"hellook more","session_id":"s"})");
        CHECK_EQ(recs.back()["reused_prompt_tokens"], 7);  // "hello" + "ok" (EOS ended it: all decoded)
        CHECK_EQ(recs.back()["prefilled_prompt_tokens"], 5);
    }
    {   // bad lines
        Harness h;
        CHECK_EQ(h.send("not json")[0]["code"], "invalid_json");
        CHECK_EQ(h.send("[1,2]")[0]["code"], "invalid_request");
        CHECK_EQ(h.send(R"({"op":"nope","id":3})")[0]["code"], "invalid_request");
        CHECK_EQ(h.send(R"({"op":"generate","id":3,"prompt":5})")[0]["code"], "invalid_request");
        CHECK_EQ(h.send(R"({"op":"generate","id":4,"prompt":""})")[0]["code"], "empty_prompt");
        CHECK_EQ(h.send(R"({"op":"generate","id":4,"prompt":"x"})")[0]["code"], "invalid_request");  // stale
        CHECK_EQ(h.send(R"({"op":"generate","id":5,"prompt_segments":[{"ids":[999]}]})")[0]["code"], "invalid_token_id");
        CHECK(h.send("   ").empty());
    }
    {   // a latched cancel ends the request at once with cancelled: true
        Harness h;
        h.cancel.on_frame(1);
        auto recs = h.send(R"({"op":"generate","id":1,"prompt":"abc","session_id":"s"})");
        CHECK_EQ(recs.back()["cancelled"], true);
        CHECK_EQ(recs.back()["finish_reason"], "stop");
        recs = h.send(R"({"op":"generate","id":2,"prompt":"abc","session_id":"s"})");
        CHECK_EQ(recs.back()["cancelled"], false);
        CHECK_EQ(recs.back()["prefill_plan"], "dirty");
    }
    {   // sessions: capacity
        FakeConfig cfg;
        cfg.capacity = 2;
        Harness h(cfg);
        CHECK_EQ(h.send(R"({"op":"session_open","id":1,"session_id":"a"})")[0]["type"], "ack");
        CHECK_EQ(h.send(R"({"op":"session_open","id":2,"session_id":"b"})")[0]["code"], "capacity_exhausted");
        CHECK_EQ(h.send(R"({"op":"session_close","id":3,"session_id":"a"})")[0]["type"], "ack");
        CHECK_EQ(h.send(R"({"op":"session_open","id":4,"session_id":"b"})")[0]["type"], "ack");
    }
    {   // token text escaping round-trips through a JSON parser (control chars, quotes, UTF-8)
        std::string out;
        const std::string text = std::string("a\"b\\c\n\t\x01\x1f\x7f \xC3\xA9", 14);  // 14: incl. the NUL
        append_json_string(out, text);
        CHECK_EQ(json::parse(out).get<std::string>(), text);
    }
    {   // LineReader bounds
        std::string input = std::string(50, 'a') + "\nshort\n" + std::string(10, 'b');
        size_t off = 0;
        LineReader r([&](char* buf, size_t cap) -> long {
            size_t n = std::min<size_t>(std::min<size_t>(cap, 7), input.size() - off);
            std::memcpy(buf, input.data() + off, n);
            off += n;
            return static_cast<long>(n);
        }, 20);
        std::string line;
        CHECK(r.next(line) == LineReader::Kind::too_long);
        CHECK(r.next(line) == LineReader::Kind::line);
        CHECK_EQ(line, std::string("short"));
        CHECK(r.next(line) == LineReader::Kind::eof);
    }
    return trioserve_test::finish("test_worker_loop");
}
