// Unit tests for the scheduler: the pure step planner (budget, decodes first, FIFO prefill,
// logits only where a sample follows), the slot table's choice rules, and the loop's steps as
// the fake engine records them (continuous batching, budget, FIFO, no starvation, abort).
#include "check.h"
#include "engines/fake/fake_engine.h"
#include "scheduler.h"
#include "slot_table.h"
#include "loop/worker_loop.h"

#include <sstream>

using namespace trioserve;
using nlohmann::json;

static std::vector<json> parse(const std::string& data) {
    std::vector<json> out;
    std::istringstream in(data);
    std::string l;
    while (std::getline(in, l)) out.push_back(json::parse(l));
    return out;
}

static std::string text_of(const std::vector<json>& recs, uint64_t id) {
    std::string s;
    for (auto& r : recs) if (r["type"] == "token" && r["id"] == id) s += r["text"].get<std::string>();
    return s;
}

static size_t step_tokens(const FakeStepRecord& s) {
    size_t n = 0;
    for (auto& it : s.items) n += it.n;
    return n;
}

/// A paced loop over the fake engine (2 ms per prompt token): stream 1 (a `first`-token
/// prompt) decodes while stream 2's `n`-token prompt is admitted. Returns stream 2's chunk
/// sizes; checks that every one of those steps also carried stream 1's decode.
static std::vector<size_t> paced_chunks(double target_ms, size_t efficient_prefill, size_t first, size_t n) {
    FakeConfig cfg;
    cfg.script = {std::string(200, 's'), "b"};
    cfg.prefill_ms_per_token = 2;
    cfg.record_steps = true;
    FakeEngine engine(cfg);
    CancelController cancel;
    StringSink sink;
    WorkerOptions opts{512, 512, true};
    opts.step_target_ms = target_ms;
    opts.efficient_prefill = efficient_prefill;
    WorkerLoop loop(engine, cancel, sink, opts);
    loop.handle_line(R"({"op":"generate","id":1,"prompt":")" + std::string(first, 'a') + R"("})");
    loop.step();  // stream 1's prompt in (nobody decoding: unpaced), its first token sampled
    loop.handle_line(R"({"op":"generate","id":2,"prompt":")" + std::string(n, 'p') + R"("})");
    std::vector<size_t> chunks;
    for (size_t in = 0; in < n;) {
        loop.step();
        bool decode_1 = false;
        for (auto& it : engine.step_log().back().items) {
            if (it.slot == 0) decode_1 = it.n == 1;
            if (it.slot == 1) chunks.push_back(it.n), in += it.n;
        }
        CHECK(decode_1);
    }
    return chunks;
}

int main() {
    std::vector<PlannedItem> out;
    {   // decodes first, then the first prefill takes what is left of the budget
        plan_step({{true, 0}, {true, 0}, {false, 3000}, {false, 100}}, 512, 512, out);
        CHECK_EQ(out.size(), size_t(3));
        CHECK(out[0].index == 0 && out[0].n == 1 && out[0].logits && !out[0].prefill);
        CHECK(out[1].index == 1 && out[1].n == 1 && out[1].logits);
        CHECK(out[2].index == 2 && out[2].n == 510 && !out[2].logits && out[2].prefill);
    }
    {   // FIFO: the second prefill gets the rest once the first is complete; logits on the last chunk
        plan_step({{false, 100}, {false, 1000}, {false, 5}}, 512, 512, out);
        CHECK_EQ(out.size(), size_t(2));
        CHECK(out[0].index == 0 && out[0].n == 100 && out[0].logits);
        CHECK(out[1].index == 1 && out[1].n == 412 && !out[1].logits);
    }
    {   // max_chunk bounds one generation's chunk; the budget goes on to the next in line
        plan_step({{false, 1000}, {false, 1000}}, 512, 200, out);
        CHECK_EQ(out.size(), size_t(2));
        CHECK(out[0].n == 200 && out[1].n == 200);
    }
    {   // decodes use the whole budget: prefill still gets one token (admission never stalls)
        plan_step({{true, 0}, {true, 0}, {true, 0}, {false, 50}}, 3, 512, out);
        CHECK_EQ(out.size(), size_t(4));
        CHECK(out[3].index == 3 && out[3].n == 1 && out[3].prefill);
        size_t total = 0;
        for (auto& p : out) total += p.n;
        CHECK(total <= max_step_tokens(3, 4));
    }
    {   // nothing pending: an empty plan
        plan_step({}, 512, 512, out);
        CHECK(out.empty());
    }
    {   // a checkpoint mark stops a prefill piece there (spec §6.3); the budget goes on to the next
        StepCandidate marked{false, 1000, 100};
        marked.stop_at = 300;
        plan_step({marked, {false, 1000}}, 512, 512, out);
        CHECK_EQ(out.size(), size_t(2));
        CHECK(out[0].n == 200 && !out[0].logits && out[1].n == 312);
        marked.stop_at = 100;  // already there (or passed): no cap
        plan_step({marked}, 512, 512, out);
        CHECK(out.size() == 1 && out[0].n == 512);
    }

    {   // slot table: longest common prefix among idle unbound slots, else LRU; bound slots never
        SlotTable t(4);
        t.at(0).resident = {1, 2, 3};
        t.at(1).resident = {1, 2, 9, 9};
        t.at(2).resident = {1, 2, 3, 4, 5};
        t.bind(2, "named");
        t.acquire(3, 7);
        t.release(3);  // slot 3: most recently used, empty
        CHECK_EQ(t.pick_anonymous({1, 2, 3, 4}), 0);  // slot 2 shares more but is bound
        t.acquire(0, 8);
        CHECK_EQ(t.pick_anonymous({1, 2, 3, 4}), 1);
        CHECK_EQ(t.pick_anonymous({5, 5}), 1);        // no prefix anywhere: LRU (1 never used)
        SlotTable::mark_dirty(t.at(1));
        CHECK_EQ(t.pick_anonymous({1, 2}), 1);        // dirty: no reuse, still LRU
        CHECK(t.at(1).resident.empty());
        CHECK_EQ(t.max_named(), size_t(3));
        CHECK(t.find_session("named") == &t.at(2));
        t.acquire(1, 9);
        t.acquire(3, 10);
        CHECK_EQ(t.pick_anonymous({1}), -1);          // every unbound slot busy
        CHECK_EQ(t.pick_for_binding(), -1);
    }

    {   // continuous batching: a running stream keeps one token per step while a 3,000-token
        // prompt is admitted in budget-sized chunks; both outputs are as alone
        FakeConfig cfg;
        cfg.script = {std::string(40, 's'), "long done"};
        cfg.record_steps = true;
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
        loop.handle_line(R"({"op":"generate","id":1,"prompt":"short"})");
        loop.step();  // stream 1: prefill + first token
        loop.step();  // decoding
        const size_t before = engine.step_log().size();
        loop.handle_line(R"({"op":"generate","id":2,"prompt":")" + std::string(3000, 'L') + R"("})");
        loop.run_until_idle();
        auto recs = parse(sink.data);
        CHECK_EQ(text_of(recs, 1), std::string(40, 's'));
        CHECK_EQ(text_of(recs, 2), std::string("long done"));
        const auto& log = engine.step_log();
        size_t prefill_steps = 0;
        for (size_t i = before; i < log.size(); ++i) {
            CHECK(step_tokens(log[i]) <= 512);
            bool has_prefill = false, has_decode_1 = false;
            for (auto& it : log[i].items) {
                if (it.prefill) has_prefill = true;
                if (it.slot == 0 && !it.prefill && it.n == 1) has_decode_1 = true;
            }
            if (has_prefill) {
                ++prefill_steps;
                CHECK(has_decode_1);  // stream 1 (slot 0) never skips a step while 2 is admitted
            }
        }
        CHECK_EQ(prefill_steps, size_t(6));  // 3000 tokens at 511 per step (1 for the decode)
    }
    {   // FIFO admission: B's prefill starts only when A's prompt is in (or in A's last step)
        FakeConfig cfg;
        cfg.script = {"a", "b"};
        cfg.record_steps = true;
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{100, 100, true});
        loop.handle_line(R"({"op":"generate","id":1,"prompt":")" + std::string(250, 'A') + R"("})");
        loop.handle_line(R"({"op":"generate","id":2,"prompt":")" + std::string(120, 'B') + R"("})");
        loop.run_until_idle();
        const auto& log = engine.step_log();
        // Steps: A100 | A100 | A50+B50 | (A decodes) B... : slot 1 appears first in step 3.
        CHECK(log.size() >= 3);
        CHECK_EQ(log[0].items.size(), size_t(1));
        CHECK_EQ(log[0].items[0].slot, 0);
        CHECK_EQ(log[1].items.size(), size_t(1));
        CHECK_EQ(log[2].items.size(), size_t(2));
        CHECK(log[2].items[0].slot == 0 && log[2].items[0].n == 50 && log[2].items[0].logits);
        CHECK(log[2].items[1].slot == 1 && log[2].items[1].n == 50 && !log[2].items[1].logits);
        auto recs = parse(sink.data);
        CHECK_EQ(text_of(recs, 1), std::string("a"));
        CHECK_EQ(text_of(recs, 2), std::string("b"));
    }
    {   // a cancel at a step boundary: the generation ends before its next step; the other
        // generation's output and slot state are exactly as alone
        FakeConfig cfg;
        cfg.script = {"keep going", "never"};
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
        loop.handle_line(R"({"op":"generate","id":1,"prompt":"abc"})");
        loop.step();
        loop.handle_line(R"({"op":"generate","id":2,"prompt":")" + std::string(600, 'z') + R"("})");
        loop.step();         // 1 decodes, 2 prefills 511 of 600
        cancel.on_frame(2);  // between steps
        loop.run_until_idle();
        auto recs = parse(sink.data);
        CHECK_EQ(text_of(recs, 1), std::string("keep going"));
        json d2;
        for (auto& r : recs) if (r["id"] == 2) d2 = r;
        CHECK_EQ(d2["type"], "done");
        CHECK_EQ(d2["cancelled"], true);
        CHECK_EQ(d2["completion_tokens"], 0);
        CHECK_EQ(engine.slot_tokens(0).size(), size_t(3 + 10));  // EOS ended it: every token was fed
        // A cancel leaves the slot exact (spec §7): the 511 prompt tokens of the finished step.
        CHECK(!loop.slots().at(1).dirty);
        CHECK_EQ(loop.slots().at(1).resident.size(), engine.slot_tokens(1).size());
    }
    {   // a cancel that arrives WHILE a step holds the generation's prefill chunk aborts the
        // whole step (nothing appended); the step is redone without it and the decoding
        // stream is unaffected
        FakeConfig cfg;
        cfg.script = {"steady", "never"};
        cfg.record_steps = true;
        CancelController cancel;
        cfg.on_step = [&cancel](const FakeStepRecord& rec) {
            for (auto& it : rec.items)
                if (it.slot == 1 && it.prefill) cancel.on_frame(2);  // as the watcher thread would
        };
        FakeEngine engine(cfg);
        StringSink sink;
        WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
        loop.handle_line(R"({"op":"generate","id":1,"prompt":"abc"})");
        loop.step();  // 1: prompt in, first token sampled
        loop.handle_line(R"({"op":"generate","id":2,"prompt":")" + std::string(600, 'q') + R"("})");
        loop.run_until_idle();
        auto recs = parse(sink.data);
        CHECK_EQ(text_of(recs, 1), std::string("steady"));
        json d2;
        for (auto& r : recs) if (r["id"] == 2) d2 = r;
        CHECK_EQ(d2["cancelled"], true);
        CHECK_EQ(d2["completion_tokens"], 0);
        const auto& log = engine.step_log();
        size_t aborted = 0;
        for (size_t i = 0; i < log.size(); ++i) {
            if (!log[i].aborted) continue;
            ++aborted;
            CHECK(i + 1 < log.size());
            // The redo: the same decode of slot 0, without slot 1.
            CHECK_EQ(log[i + 1].items.size(), size_t(1));
            CHECK(log[i + 1].items[0].slot == 0 && log[i + 1].items[0].n == 1 && !log[i + 1].aborted);
        }
        CHECK_EQ(aborted, size_t(1));
        CHECK(engine.slot_tokens(1).empty());                     // nothing of 2 stayed resident
        CHECK_EQ(engine.slot_tokens(0).size(), size_t(3 + 6));    // "abc" + "steady" (EOS ended it)
    }
    {   // a cancel during a step that is one generation's decode alone aborts that step
        // (nothing appended, no token); with another generation in the step, it waits for
        // the boundary and the other's token is kept
        for (const bool alone : {true, false}) {
            FakeConfig cfg;
            cfg.script = {"0123456789", "abcdefghij"};
            cfg.record_steps = true;
            CancelController cancel;
            size_t decode_steps_of_1 = 0;
            cfg.on_step = [&](const FakeStepRecord& rec) {
                for (auto& it : rec.items)
                    if (it.slot == 0 && !it.prefill && ++decode_steps_of_1 == 3) cancel.on_frame(1);
            };
            FakeEngine engine(cfg);
            StringSink sink;
            WorkerLoop loop(engine, cancel, sink, WorkerOptions{512, 512, true});
            loop.handle_line(R"({"op":"generate","id":1,"prompt":"abc"})");
            if (!alone) loop.handle_line(R"({"op":"generate","id":2,"prompt":"xyz"})");
            loop.run_until_idle();
            auto recs = parse(sink.data);
            json d1;
            for (auto& r : recs) if (r["id"] == 1 && r["type"] == "done") d1 = r;
            CHECK_EQ(d1["cancelled"], true);
            size_t aborted = 0;
            for (auto& st : engine.step_log()) aborted += st.aborted;
            // Steps of 1: prefill+sample "0", decode -> "1", decode -> "2", the third decode is
            // cancelled: aborted (alone, no third token) or completed (with 2: "3" is kept).
            CHECK_EQ(aborted, size_t(alone ? 1 : 0));
            CHECK_EQ(text_of(recs, 1), std::string(alone ? "012" : "0123"));
            if (!alone) CHECK_EQ(text_of(recs, 2), std::string("abcdefghij"));
        }
    }
    {   // StepPacer: the budget of a step that carries decodes follows the measured rate
        CHECK_EQ(StepPacer(0, 16, 512).budget(3), size_t(512));    // off
        StepPacer p(250, 16, 512);
        CHECK_EQ(p.budget(0), size_t(512));  // nobody decoding: the whole budget for the prompt
        CHECK_EQ(p.budget(3), size_t(19));   // unmeasured: the minimum (3 decodes + 16)
        p.observe(100, 1, 400);              // 4 ms a token (CPU-like)
        CHECK_EQ(p.budget(3), size_t(62));   // 250 / 4
        CHECK_EQ(p.budget(0), size_t(512));
        p.observe(100, 1, 800);              // 8 ms: the average moves halfway, to 6
        CHECK_EQ(p.budget(3), size_t(41));
        p.observe(10, 1, 1000);              // very slow steps: the minimum (decodes + 16) would
        p.observe(10, 1, 1000);              // take 1.45 s, so down to half of it, never below
        CHECK_EQ(p.budget(3), size_t(11));
        StepPacer gpu(250, 16, 512);
        gpu.observe(512, 1, 20);             // a fast device: the cap binds, as without pacing
        CHECK_EQ(gpu.budget(4), size_t(512));
        CHECK_EQ(StepPacer(250, 16, 10).budget(3), size_t(10));  // never above the cap
        p.observe(0, 1, 5);                   // ignored: no tokens / no time
        p.observe(5, 1, 0);
        p.observe(512, 0, 100);                  // ignored: nobody decoded, the pacer did not size it
        CHECK_EQ(p.budget(3), size_t(11));
        StepPacer flat(1000, 16, 512);       // no efficient size (flash attention off), deep into
        flat.observe(17, 1, 1300, 17000);    // a prompt: the minimum took 1.3 s (76 ms a token),
        CHECK_EQ(flat.budget(1, 17016), size_t(13));  // so the next step is what fits the target
        flat.observe(13, 1, 1950, 17028);    // a slow one (150 ms a token, averaged to 113): 8 would
        CHECK_EQ(flat.budget(1, 17040), size_t(9));   // fit, but not below half the minimum
        CHECK_EQ(flat.budget(1, 20000), size_t(17));  // a rate measured 2,900 tokens shallower: the minimum
        StepPacer tiled(1000, 16, 512, 65);  // kernels at full rate from 65 prompt tokens
        CHECK_EQ(tiled.budget(1), size_t(17));  // unmeasured: the minimum, to measure the rate
        tiled.observe(33, 1, 594);           // 18 ms a token on the slow kernels: 65 would take
        CHECK_EQ(tiled.budget(1), size_t(66));  // at most 1.2 s there, so a probe of 65
        tiled.observe(66, 1, 990);           // 15 ms a token at 65: fits, and 66 fit 1 s
        CHECK_EQ(tiled.budget(1), size_t(66));
        tiled.observe(66, 1, 1386);          // a slow step (21 ms a token): at the average, 18,
        CHECK_EQ(tiled.budget(1), size_t(66));  // 65 still fit in 1.2 targets
        StepPacer slow(1000, 16, 512, 65);   // 24 ms a token on small steps: a probe of 65
        slow.observe(20, 1, 480);            // (predicted 1.56 s, within 1.6 targets),
        CHECK_EQ(slow.budget(1), size_t(66));
        slow.observe(66, 1, 1518);           // which took 1.5 s: over 1.2 targets, so the next
        CHECK_EQ(slow.budget(1), size_t(41));   // steps are what fits the target at the small
        for (int k = 0; k < 4; ++k) {        // steps' rate, and after 4 of them the efficient
            CHECK_EQ(slow.budget(1), size_t(41));  // size is probed again (a noisy step must
            slow.observe(41, 1, 984);        // not keep it off for good)
        }
        CHECK_EQ(slow.budget(1), size_t(66));
        StepPacer deep(1000, 16, 512, 65);   // a prompt whose 65-token steps grow slower with
        deep.observe(66, 1, 990, 1000);      // depth: at 1,000 tokens 15 ms a token, at 4,000
        deep.observe(66, 1, 3300, 4000);     // 50: the average, 32.5, puts 65 over 1.6 targets,
        for (int k = 0; k < 5; ++k) deep.observe(20, 1, 1000, 4100 + 20 * k);  // so no probe
        CHECK_EQ(deep.budget(1, 4200), size_t(20));
        CHECK_EQ(deep.budget(1, 0), size_t(20));  // a new prompt: the small steps' rate says no
        deep.observe(21, 1, 300, 0);         // ... until small steps at its depth say yes
        deep.observe(21, 1, 300, 20);        // (no efficient step was measured this shallow)
        CHECK_EQ(deep.budget(1, 40), size_t(66));
        deep.observe(66, 1, 990, 40);        // measured there, its rate replaces the deep one
        CHECK_EQ(deep.budget(1, 106), size_t(66));
        StepPacer stale(1000, 16, 512, 65);  // the small steps' rate of a prompt's start
        stale.observe(17, 1, 300, 0);        // (18 ms a token) does not size a small step
        stale.observe(66, 1, 990, 16);       // 3,000 tokens deeper, where 65 no longer fit:
        stale.observe(66, 1, 1980, 3000);    // the minimum measures it again,
        CHECK_EQ(stale.budget(1, 3066), size_t(17));
        stale.observe(17, 1, 850, 3066);     // and that measure replaces the old one
        CHECK_EQ(stale.budget(1, 3082), size_t(20));
        StepPacer wall(1000, 16, 512, 65);   // deep into a prompt the smallest step costs more
        wall.observe(66, 1, 990, 0);         // than the target: 65 at 40 ms a token (average
        wall.observe(66, 1, 2640, 6000);     // 27.5: 1.8 s) do not fit 1.2 targets, so a small
        CHECK_EQ(wall.budget(1, 6066), size_t(17));  // step measures its own rate,
        wall.observe(17, 1, 2550, 6066);     // 150 ms a token: the minimum takes 2.55 s, and the
        CHECK_EQ(wall.budget(1, 6082), size_t(66));  // efficient step is no longer than that
        CHECK_EQ(wall.extension(1, 6082, 66), size_t(82));  // 1.6 x 2.55 s at 27.5 ms: 148 tokens
        CHECK_EQ(wall.extension(0, 6082, 512), std::numeric_limits<size_t>::max());  // nobody waits
        CHECK_EQ(wall.extension(1, 100, 66), size_t(0));  // no efficient step measured this shallow
        StepPacer resumed(1000, 16, 512, 65);  // new prompt tokens after a reused 13k prefix: no
        resumed.observe(17, 1, 2550, 13000);   // efficient step measured there, and the minimum
        CHECK_EQ(resumed.budget(1, 13016), size_t(66));  // overshoots the target: a probe
        StepPacer big(1000, 16, 512, 65);    // a model at 50 ms a token: 65 would take 3.25 s,
        big.observe(20, 1, 1000);            // over 1.6 targets: no probe
        CHECK_EQ(big.budget(1), size_t(20));
        StepPacer fresh(1000, 16, 512, 65);  // a prompt prefilled alone in 512-token chunks at
        fresh.observe(512, 0, 3500);         // 7 ms a token teaches nothing: the first paced step
        CHECK_EQ(fresh.budget(1), size_t(17));  // is the minimum, not the 143 that rate would fit
    }
    {   // paced admission over the fake engine (2 ms per prompt token, 40 ms steps): while
        // stream 1 decodes, stream 2's 300-token prompt goes in chunks of about 20 tokens, one
        // decode of stream 1 in every step; sleeps only ever make the measured rate slower,
        // so the chunks can only get smaller (never below 16).
        const std::vector<size_t> chunks = paced_chunks(40, 0, 3, 300);
        CHECK(chunks.size() >= 300 / 24);
        for (size_t k = 0; k < chunks.size(); ++k) {
            CHECK(chunks[k] <= 24);
            if (k + 1 < chunks.size()) CHECK(chunks[k] >= 16);
        }
    }
    {   // an efficient prefill size (WorkerOptions::efficient_prefill; the llama worker's 65 on
        // the CPU): stream 1's 50-token prompt went in unpaced, which teaches the pacer nothing,
        // so the first paced step is the minimum (16 prompt tokens); at the 2 ms a prompt token
        // it measures, a 100 ms target fits ~50, but 55 fit in 1.2 times the target, so the rest
        // of the 300-token prompt goes in chunks of 55, each step still with stream 1's decode.
        // (Margin for a loaded machine: 55 stay within 1.2 targets up to 2.18 ms a token.)
        // The 9-token tail would not fit 1.2 targets with the last 55 (StepPacer::extension):
        // it goes alone.
        const std::vector<size_t> chunks = paced_chunks(100, 55, 50, 300);
        CHECK_EQ(chunks.size(), size_t(7));
        CHECK_EQ(chunks.front(), size_t(16));
        for (size_t k = 1; k + 1 < chunks.size(); ++k) CHECK_EQ(chunks[k], size_t(55));
        CHECK_EQ(chunks.back(), size_t(300 - 16 - 5 * 55));
    }
    {   // an efficient size (65): no piece leaves a last piece smaller than that
        plan_step({{true, 0}, {false, 99}}, 66, 512, out, 0, 65, 34);  // 65 would leave 34: all 99,
        CHECK(out.size() == 2 && out[1].n == 99 && out[1].logits);     // 34 over the budget
        plan_step({{true, 0}, {false, 99}}, 66, 512, out, 0, 65, 33);  // not allowed: 65, and the
        CHECK(out.size() == 2 && out[1].n == 65);                      // tail goes in small steps
        plan_step({{true, 0}, {false, 140}}, 66, 512, out, 0, 65);  // leaves 75: as planned
        CHECK(out.size() == 2 && out[1].n == 65 && !out[1].logits);
        plan_step({{false, 542}}, 512, 512, out, 0, 65);  // over the chunk: a 65-token last piece
        CHECK(out.size() == 1 && out[0].n == 477);
        plan_step({{false, 99, 0, 0, 80}}, 66, 512, out, 0, 65, 14);  // a mark at 80 ends the stretch:
        CHECK(out.size() == 1 && out[0].n == 80 && !out[0].logits);  // 66 leave 14 before it
        plan_step({{true, 0}, {false, 30}}, 66, 512, out, 0, 65, 100);  // a small piece: as planned
        CHECK(out.size() == 2 && out[1].n == 30);
        plan_step({{true, 0}, {false, 99}}, 66, 512, out, 0, 0, 100);  // off: as planned
        CHECK(out.size() == 2 && out[1].n == 65);
    }
    {   // prefill grid: chunks end on the grid (absolute positions) or at the prompt's end
        std::vector<StepCandidate> c = {{true, 0, 0}, {false, 300, 100}, {false, 500, 0}};
        plan_step(c, 200, 512, out, 64);
        CHECK_EQ(out.size(), size_t(2));  // 43 tokens left for the third: not a whole piece
        CHECK(out[1].index == 1 && out[1].n == 156 && !out[1].logits);  // 100 + 156 = 256
        plan_step({{false, 30, 256}}, 512, 512, out, 64);  // the prompt's end: any length
        CHECK(out.size() == 1 && out[0].n == 30 && out[0].logits);
        plan_step({{false, 1000, 0}}, 700, 512, out, 64);  // at most max_chunk, on the grid
        CHECK(out.size() == 1 && out[0].n == 512);
        std::vector<StepCandidate> full = {{true, 0, 0}, {true, 0, 0}, {false, 200, 64}};
        plan_step(full, 2, 512, out, 64);  // decodes fill the budget: still one whole piece
        CHECK(out.size() == 3 && out[2].n == 64);
    }
    {   // the loop with the prefill grid (--deterministic): pieces on the grid while another
        // stream decodes; the slot keeps only whole pieces of its prompt when its generation
        // ends; the next turn resumes on the grid and another slot shares only whole pieces
        FakeConfig cfg;
        cfg.script = {std::string(20, 's'), "x", "y", "z"};
        cfg.record_steps = true;
        FakeEngine engine(cfg);
        CancelController cancel;
        StringSink sink;
        WorkerOptions opts{200, 512, true};
        opts.prefill_grid = 64;
        WorkerLoop loop(engine, cancel, sink, opts);
        loop.handle_line(R"({"op":"generate","id":1,"prompt":"short"})");
        loop.step();
        const size_t before = engine.step_log().size();
        const std::string p2(300, 'L');
        loop.handle_line(R"({"op":"generate","id":2,"prompt":")" + p2 + R"("})");
        loop.run_until_idle();
        size_t at = 0;
        for (size_t i = before; i < engine.step_log().size(); ++i)
            for (auto& it : engine.step_log()[i].items) {
                if (!it.prefill || it.slot != 1) continue;
                at += it.n;
                CHECK(at % 64 == 0 || at == 300);  // 192 (budget 199), then 108: 256, 300
            }
        CHECK_EQ(at, size_t(300));
        CHECK_EQ(engine.position(1), int64_t(256));  // ended: the last short piece and "x" dropped
        CHECK_EQ(engine.position(0), int64_t(0));    // "short": no whole piece
        loop.handle_line(R"({"op":"generate","id":3,"prompt":")" + p2 + "more" + R"("})");
        loop.run_until_idle();
        auto recs = parse(sink.data);
        const json done3 = recs.back();
        CHECK(done3["type"] == "done" && done3["reused_prompt_tokens"] == 256);
        CHECK(loop.ready_record()["deterministic"] == true && loop.ready_record()["prefill_grid"] == 64);
    }
    return trioserve_test::finish("test_scheduler");
}
