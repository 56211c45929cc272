// Unit tests for WorkerLoop over FakeEngine with string sinks (no processes): records,
// validation, sessions and slots, cancellation, and the line splitter.
#include "check.h"
#include "loop_harness.h"

#include <chrono>
#include <map>
#include <thread>
#include <sstream>

using namespace trioserve;
using nlohmann::json;

/// The fake-engine loop with a StringSink, plus the token-text reader these tests share.
struct Harness : trioserve_test::LoopHarness<> {
    using LoopHarness::LoopHarness;
    static std::string text_of(const std::vector<json>& recs, uint64_t id = 0) {
        std::string s;
        for (auto& r : recs) if (r["type"] == "token" && (id == 0 || r["id"] == id)) {
            CHECK(!r["text"].get<std::string>().empty());
            s += r["text"].get<std::string>();
        }
        return s;
    }
    static json terminal(const std::vector<json>& recs, uint64_t id) {
        for (auto& r : recs) if (r["id"] == id && (r["type"] == "done" || r["type"] == "error")) return r;
        return json();
    }
};

int main() {
    {   // sliding window (spec §6.3): a restore that fails prefills from zero; a save that fails
        // only means no checkpoint. Echo mode: the output is the slot's last 64 bytes.
        for (const char* failing : {"restore_checkpoint", "save_checkpoint"}) {
            FakeConfig cfg;
            cfg.swa = 8;
            const std::string op = failing;
            cfg.fail_op = [op](const char* what, int32_t) { return op == what ? Status::engine_error : Status::ok; };
            Harness h(cfg);
            const std::string p1 = "system prompt, long enough. user: one";
            auto recs = h.send(R"({"op":"generate","id":1,"session_id":"s","prompt":")" + p1 + R"("})");
            const std::string out1 = h.text_of(recs);
            CHECK(out1.size() > 8);  // the window slid past the end of p1
            const std::string p2 = p1 + "[rewritten answer] user: two";
            recs = h.send(R"({"op":"generate","id":2,"session_id":"s","prompt":")" + p2 + R"("})");
            const json d = recs.back();
            CHECK_EQ(d["prefill_plan"], "mismatch");
            CHECK_EQ(d["reused_prompt_tokens"], 0);
            CHECK_EQ(h.text_of(recs), p2.substr(p2.size() - 64));
            CHECK_EQ(h.engine.checkpoints_restored(), uint64_t(0));
        }
    }
    {   // recurrent (spec §6.3): a diverging prompt restores the checkpoint at the previous
        // prompt's end; a restore that fails prefills from zero; a save that fails only means
        // no checkpoint. The output (the slot's last 64 bytes) is a cold run's either way.
        for (const char* failing : {"", "restore_checkpoint", "save_checkpoint"}) {
            FakeConfig cfg;
            cfg.recurrent = true;
            const std::string op = failing;
            cfg.fail_op = [op](const char* what, int32_t) { return op == what ? Status::engine_error : Status::ok; };
            Harness h(cfg);
            CHECK_EQ(h.loop.ready_record()["checkpoint_kind"], "recurrent");
            const std::string p1 = "system prompt, long enough. user: one";
            auto recs = h.send(R"({"op":"generate","id":1,"session_id":"s","prompt":")" + p1 + R"("})");
            const std::string p2 = p1 + "[answer without reasoning] user: two";
            recs = h.send(R"({"op":"generate","id":2,"session_id":"s","prompt":")" + p2 + R"("})");
            const json d = recs.back();
            CHECK_EQ(h.text_of(recs), p2.substr(p2.size() - 64));
            if (op.empty()) {
                CHECK_EQ(d["prefill_plan"], "checkpoint");
                CHECK_EQ(d["reused_prompt_tokens"], p1.size());
                CHECK_EQ(d["prefilled_prompt_tokens"], p2.size() - p1.size());
                CHECK_EQ(h.engine.checkpoints_restored(), uint64_t(1));
                CHECK(d["checkpoint_bytes"].get<uint64_t>() > 0);
            } else {
                CHECK_EQ(d["prefill_plan"], "mismatch");
                CHECK_EQ(d["reused_prompt_tokens"], 0);
                CHECK_EQ(h.engine.checkpoints_restored(), uint64_t(0));
            }
        }
    }
    {   // ready record (protocol 2)
        Harness h;
        json r = h.loop.ready_record();
        CHECK_EQ(r["protocol"], 2);
        CHECK_EQ(r["capabilities"]["supports_cancel"], true);
        CHECK_EQ(r["capabilities"]["multiplexed"], true);
        CHECK_EQ(r["capabilities"]["special_segments"], true);
        CHECK_EQ(r["capabilities"]["grammar"], false);
        CHECK_EQ(r["capacity"], 4);
        CHECK_EQ(r["max_line_bytes"], 16777216);
        CHECK_EQ(r["max_batch_tokens"], 512);
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
        for (const char* k : {"queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "total_ms"}) {
            CHECK(d[k].is_number());
            CHECK(d[k].get<double>() >= 0);
        }
        CHECK(d["ttft_ms"].get<double>() <= d["total_ms"].get<double>());
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
    {   // anonymous generations reuse the idle slot with the longest common prefix
        FakeConfig cfg;
        cfg.script = {"!"};
        Harness h(cfg);
        auto recs = h.send_all({R"({"op":"generate","id":1,"prompt":"system: be brief. user: hi"})",
                                R"({"op":"generate","id":2,"prompt":"something else entirely"})"});
        CHECK_EQ(h.terminal(recs, 1)["reused_prompt_tokens"], 0);
        CHECK_EQ(h.terminal(recs, 2)["reused_prompt_tokens"], 0);
        recs = h.send(R"({"op":"generate","id":3,"prompt":"system: be brief. user: bye"})");
        CHECK_EQ(recs.back()["reused_prompt_tokens"], 24);  // "system: be brief. user: "
        CHECK_EQ(recs.back()["prefill_plan"], "trimmed");
        CHECK_EQ(h.text_of(recs), std::string("!"));
    }
    {   // bad lines
        Harness h;
        CHECK_EQ(h.send("not json")[0]["code"], "invalid_json");
        CHECK_EQ(h.send("[1,2]")[0]["code"], "invalid_request");
        CHECK_EQ(h.send(R"({"op":"nope","id":3})")[0]["code"], "invalid_request");
        CHECK_EQ(h.send(R"({"op":"generate","id":4,"prompt":5})")[0]["code"], "invalid_request");
        CHECK_EQ(h.send(R"({"op":"generate","id":5,"prompt":""})")[0]["code"], "empty_prompt");
        CHECK_EQ(h.send(R"({"op":"generate","id":5,"prompt":"x"})")[0]["code"], "invalid_request");  // stale
        CHECK_EQ(h.send(R"({"op":"generate","id":6,"prompt_segments":[{"ids":[999]}]})")[0]["code"], "invalid_token_id");
        CHECK_EQ(h.send(R"({"op":"generate","id":7,"prompt_segments":[{"text":"a","special":1}]})")[0]["code"],
                 "invalid_request");
        CHECK_EQ(h.send(R"({"op":"generate","id":8,"prompt":"a","grammar":"root ::= \"a\""})")[0]["code"],
                 "unsupported_grammar");
        CHECK_EQ(h.send(R"({"op":"generate","id":9,"prompt":"a","grammar":5})")[0]["code"], "invalid_request");
        CHECK(h.send("   ").empty());
    }
    {   // tokenize takes text or prompt_segments (special flag accepted; the fake has no specials)
        Harness h;
        auto r = h.send(R"({"op":"tokenize","id":1,"prompt_segments":[{"text":"ab","special":false},{"ids":[7]}]})");
        CHECK_EQ(r[0]["ids"], json::array({97, 98, 7}));
        CHECK_EQ(h.send(R"({"op":"tokenize","id":2,"text":"ab","prompt_segments":[]})")[0]["code"], "invalid_request");
        CHECK_EQ(h.send(R"({"op":"tokenize","id":3,"text":""})")[0]["ids"], json::array());
    }
    {   // a latched cancel ends the request at once with cancelled: true, no tokens
        Harness h;
        h.cancel.on_frame(1);
        auto recs = h.send(R"({"op":"generate","id":1,"prompt":"abc","session_id":"s"})");
        CHECK_EQ(recs.size(), size_t(1));
        CHECK_EQ(recs.back()["cancelled"], true);
        CHECK_EQ(recs.back()["finish_reason"], "stop");
        CHECK_EQ(recs.back()["completion_tokens"], 0);
        recs = h.send(R"({"op":"generate","id":2,"prompt":"abc","session_id":"s"})");
        CHECK_EQ(recs.back()["cancelled"], false);
        CHECK_EQ(recs.back()["prefill_plan"], "new");  // a cancel leaves the slot exact (spec §7)
    }
    {   // sessions: capacity 2 leaves one named slot; a new session evicts the idle one;
        // busy session and busy slot
        FakeConfig cfg;
        cfg.capacity = 2;
        Harness h(cfg);
        CHECK_EQ(h.send(R"({"op":"session_open","id":1,"session_id":"a"})")[0]["type"], "ack");
        CHECK_EQ(h.send(R"({"op":"session_open","id":2,"session_id":"b"})")[0]["type"], "ack");  // evicts a
        CHECK_EQ(h.send(R"({"op":"session_close","id":3,"session_id":"a"})")[0]["found"], false);  // nothing spilled: empty
        CHECK_EQ(h.send(R"({"op":"session_open","id":4,"session_id":"b"})")[0]["type"], "ack");
        // Two generates on session b at once: the second is session_busy; a close while it
        // runs is session_busy too.
        auto recs = h.send_all({R"({"op":"generate","id":5,"prompt":"xy","session_id":"b"})",
                                R"({"op":"generate","id":6,"prompt":"xy","session_id":"b"})",
                                R"({"op":"session_close","id":7,"session_id":"b"})"});
        CHECK_EQ(h.terminal(recs, 5)["type"], "done");
        CHECK_EQ(h.terminal(recs, 6)["code"], "session_busy");
        CHECK_EQ(h.terminal(recs, 7)["code"], "session_busy");
        // Two anonymous at once: b holds one slot, so the second evicts b (idle) and takes its
        // slot; b's state is spilled and restored when b returns.
        recs = h.send_all({R"({"op":"generate","id":8,"prompt":"p"})", R"({"op":"generate","id":9,"prompt":"q"})"});
        CHECK_EQ(h.terminal(recs, 8)["type"], "done");
        CHECK_EQ(h.terminal(recs, 9)["type"], "done");
        CHECK_EQ(h.loop.slots().bound_count(), size_t(0));
        CHECK_EQ(h.loop.spill().contains("b"), true);
        recs = h.send(R"({"op":"generate","id":10,"prompt":"xyxy!","session_id":"b"})");
        CHECK_EQ(recs.back()["prefill_plan"], "restored");
        CHECK_EQ(recs.back()["restored_prompt_tokens"], 4);
        // Every bound session busy: a new one has no slot (the runtime never sends this).
        recs = h.send_all({R"({"op":"generate","id":11,"prompt":"long prompt","session_id":"b"})",
                           R"({"op":"generate","id":12,"prompt":"q","session_id":"c"})"});
        CHECK_EQ(h.terminal(recs, 12)["code"], "capacity_exhausted");
        CHECK_EQ(h.terminal(recs, 12)["capacity"], 2);
    }
    {   // capacity_exhausted beyond capacity; the others are unaffected
        FakeConfig cfg;
        cfg.capacity = 2;
        cfg.script = {"one", "two", "three"};
        Harness h(cfg);
        auto recs = h.send_all({R"({"op":"generate","id":1,"prompt":"a"})", R"({"op":"generate","id":2,"prompt":"b"})",
                                R"({"op":"generate","id":3,"prompt":"c"})"});
        CHECK_EQ(h.text_of(recs, 1), std::string("one"));
        CHECK_EQ(h.text_of(recs, 2), std::string("two"));
        CHECK_EQ(h.terminal(recs, 3)["code"], "capacity_exhausted");
        recs = h.send(R"({"op":"generate","id":4,"prompt":"d"})");  // a rejected generate takes no script entry
        CHECK_EQ(h.text_of(recs, 4), std::string("three"));
    }
    {   // N concurrent generations: each stream equals its solo output, records interleave
        FakeConfig cfg;
        cfg.script = {"alpha beta", "\xC3\xA9t\xC3\xA9", "x", "a much longer scripted answer"};
        Harness solo(cfg);
        std::map<uint64_t, std::string> alone;
        for (uint64_t id = 1; id <= 4; ++id)
            alone[id] = solo.text_of(solo.send(R"({"op":"generate","id":)" + std::to_string(id) + R"(,"prompt":"p"})"));
        Harness h(cfg);
        auto recs = h.send_all({R"({"op":"generate","id":1,"prompt":"p"})", R"({"op":"generate","id":2,"prompt":"p"})",
                                R"({"op":"generate","id":3,"prompt":"p"})", R"({"op":"generate","id":4,"prompt":"p"})"});
        for (uint64_t id = 1; id <= 4; ++id) {
            CHECK_EQ(h.text_of(recs, id), alone[id]);
            CHECK_EQ(h.terminal(recs, id)["cancelled"], false);
        }
        CHECK(recs[0]["id"] != recs[1]["id"]);  // interleaved, not one after the other
    }
    {   // token text escaping round-trips through a JSON parser (control chars, quotes, UTF-8)
        std::string out;
        const std::string text = std::string("a\"b\\c\n\t\x01\x1f\x7f \xC3\xA9", 14);  // 14: incl. the NUL
        append_json_string(out, text);
        CHECK_EQ(json::parse(out).get<std::string>(), text);
    }
    {   // LineSplitter bounds, across arbitrary chunks
        std::string input = std::string(50, 'a') + "\nshort\n" + std::string(25, 'c') + "\nx\n" + std::string(10, 'b');
        LineSplitter sp(20);
        std::vector<std::pair<LineSplitter::Kind, std::string>> got;
        for (size_t off = 0; off < input.size(); off += 7) {
            sp.feed(input.data() + off, std::min<size_t>(7, input.size() - off), [&](LineSplitter::Kind k, std::string_view l) {
                got.emplace_back(k, std::string(l));
                return true;
            });
        }
        CHECK_EQ(got.size(), size_t(4));
        CHECK(got[0].first == LineSplitter::Kind::too_long);
        CHECK(got[1].first == LineSplitter::Kind::line);
        CHECK_EQ(got[1].second, std::string("short"));
        CHECK(got[2].first == LineSplitter::Kind::too_long);
        CHECK_EQ(got[3].second, std::string("x"));
        // Exactly at the bound is a line; whole lines in one chunk; a false return stops.
        LineSplitter sp2(5);
        int n = 0;
        const std::string two = "12345\nabc\nzzz\n";
        CHECK(!sp2.feed(two.data(), two.size(), [&](LineSplitter::Kind k, std::string_view l) {
            CHECK(k == LineSplitter::Kind::line);
            ++n;
            return l != "abc";
        }));
        CHECK_EQ(n, 2);
    }
    {   // unique_keys: the veto reaches the engine's sampling; a script that repeats a key is
        // made to choose otherwise (the fake takes the next allowed byte), the rest is intact
        FakeConfig cfg;
        cfg.script = {R"({"a": 1, "b": {"a": 2}, "a": 3, "a": 4})", R"({"a": 1, "a": 2})"};
        Harness h(cfg);
        CHECK_EQ(h.loop.ready_record()["capabilities"]["unique_keys"], true);
        auto recs = h.send(R"({"op":"generate","id":1,"prompt":"x","unique_keys":{}})");
        CHECK_EQ(h.text_of(recs), std::string(R"({"a": 1, "b": {"a": 2}, "a#": 3, "a##": 4})"));
        CHECK_EQ(recs.back()["finish_reason"], "stop");
        recs = h.send(R"({"op":"generate","id":2,"prompt":"x"})");  // off: the script as it is
        CHECK_EQ(h.text_of(recs), cfg.script[1]);
        recs = h.send(R"({"op":"generate","id":3,"prompt":"x","unique_keys":{"reasoning_end":"</think>"}})");
        CHECK_EQ(h.text_of(recs), cfg.script[0]);  // never leaves the (unclosed) thinking block
        // a budget inside the refused key still ends with length
        recs = h.send(R"({"op":"generate","id":4,"prompt":"x","max_new_tokens":12,"unique_keys":{}})");
        CHECK_EQ(h.text_of(recs), std::string(R"({"a": 1, "a#)"));
        CHECK_EQ(recs.back()["finish_reason"], "length");
        int id = 10;
        for (const char* bad : {R"("unique_keys":true)", R"("unique_keys":{"reasoning_start":"<think>"})",
                                R"("unique_keys":{"reasoning_end":""})", R"("unique_keys":{"other":"x"})",
                                R"("unique_keys":{"reasoning_end":5})"}) {
            auto r = h.send(std::string(R"({"op":"generate","id":)") + std::to_string(id++) + R"(,"prompt":"x",)" + bad + "}");
            CHECK_EQ(r[0]["code"], "invalid_request");
        }
    }
    {   // the fake's token delay is a cadence: sampling steps end on a grid a delay apart, the
        // loop's time between them absorbed; after an idle gap past a grid point, the whole delay
        using clock = std::chrono::steady_clock;
        FakeConfig cfg;
        cfg.token_delay_ms = 150;
        FakeEngine engine(cfg);
        const TokenId token = 'a';
        StepItem item;
        item.tokens = &token;
        item.n = 1;
        item.logits = true;
        auto step_ms = [&] {
            const auto t0 = clock::now();
            CHECK(engine.step(&item, 1) == Status::ok);
            return std::chrono::duration<double, std::milli>(clock::now() - t0).count();
        };
        CHECK(step_ms() >= 150);  // nothing before it: the whole delay
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the loop's own work
        CHECK(step_ms() < 100);  // ~50 ms: the period stays 150 ms (a pause would take 150)
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // idle past a period
        CHECK(step_ms() >= 150);
    }
    {   // token coalescing (RecordWriter::set_token_interval, spec §4.1): a first token goes at
        // once, later ones wait for the interval, any other record writes them first (order)
        struct CountingSink : RecordSink {
            void write(std::string_view line) override { writes.emplace_back(line); }
            std::vector<std::string> writes;
        } sink;
        RecordWriter w(sink);
        w.write_token(1, "a");
        CHECK_EQ(sink.writes.size(), size_t(1));  // interval 0: one write per record
        w.set_token_interval(std::chrono::hours(1));
        w.write_token(2, "b", /*first=*/true);
        CHECK_EQ(sink.writes.size(), size_t(2));  // a first token is never held
        w.write_token(2, "c");
        w.write_token(1, "d");
        w.flush_due();
        CHECK_EQ(sink.writes.size(), size_t(2));  // held: the hour is not up
        w.write_json(json{{"type", "done"}, {"id", 1}});
        CHECK_EQ(sink.writes.size(), size_t(4));  // the held pair in one write, then the record
        CHECK_EQ(sink.writes[2], std::string("{\"type\":\"token\",\"id\":2,\"text\":\"c\"}\n"
                                             "{\"type\":\"token\",\"id\":1,\"text\":\"d\"}\n"));
        CHECK(sink.writes[3].find("\"done\"") != std::string::npos);
        w.set_token_interval(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(3));
        w.write_token(1, "e");  // more than 1 ms since the last write: at once
        CHECK_EQ(sink.writes.size(), size_t(5));
        w.write_token(1, "f");
        w.flush_held();
        CHECK_EQ(sink.writes.size(), size_t(6));
        w.flush_held();  // nothing held: no empty write
        CHECK_EQ(sink.writes.size(), size_t(6));
    }
    {   // through the loop: the same records with and without coalescing, in fewer writes
        FakeConfig cfg;
        cfg.script = {"one two three four five six seven"};
        auto run = [&](double interval_ms, size_t* writes) {
            struct CountingSink : RecordSink {
                void write(std::string_view line) override { ++n; data.append(line); }
                size_t n = 0;
                std::string data;
            } sink;
            FakeEngine engine(cfg);
            CancelController cancel;
            WorkerOptions opts{512, 512, true};
            opts.stream_interval_ms = interval_ms;
            std::vector<json> recs;
            {
                WorkerLoop loop(engine, cancel, sink, opts);
                loop.handle_line(R"({"op":"generate","id":1,"prompt":"x"})");
                loop.handle_line(R"({"op":"generate","id":2,"prompt":"y","max_new_tokens":5})");
                loop.run_until_idle();
            }
            *writes = sink.n;
            for (json r : trioserve_test::parse(sink.data, 0)) {
                for (const char* timing : {"queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "total_ms",
                                           "prefill_tok_s", "decode_tok_s"})
                    r.erase(timing);
                recs.push_back(r);
            }
            return recs;
        };
        size_t plain_writes = 0, held_writes = 0;
        const auto plain = run(0, &plain_writes);
        const auto held = run(60000, &held_writes);  // a minute: no flush comes from the clock
        CHECK(plain == held);
        CHECK_EQ(Harness::text_of(held, 1), cfg.script[0]);
        CHECK(held_writes < plain_writes);
        // Each generation's first token was a write of its own; the rest waited for its done
        // record (the held tokens in one write, then the record): 2 × 3 writes.
        CHECK_EQ(held_writes, size_t(6));
    }
    return trioserve_test::finish("test_worker_loop");
}
