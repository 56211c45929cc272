// Unit tests of self-speculative decoding: the draft indexes, the exact accept/resample rule
// (statistically, with fixed seeds: deterministic), the cost model and draft-length choice,
// and the worker loop over the fake engine (same output and slot state with and without
// drafts, stop strings / max_tokens inside a draft, cancel mid-verify, distribution kept).
#include "check.h"
#include "draft_index.h"
#include "loop_harness.h"
#include "speculation.h"

#include <map>
#include <sstream>

using namespace trioserve;
using nlohmann::json;

namespace {

std::vector<TokenId> ids_of(const std::string& s) {
    std::vector<TokenId> v;
    for (unsigned char c : s) v.push_back(c);
    return v;
}
std::string text_of_ids(const std::vector<TokenId>& v) {
    std::string s;
    for (TokenId t : v) s.push_back(static_cast<char>(t));
    return s;
}

struct Harness : trioserve_test::LoopHarness<> {
    explicit Harness(FakeConfig cfg, bool speculative, size_t capacity = 4)
        : LoopHarness(with_capacity(std::move(cfg), capacity), options(speculative)) {
        loop.calibrate_speculation();
    }
    static FakeConfig with_capacity(FakeConfig c, size_t capacity) {
        c.capacity = static_cast<int64_t>(capacity);
        c.record_steps = true;
        return c;
    }
    static WorkerOptions options(bool speculative) {
        WorkerOptions o{512, 512, true};
        o.speculative = speculative ? SpeculativeMode::automatic : SpeculativeMode::off;
        o.step_cost = {{1, 1.0}, {4096, 1.0}};  // flat: a draft always pays
        o.global_draft_tokens = 1024;
        return o;
    }
    static std::string text(const std::vector<json>& recs, uint64_t id) {
        std::string s;
        for (auto& r : recs)
            if (r["type"] == "token" && r["id"] == id) s += r["text"].get<std::string>();
        return s;
    }
    static json terminal(const std::vector<json>& recs, uint64_t id) {
        for (auto& r : recs)
            if (r["id"] == id && (r["type"] == "done" || r["type"] == "error")) return r;
        return json();
    }
};

std::string gen(uint64_t id, const std::string& prompt, const std::string& extra = "") {
    json j{{"op", "generate"}, {"id", id}, {"prompt", prompt}};
    if (!extra.empty()) j.update(json::parse(extra));
    return j.dump();
}

}  // namespace

int main() {
    {   // request index: the longest earlier suffix wins; its continuation is the draft
        RequestDraftIndex ix;
        const auto a = ids_of("def foo(x):\n    return x + 1\n\ndef foo(x):\n");
        ix.append(a.data(), a.size());
        Draft d = ix.draft(10);
        CHECK_EQ(d.match, size_t(8));
        CHECK_EQ(text_of_ids(d.tokens), std::string("    return"));
        CHECK(d.source == Draft::Source::request);
        // The current suffix never matches itself: a fresh sequence drafts nothing.
        RequestDraftIndex fresh;
        const auto b = ids_of("abcdefgh");
        fresh.append(b.data(), b.size());
        CHECK_EQ(fresh.draft(8).match, size_t(0));
        // A 2-gram match when nothing longer recurs; the most recent occurrence is used.
        RequestDraftIndex two;
        const auto c = ids_of("xy1 xy2 xy");
        two.append(c.data(), c.size());
        d = two.draft(4);
        CHECK_EQ(d.match, size_t(2));
        CHECK_EQ(text_of_ids(d.tokens), std::string("2 xy"));
        CHECK_EQ(two.draft(0).match, size_t(0));
    }
    {   // global index: finds another output's continuation; bounded and aged (FIFO)
        GlobalDraftIndex g(64);
        CHECK_EQ(g.bytes(), uint64_t(64 * 20));
        const auto out = ids_of("the quick brown fox");
        g.add_output(nullptr, 0, out.data(), out.size());
        const auto q = ids_of("a quick");
        Draft d = g.draft(q.data(), q.size(), 6);
        CHECK_EQ(d.match, size_t(4));  // " quick" -> "uick" 4-gram
        CHECK_EQ(text_of_ids(d.tokens), std::string(" brown"));
        // A continuation stops at the output's end (no run into the next output).
        const auto end = ids_of(" fox");
        d = g.draft(end.data(), end.size(), 6);
        CHECK_EQ(d.match, size_t(0));
        // Overwritten by newer outputs: the old entry is stale, never trusted.
        const auto filler = ids_of("0123456789012345678901234567890123456789012345678901234567890123456789");
        g.add_output(nullptr, 0, filler.data(), filler.size());
        d = g.draft(q.data(), q.size(), 6);
        CHECK_EQ(d.match, size_t(0));
        GlobalDraftIndex off(0);
        off.add_output(nullptr, 0, out.data(), out.size());
        CHECK_EQ(off.draft(q.data(), q.size(), 6).match, size_t(0));
    }
    {   // the start-up / fixed model: non-decreasing from the right, linear, proportional beyond
        StepCostModel c;
        c.set({{4, 12.0}, {1, 10.0}, {2, 9.0}, {8, 16.0}});
        CHECK_EQ(c.ms(1), 9.0);  // made non-decreasing from the right: 1 is never above 2
        CHECK_EQ(c.ms(2), 9.0);
        CHECK(std::fabs(c.ms(6) - 14.0) < 1e-9);
        CHECK(std::fabs(c.ms(16) - 32.0) < 1e-9);
        StepCostModel spike;  // one preempted measurement does not spread to bigger sizes
        spike.set({{1, 10.0}, {2, 11.0}, {4, 900.0}, {8, 14.0}});
        CHECK_EQ(spike.ms(4), 14.0);
    }
    {   // the cost table: keyed by shape, drafted steps relative to the plain step of the shape
        CHECK_EQ(StepCostTable::depth_bucket(0), size_t(0));
        CHECK_EQ(StepCostTable::depth_bucket(255), size_t(0));
        CHECK_EQ(StepCostTable::depth_bucket(256), size_t(1));
        CHECK_EQ(StepCostTable::depth_bucket(1500), size_t(3));
        CHECK_EQ(StepCostTable::depth_bucket(1 << 30), StepCostTable::kDepths - 1);
        StepCostTable t;
        CHECK(t.curve(1, 100).rel(4) == StepCurve::kUnknown);  // nothing measured: no cost known
        CHECK_EQ(t.probe_size(1, 100), size_t(0));
        for (int i = 0; i < 3; ++i) t.observe(1, 100, 1, 10.0);
        CHECK_EQ(t.probe_size(1, 100), size_t(1));  // plain steps seen, never a drafted one
        t.observe(1, 100, 9, 30.0);            // 8 draft tokens cost 3 plain steps
        CHECK(std::fabs(t.curve(1, 100).rel(8) - 3.0) < 1e-9);
        CHECK(std::fabs(t.curve(1, 100).rel(4) - 3.0) < 1e-9);   // below the smallest size: its cost
        CHECK(std::fabs(t.curve(1, 100).rel(17) - 6.0) < 1e-9);  // beyond: in proportion (18/9 x 3)
        t.observe(1, 100, 2, 15.0);
        CHECK(std::fabs(t.curve(1, 100).rel(4) - (1.5 + 1.5 * 3 / 7)) < 1e-9);  // linear between sizes
        CHECK_EQ(t.probe_size(1, 100), size_t(2));
        t.observe(1, 100, 3, 18.0);
        t.observe(1, 100, 5, 22.0);
        CHECK_EQ(t.probe_size(1, 100), size_t(0));  // every probe size measured
        CHECK(t.curve(1, 1500).rel(8) == StepCurve::kUnknown);    // another depth is another shape
        CHECK(t.curve(2, 100).rel(8) == StepCurve::kUnknown);     // and another stream count
        // The load doubles: plain steps follow it; the ratio of the drafted step stays.
        for (int i = 0; i < 60; ++i) t.observe(1, 100, 1, 20.0);
        CHECK(t.plain_ms(1, 100) > 19.0);
        CHECK(std::fabs(t.curve(1, 100).rel(8) - 3.0) < 1e-9);
        for (size_t i = 0; i < StepCostTable::kReprobeSteps; ++i) t.observe(1, 100, 1, 20.0);
        CHECK(t.probe_size(1, 100) > 0);  // stale: the oldest size is measured again
        CHECK_EQ(t.probe_size(1, 100, true), size_t(0));  // while drafts are chosen: no re-probe
        {   // sizes 1 and 2 paid: the curve chooses 2, yet 4 is still probed (beyond the biggest
            // measured size the curve grows in proportion, so 4 and 8 would never be chosen)
            StepCostTable u;
            for (int i = 0; i < 3; ++i) u.observe(1, 700, 1, 10.0);
            u.observe(1, 700, 2, 11.0);
            u.observe(1, 700, 3, 12.0);
            std::vector<size_t> k;
            choose_draft_lengths({0.99}, {12}, 1, u.curve(1, 700), 0.05, k);
            CHECK_EQ(k[0], size_t(2));
            CHECK_EQ(u.probe_size(1, 700, true), size_t(4));
            u.observe(1, 700, 5, 14.0);  // 4 draft tokens cost 1.4 plain steps
            CHECK_EQ(u.probe_size(1, 700, true), size_t(8));
            u.observe(1, 700, 9, 18.0);  // 8 cost 1.8
            CHECK_EQ(u.probe_size(1, 700, true), size_t(0));
            choose_draft_lengths({0.99}, {12}, 1, u.curve(1, 700), 0.05, k);
            CHECK(k[0] >= 8);  // now the measured curve chooses the longer draft
        }
        StepCostTable seeded;        // the start-up points seed the one-stream shallow shape only
        StepCostModel start;
        start.set({{1, 10.0}, {2, 12.0}, {4, 16.0}, {8, 24.0}});
        seeded.seed(start);
        CHECK(std::fabs(seeded.curve(1, 64).rel(3) - 1.6) < 1e-9);
        CHECK(seeded.curve(1, 1000).rel(3) == StepCurve::kUnknown);
        StepCostTable pinned;  // a fixed model (--step-cost-ms) is never replaced, for any shape
        pinned.fix({{1, 1.0}, {64, 1.0}});
        pinned.observe(4, 2000, 12, 500.0);
        CHECK_EQ(pinned.curve(4, 2000).rel(8), 1.0);
        CHECK_EQ(pinned.probe_size(4, 2000), size_t(0));
    }
    {   // the draft-length choice over synthetic cost tables
        std::vector<size_t> k;
        auto total = [&k] { size_t t = 0; for (size_t x : k) t += x; return t; };
        auto drafting = [&k] { size_t d = 0; for (size_t x : k) d += x > 0; return d; };
        // A CPU-like shape: each draft token costs 0.6 of a plain step.
        StepCostTable cpu;
        for (int i = 0; i < 3; ++i) cpu.observe(1, 100, 1, 10.0);
        for (const size_t e : StepCostTable::kProbeSizes) cpu.observe(1, 100, 1 + e, 10.0 + 6.0 * static_cast<double>(e));
        const StepCurve c1 = cpu.curve(1, 100);
        // A copy (high acceptance) pays a short draft.
        choose_draft_lengths({0.95}, {8}, 1, c1, 0.05, k);
        CHECK(k[0] >= 1);
        // Prose: only short suffix matches, whose prior acceptance is low: nothing drafted.
        SpecState prose;
        choose_draft_lengths({prose.alpha(2)}, {8}, 1, c1, 0.05, k);
        CHECK_EQ(k[0], size_t(0));
        choose_draft_lengths({prose.alpha(4)}, {8}, 1, c1, 0.05, k);
        CHECK_EQ(k[0], size_t(0));
        // Low acceptance backs off: a confident match drafts at first, not after rejections.
        SpecState gen;
        choose_draft_lengths({gen.alpha(8)}, {8}, 1, c1, 0.05, k);
        CHECK(k[0] >= 1);
        for (int i = 0; i < 8; ++i) gen.observe(k[0], 0, 8);
        choose_draft_lengths({gen.alpha(8)}, {8}, 1, c1, 0.05, k);
        CHECK_EQ(k[0], size_t(0));
        // Deep context: the same stream at 1,500 tokens measured drafted steps at 2 (one
        // draft token) and 6 (eight) plain steps: the shallow cost does not carry over, and an
        // acceptance that paid there no longer does.
        choose_draft_lengths({0.8}, {8}, 1, c1, 0.05, k);
        CHECK(k[0] >= 1);
        for (int i = 0; i < 3; ++i) cpu.observe(1, 1500, 1, 12.0);
        choose_draft_lengths({0.95}, {8}, 1, cpu.curve(1, 1500), 0.05, k);
        CHECK_EQ(k[0], size_t(0));  // never measured: zero (a probe measures it)
        cpu.observe(1, 1500, 2, 24.0);
        cpu.observe(1, 1500, 9, 72.0);
        choose_draft_lengths({0.8}, {8}, 1, cpu.curve(1, 1500), 0.05, k);
        CHECK_EQ(k[0], size_t(0));
        // Many streams: zero while no drafted step at that shape was measured, however good
        // the drafts look ...
        StepCostTable multi;
        for (int i = 0; i < 3; ++i) multi.observe(4, 1500, 4, 40.0);
        choose_draft_lengths(std::vector<double>(4, 0.95), std::vector<size_t>(4, 8), 4, multi.curve(4, 1500), 0.05, k);
        CHECK_EQ(total(), size_t(0));
        // ... and zero when the measured drafted step does not pay (the micro-batch of one
        // stream's draft costs 2.5 plain 4-stream steps) ...
        multi.observe(4, 1500, 12, 100.0);
        choose_draft_lengths(std::vector<double>(4, 0.95), std::vector<size_t>(4, 8), 4, multi.curve(4, 1500), 0.05, k);
        CHECK_EQ(total(), size_t(0));
        // ... and one drafting stream (the best one) where it was measured to pay.
        StepCostTable gpu;
        for (int i = 0; i < 3; ++i) gpu.observe(4, 1500, 4, 40.0);
        gpu.observe(4, 1500, 12, 42.0);
        choose_draft_lengths({0.5, 0.95, 0.9, 0.3}, std::vector<size_t>(4, 8), 4, gpu.curve(4, 1500), 0.05, k);
        CHECK_EQ(drafting(), size_t(1));
        CHECK(k[1] >= 1);
        // A fixed model (an operator's word) lets every stream draft.
        StepCostTable flat;
        flat.fix({{1, 10.0}, {64, 10.5}});
        choose_draft_lengths({0.9, 0.9}, {8, 3}, 2, flat.curve(2, 100), 0.05, k);
        CHECK_EQ(k[0], size_t(8));
        CHECK_EQ(k[1], size_t(3));
        StepCostTable linear;  // every token costs the same: a draft never pays
        linear.fix({{1, 10.0}, {64, 640.0}});
        choose_draft_lengths({0.9}, {8}, 1, linear.curve(1, 100), 0.05, k);
        CHECK_EQ(k[0], size_t(0));
        choose_draft_lengths({0.01}, {8}, 1, flat.curve(1, 100), 0.05, k);  // nothing worth a token
        CHECK_EQ(k[0], size_t(0));
        SpecState s;
        CHECK(s.alpha(8) > s.alpha(4));  // a longer match is trusted more before any evidence
        CHECK(s.alpha(4) > s.alpha(2));
        const double a0 = s.alpha(4);
        s.observe(4, 4, 4);
        CHECK(s.alpha(4) > a0);
        for (int i = 0; i < 6; ++i) s.observe(4, 0, 4);
        CHECK(s.alpha(4) < a0);
        CHECK_EQ(s.alpha(8), SpecState::kPriorAlpha[0]);  // other lengths keep their prior
        CHECK_EQ(s.drafted, int64_t(28));
        CHECK_EQ(s.accepted, int64_t(4));
    }
    {   // probing: a single stream's confident candidate, declined kProbeEvery times in a row,
        // is verified once anyway (at most kProbeLen tokens); never with several streams or a
        // short match, and any other step restarts the count.
        SpecState s;
        for (size_t i = 1; i < SpecState::kProbeEvery; ++i) CHECK_EQ(s.probe_length(8, 12, 1), size_t(0));
        CHECK_EQ(s.probe_length(8, 12, 1), SpecState::kProbeLen);
        CHECK_EQ(s.probe_length(8, 12, 1), size_t(0));  // the count starts again
        SpecState short_draft;
        for (size_t i = 1; i < SpecState::kProbeEvery; ++i) short_draft.probe_length(8, 12, 1);
        CHECK_EQ(short_draft.probe_length(8, 3, 1), size_t(3));  // no more than the candidate holds
        SpecState many;
        for (size_t i = 0; i < 2 * SpecState::kProbeEvery; ++i) CHECK_EQ(many.probe_length(8, 12, 4), size_t(0));
        SpecState weak;
        for (size_t i = 0; i < 2 * SpecState::kProbeEvery; ++i) CHECK_EQ(weak.probe_length(4, 12, 1), size_t(0));
        SpecState broken;
        for (size_t i = 1; i < SpecState::kProbeEvery; ++i) broken.probe_length(8, 12, 1);
        CHECK_EQ(broken.probe_length(2, 12, 1), size_t(0));  // a weak candidate restarts the count
        CHECK_EQ(broken.probe_length(8, 12, 1), size_t(0));
    }
    // The worker loop: the script re-emits text from the prompt (a "file" the agent read).
    const std::string file = "fn main() {\n    let x = compute(1, 2);\n    println!(\"{}\", x);\n}\n";
    const std::string edited = "fn main() {\n    let x = compute(1, 3);\n    println!(\"{}\", x);\n}\nDONE";
    {   // same output, same slot state, fewer steps; drafted/accepted counted
        FakeConfig cfg;
        cfg.script = {edited};
        std::string outs[2];
        std::vector<TokenId> slots[2];
        size_t steps[2];
        json done[2];
        for (int spec = 0; spec < 2; ++spec) {
            Harness h(cfg, spec == 1);
            auto recs = h.send_all({gen(1, "Rewrite this file:\n" + file + "Answer:\n")});
            outs[spec] = Harness::text(recs, 1);
            done[spec] = Harness::terminal(recs, 1);
            slots[spec] = h.engine.slot_tokens(0);
            steps[spec] = h.engine.step_log().size();
            CHECK(h.loop.idle_invariants_hold());
        }
        CHECK_EQ(outs[0], edited);
        CHECK_EQ(outs[1], edited);
        CHECK(slots[0] == slots[1]);
        CHECK_EQ(done[0]["generated_token_ids"], done[1]["generated_token_ids"]);
        CHECK_EQ(done[0]["completion_tokens"], done[1]["completion_tokens"]);
        CHECK(!done[0].contains("drafted_tokens"));
        CHECK(done[1]["drafted_tokens"].get<int64_t>() > 0);
        CHECK(done[1]["accepted_draft_tokens"].get<int64_t>() > 20);
        CHECK(done[1]["accepted_draft_tokens"].get<int64_t>() <= done[1]["drafted_tokens"].get<int64_t>());
        CHECK(steps[1] * 2 < steps[0]);
    }
    {   // stop strings, max_tokens and EOS inside a draft: exact cuts, slot state as without
        FakeConfig cfg;
        cfg.script = {edited};
        for (const std::string extra : {R"({"stop":["println"]})", R"({"max_tokens":30})", R"({"max_tokens":7})",
                                        R"({"stop":["3);\n"]})", R"({})"}) {
            std::string outs[2];
            json done[2];
            std::vector<TokenId> slots[2];
            for (int spec = 0; spec < 2; ++spec) {
                Harness h(cfg, spec == 1);
                auto recs = h.send_all({gen(1, "File:\n" + file + edited.substr(0, 20), extra)});
                outs[spec] = Harness::text(recs, 1);
                done[spec] = Harness::terminal(recs, 1);
                slots[spec] = h.engine.slot_tokens(0);
                CHECK(h.loop.idle_invariants_hold());
            }
            CHECK_EQ(outs[0], outs[1]);
            CHECK_EQ(done[0]["finish_reason"], done[1]["finish_reason"]);
            CHECK_EQ(done[0]["completion_tokens"], done[1]["completion_tokens"]);
            CHECK_EQ(done[0]["stop_string"], done[1]["stop_string"]);
            CHECK(slots[0] == slots[1]);
        }
    }
    {   // the next turn of the same session reuses the slot exactly (resident ids == engine)
        FakeConfig cfg;
        cfg.script = {edited, edited};
        Harness h(cfg, true);
        const std::string p1 = "File:\n" + file;
        auto recs = h.send_all({gen(1, p1, R"({"session_id":"s"})")});
        const json d1 = Harness::terminal(recs, 1);
        std::string prompt2 = p1 + edited + "\nagain\n";
        recs = h.send_all({gen(2, prompt2, R"({"session_id":"s"})")});
        const json d2 = Harness::terminal(recs, 2);
        CHECK(d1["accepted_draft_tokens"].get<int64_t>() > 20);
        // The slot holds exactly prompt + output (what plain decoding leaves), so the next
        // turn reuses all of it.
        CHECK_EQ(d2["prefill_plan"], "exact_prefix");
        CHECK_EQ(d2["reused_prompt_tokens"].get<int64_t>(), static_cast<int64_t>(p1.size() + edited.size()));
        CHECK(h.loop.idle_invariants_hold());
    }
    {   // grammar-constrained and unique-keys generations are never drafted
        FakeConfig cfg;
        cfg.script = {edited};
        cfg.grammar_unenforced = true;
        Harness h(cfg, true);
        auto recs = h.send_all({gen(1, "File:\n" + file, R"({"grammar":"root ::= \"x\""})")});
        CHECK(!Harness::terminal(recs, 1).contains("drafted_tokens"));
        CHECK_EQ(Harness::text(recs, 1), edited);
    }
    {   // the global index: a second request with a different prompt drafts from the first's output
        FakeConfig cfg;
        cfg.script = {edited};
        Harness h(cfg, true);
        auto recs = h.send_all({gen(1, "q1")});
        recs = h.send_all({gen(2, "q2")});
        const json d = Harness::terminal(recs, 2);
        CHECK_EQ(Harness::text(recs, 2), edited);
        CHECK(d["accepted_draft_tokens"].get<int64_t>() > 20);
    }
    {   // cancel mid-verify: the generation emits nothing after the cancel and ends at the
        // next step boundary; its slot is free at once (a new generate runs)
        FakeConfig cfg;
        cfg.script = {edited};
        CancelController* ctl = nullptr;
        bool fired = false;
        cfg.on_step = [&](const FakeStepRecord& r) {
            if (fired || ctl == nullptr) return;
            for (const auto& it : r.items)
                if (!it.prefill && it.n > 4) {
                    fired = true;
                    ctl->on_frame(1);
                }
        };
        Harness h(cfg, true, 1);
        ctl = &h.cancel;
        auto recs = h.send_all({gen(1, "File:\n" + file)});
        CHECK(fired);
        const json d = Harness::terminal(recs, 1);
        CHECK_EQ(d["cancelled"], true);
        const std::string t = Harness::text(recs, 1);
        CHECK(t.size() < edited.size());
        CHECK_EQ(t, edited.substr(0, t.size()));
        // The step that carried the draft is the last one with this generation.
        const auto& log = h.engine.step_log();
        size_t last_draft_step = 0;
        for (size_t i = 0; i < log.size(); ++i)
            for (const auto& it : log[i].items)
                if (it.n > 4 && !it.prefill) last_draft_step = i;
        CHECK_EQ(last_draft_step + 1, log.size());
        recs = h.send_all({gen(2, "next")});
        CHECK_EQ(Harness::terminal(recs, 2)["type"], "done");
        CHECK(h.loop.idle_invariants_hold());
    }
    {   // known probabilities: sampled outputs keep the distribution with drafts (the prompt
        // makes the index draft 'a' again and again; a blind accept would skew towards it),
        // the draft is accepted about p('a') of the time (the exact rule for a point-mass
        // draft), and the same seed gives the very same output with and without drafting.
        FakeConfig cfg;
        cfg.dist = {{'a', 0.2}, {'b', 0.5}, {'c', 0.3}};
        cfg.dist_tokens = 64;
        std::map<char, int> count[2];
        std::vector<std::string> texts[2];
        int64_t accepted = 0, drafted = 0, accepted_a = 0;
        for (int spec = 0; spec < 2; ++spec) {
            Harness h(cfg, spec == 1);
            for (uint64_t id = 1; id <= 60; ++id) {
                auto recs = h.send_all({gen(id, std::string(40, 'a') + "bab" + std::string(20, 'a'),
                                            R"({"temperature":1.0,"seed":)" + std::to_string(id * 7) + "}")});
                texts[spec].push_back(Harness::text(recs, id));
                for (char c : texts[spec].back()) ++count[spec][c];
                const json d = Harness::terminal(recs, id);
                if (spec == 1) {
                    drafted += d["drafted_tokens"].get<int64_t>();
                    accepted += d["accepted_draft_tokens"].get<int64_t>();
                }
            }
        }
        CHECK(texts[0] == texts[1]);
        CHECK(drafted > 500);
        (void)accepted_a;
        for (int spec = 0; spec < 2; ++spec) {
            const double n = count[spec]['a'] + count[spec]['b'] + count[spec]['c'];
            CHECK_EQ(n, 3840.0);
            // 3840 draws: the standard error of a frequency is at most 0.008; 0.03 is ~4 sigma.
            CHECK(std::fabs(count[spec]['a'] / n - 0.2) < 0.03);
            CHECK(std::fabs(count[spec]['b'] / n - 0.5) < 0.03);
            CHECK(std::fabs(count[spec]['c'] / n - 0.3) < 0.03);
        }
        // Drafts are mostly 'a' (p = 0.2) and sometimes 'b'/'c' from the prompt's "bab" or the
        // output: the per-token acceptance is far from both 0 and 1.
        const double rate = static_cast<double>(accepted) / static_cast<double>(drafted);
        CHECK(rate > 0.1 && rate < 0.5);
    }
    {   // ready record reports the mode and the index bounds; off reports off
        FakeConfig cfg;
        Harness on(cfg, true), off(cfg, false);
        const json a = on.loop.speculation_ready(), b = off.loop.speculation_ready();
        CHECK_EQ(a["mode"], "auto");
        CHECK_EQ(a["global_index_tokens"], 1024);
        CHECK_EQ(a["global_index_bytes"], 1024 * 20);
        CHECK_EQ(b["mode"], "off");
        CHECK_EQ(b["global_index_tokens"], 0);
        CHECK(!a.contains("off_reason") && !b.contains("off_reason"));  // off as asked: nothing to explain
    }
    {   // the start-up exactness check: a verify step unlike plain decoding turns drafting off,
        // the ready record says why, and a draftable request is served without drafts
        FakeConfig cfg;
        cfg.script = {"abcabcabcabcabcabcabc"};
        cfg.inexact_verify = true;
        Harness h(cfg, true);
        const json r = h.loop.speculation_ready();
        CHECK_EQ(r["mode"], "off");
        CHECK(r["off_reason"].get<std::string>().find("not bit-identical") != std::string::npos);
        CHECK(r["off_reason"].get<std::string>().find("scripted") != std::string::npos);
        const auto recs = h.send(gen(1, "abcabcabcabc"));
        const json done = Harness::terminal(recs, 1);
        CHECK_EQ(done["type"], "done");
        CHECK(!done.contains("drafted_tokens"));
        CHECK_EQ(Harness::text(recs, 1), std::string("abcabcabcabcabcabcabc"));
        // The same script with an exact verify drafts: the check, not the script, stopped it.
        cfg.inexact_verify = false;
        Harness exact(cfg, true);
        const json d = Harness::terminal(exact.send(gen(1, "abcabcabcabc")), 1);
        CHECK(d.value("drafted_tokens", 0) > 0);
    }
    return trioserve_test::finish("test_speculation");
}
