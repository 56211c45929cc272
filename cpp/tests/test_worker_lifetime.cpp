// Unit tests for the worker loop's failure isolation and lifetimes, over the
// fake engine with string sinks:
//   * cancel frames after shutdown / after the loop is gone touch nothing of it;
//   * an engine error (or bad_alloc) during admission leaves the slot and session tables, the
//     spill store and the cancel registrations as they were;
//   * a step that fails because of one item is retried without it: only that generation
//     fails, the others' text and slot contents are exactly those of a solo run;
//   * a cancel mid-prefill while another generation decodes costs that generation no step.
// Every scenario ends with the loop's idle invariants checked.
#include "check.h"
#include "records_check.h"
#include "engines/fake/fake_engine.h"
#include "loop/worker_loop.h"

#include <new>
#include <sstream>

using namespace trioserve;
using namespace trioserve_test;
using nlohmann::json;

namespace {

/// The slot and session tables as text: bindings, busy ids, retention, spilled sessions.
/// (Residency is left out: a slot whose engine state a failed call made unknown is dirty.)
std::string tables(const WorkerLoop& loop, const std::vector<std::string>& sessions) {
    std::string s;
    for (size_t i = 0; i < loop.slots().capacity(); ++i) {
        const Slot& sl = loop.slots().at(static_cast<int32_t>(i));
        s += "slot" + std::to_string(i) + "[" + sl.session + "," + std::to_string(sl.busy) + "," +
             std::to_string(sl.long_retention) + "] ";
    }
    s += "spilled:";
    for (const auto& sid : sessions) if (loop.spill().contains(sid)) s += " " + sid;
    return s;
}

struct Rig {
    explicit Rig(FakeConfig cfg, WorkerOptions opts = WorkerOptions{512, 512, true})
        : engine(std::move(cfg)), loop(std::make_unique<WorkerLoop>(engine, cancel, sink, opts)) {}
    std::vector<json> send_all(const std::vector<std::string>& lines) {
        const size_t from = sink.data.size();
        for (const auto& l : lines) loop->handle_line(l);
        loop->run_until_idle();
        return parse(sink.data, from);
    }
    FakeEngine engine;
    CancelController cancel;
    StringSink sink;
    std::unique_ptr<WorkerLoop> loop;
};

}  // namespace

int main() {
    {   // cancel after shutdown: `shutdown` unregisters every generation in flight (no terminal
        // records, spec §4.3); frames after it, and after the loop is destroyed, are stale
        FakeConfig cfg;
        cfg.script = {"a long answer", "another long answer"};
        Rig r(cfg);
        r.loop->handle_line(gen(1, "p"));
        r.loop->handle_line(gen(2, "q"));
        r.loop->step();
        CHECK_EQ(r.loop->in_flight(), size_t(2));
        CHECK_EQ(r.cancel.active_count(), size_t(2));
        CHECK(r.loop->handle_line(R"({"op":"shutdown","id":3})") == WorkerLoop::Flow::stop);
        CHECK_EQ(r.cancel.active_count(), size_t(0));
        CHECK(!r.loop->busy());
        CHECK(r.loop->idle_invariants_hold());
        r.cancel.on_frame(1);  // stale: ignored, nothing latched
        r.cancel.on_frame(2);
        CHECK_EQ(r.cancel.latched_count(), size_t(0));
        const size_t before = r.sink.data.size();
        r.loop->step();  // nothing left to run
        CHECK_EQ(r.sink.data.size(), before);
        r.loop.reset();
        r.cancel.on_frame(1);  // the loop is gone: nothing of it is touched (ASan: no use after free)
        r.cancel.on_frame(99);
        CHECK(r.cancel.is_latched(99));
    }
    {   // the loop destroyed with generations in flight (stdin EOF path): unregistered too
        FakeConfig cfg;
        cfg.script = {"xxxxxxxx"};
        Rig r(cfg);
        r.loop->handle_line(gen(1, "p"));
        r.loop->step();
        CHECK_EQ(r.cancel.active_count(), size_t(1));
        r.loop.reset();
        CHECK_EQ(r.cancel.active_count(), size_t(0));
        r.cancel.on_frame(1);
        CHECK_EQ(r.cancel.latched_count(), size_t(0));
    }
    {   // an engine error in admission after evict + bind would have happened: a new named
        // session "b" must evict idle session "a" (capacity 2: one named slot) and reset the
        // slot, and the reset fails. The tables are unchanged: "a" still bound where it was,
        // "b" unbound, nothing spilled, no slot busy, no registration. Then both work.
        FakeConfig cfg;
        cfg.capacity = 2;
        bool fail_reset = false;
        cfg.fail_op = [&fail_reset](const char* op, int32_t) {
            return fail_reset && (std::string(op) == "reset" || std::string(op) == "truncate") ? Status::engine_error
                                                                                                : Status::ok;
        };
        Rig r(cfg);
        auto recs = r.send_all({gen(1, "hello", R"(,"session_id":"a")")});
        CHECK_EQ(terminal(recs, 1)["type"], "done");
        const std::vector<std::string> sids{"a", "b"};
        const std::string before = tables(*r.loop, sids);
        const Slot* a_slot = r.loop->slots().at(0).session == "a" ? &r.loop->slots().at(0) : &r.loop->slots().at(1);
        fail_reset = true;
        recs = r.send_all({gen(2, "zzz", R"(,"session_id":"b")")});
        CHECK_EQ(terminal(recs, 2)["code"], "engine_error");
        CHECK_EQ(tables(*r.loop, sids), before);
        CHECK_EQ(a_slot->session, std::string("a"));
        CHECK(a_slot->dirty);  // its engine state is unknown after the failed reset
        CHECK_EQ(r.cancel.active_count(), size_t(0));
        CHECK(r.loop->idle_invariants_hold());
        fail_reset = false;
        recs = r.send_all({gen(3, "hello again", R"(,"session_id":"a")")});
        CHECK_EQ(terminal(recs, 3)["type"], "done");
        CHECK_EQ(terminal(recs, 3)["prefill_plan"], "dirty");
        CHECK_EQ(text_of(recs, 3), std::string("hello again"));  // echo: the slot holds exactly the prompt
        recs = r.send_all({gen(4, "zzz", R"(,"session_id":"b")")});
        CHECK_EQ(text_of(recs, 4), std::string("zzz"));
        CHECK(r.loop->spill().contains("a"));  // now evicted for real, and spilled
        CHECK(r.loop->idle_invariants_hold());
    }
    {   // an engine error while restoring a spilled session: the spilled copy is kept (the
        // request changed nothing), the victim stays bound; once the engine recovers, the
        // session is restored from that copy
        FakeConfig cfg;
        cfg.capacity = 2;
        bool broken = false;
        cfg.fail_op = [&broken](const char* op, int32_t) {
            const std::string o(op);
            return broken && (o == "load_state" || o == "reset") ? Status::engine_error : Status::ok;
        };
        Rig r(cfg);
        r.send_all({gen(1, "first session", R"(,"session_id":"a")")});
        r.send_all({gen(2, "second", R"(,"session_id":"b")")});  // evicts and spills "a"
        CHECK(r.loop->spill().contains("a"));
        const std::vector<std::string> sids{"a", "b"};
        const std::string before = tables(*r.loop, sids);
        broken = true;
        auto recs = r.send_all({gen(3, "first session, again", R"(,"session_id":"a")")});
        CHECK_EQ(terminal(recs, 3)["code"], "engine_error");
        CHECK_EQ(tables(*r.loop, sids), before);
        CHECK(r.loop->spill().contains("a"));
        CHECK(r.loop->idle_invariants_hold());
        broken = false;
        recs = r.send_all({gen(4, "first sessionfirst session, again", R"(,"session_id":"a")")});
        CHECK_EQ(terminal(recs, 4)["prefill_plan"], "restored");
        CHECK_EQ(terminal(recs, 4)["restored_prompt_tokens"], 26);  // "first session" + its echo
        CHECK(r.loop->idle_invariants_hold());
    }
    {   // bad_alloc during admission: saving the eviction victim's state (a large copy) throws;
        // and for an anonymous generate, the truncate throws. No slot is left busy, nothing
        // is bound, evicted or registered; the next request is served.
        FakeConfig cfg;
        cfg.capacity = 2;
        std::string throw_in;
        cfg.fail_op = [&throw_in](const char* op, int32_t) -> Status {
            if (throw_in == op) throw std::bad_alloc();
            return Status::ok;
        };
        Rig r(cfg);
        r.send_all({gen(1, "abcdef", R"(,"session_id":"a")")});
        r.send_all({gen(2, "anonymous one")});
        const std::vector<std::string> sids{"a", "b"};
        std::string before = tables(*r.loop, sids);
        throw_in = "save_state";
        auto recs = r.send_all({gen(3, "new", R"(,"session_id":"b")")});
        CHECK_EQ(terminal(recs, 3)["code"], "engine_error");
        CHECK_EQ(tables(*r.loop, sids), before);
        CHECK(r.loop->idle_invariants_hold());
        throw_in = "truncate";
        recs = r.send_all({gen(4, "anonymous two")});  // shares "anonymous " with slot 1: trimmed
        CHECK_EQ(terminal(recs, 4)["code"], "engine_error");
        CHECK_EQ(tables(*r.loop, sids), before);
        CHECK_EQ(r.loop->slots().busy_count(), size_t(0));
        CHECK(r.loop->idle_invariants_hold());
        throw_in.clear();
        recs = r.send_all({gen(5, "anonymous two")});
        CHECK_EQ(text_of(recs, 5), std::string("anonymous two"));
        recs = r.send_all({gen(6, "new", R"(,"session_id":"b")")});
        CHECK_EQ(text_of(recs, 6), std::string("new"));
        CHECK(r.loop->idle_invariants_hold());
    }
    {   // a failing item in a batched step: four prompts prefill in one step; the third holds
        // the poison token, so that step fails (after the fake appended the first two items:
        // a partly applied call). Only generation 3 fails; the others' text is that of a solo
        // run, and (echo mode) their slots hold exactly prompt + output: nothing was appended
        // twice by the retry.
        FakeConfig cfg;
        cfg.poison_token = '#';
        cfg.record_steps = true;
        const std::vector<std::string> prompts{"first prompt", "second one", "poi#soned", "fourth and last"};
        std::vector<std::string> solo;
        for (const auto& p : prompts) {
            if (p.find('#') != std::string::npos) { solo.push_back(""); continue; }
            Rig s(cfg);
            solo.push_back(text_of(s.send_all({gen(1, p)}), 1));
            CHECK_EQ(solo.back(), p);
        }
        Rig r(cfg);
        std::vector<std::string> lines;
        for (size_t i = 0; i < prompts.size(); ++i) lines.push_back(gen(i + 1, prompts[i]));
        auto recs = r.send_all(lines);
        for (uint64_t id = 1; id <= 4; ++id) {
            if (id == 3) continue;
            CHECK_EQ(text_of(recs, id), solo[id - 1]);
            CHECK_EQ(terminal(recs, id)["type"], "done");
            const int32_t slot = static_cast<int32_t>(id - 1);
            CHECK_EQ(r.engine.slot_tokens(slot).size(), 2 * prompts[id - 1].size());
        }
        CHECK_EQ(terminal(recs, 3)["type"], "error");
        CHECK_EQ(terminal(recs, 3)["code"], "engine_error");
        CHECK(text_of(recs, 3).empty());
        CHECK(r.loop->slots().at(2).dirty);
        size_t failed = 0;
        for (auto& st : r.engine.step_log()) failed += st.failed;
        CHECK(failed >= 2);  // the whole step, then the half and the item alone
        CHECK(r.loop->idle_invariants_hold());
    }
    {   // the poison in a generation's output: it fails mid-decode (after its tokens so far);
        // the generations decoding in the same steps keep their solo text
        FakeConfig cfg;
        cfg.poison_token = '#';
        cfg.script = {"alpha beta gamma", "de#lta", "epsilon zeta"};
        std::vector<std::string> solo;
        {
            Rig s(cfg);
            for (uint64_t id = 1; id <= 3; ++id) solo.push_back(text_of(s.send_all({gen(id, "p")}), id));
        }
        CHECK_EQ(solo[0], cfg.script[0]);
        Rig r(cfg);
        auto recs = r.send_all({gen(1, "p"), gen(2, "p"), gen(3, "p")});
        CHECK_EQ(text_of(recs, 1), solo[0]);
        CHECK_EQ(text_of(recs, 3), solo[2]);
        // "#" is emitted when sampled; appending it in the next step is what fails
        CHECK_EQ(text_of(recs, 2), std::string("de#"));
        CHECK_EQ(terminal(recs, 2)["code"], "engine_error");
        CHECK_EQ(terminal(recs, 1)["type"], "done");
        CHECK_EQ(terminal(recs, 3)["type"], "done");
        CHECK(r.loop->idle_invariants_hold());
    }
    {   // a cancel mid-prefill while another generation decodes: a client churns connections
        // (a generate with a long prompt, cancelled while its chunk is in the step, then the
        // next). Each cancel aborts the running engine step, which is redone at once without
        // the cancelled prompt, so generation 1 gets exactly one token in every step() call
        // (no step without its token), and no aborted engine step is followed by another
        // before its decode goes through. The churned generations leave nothing resident.
        FakeConfig cfg;
        cfg.script = {std::string(30, 's'), "never", "never", "never", "never", "never", "never", "never", "never"};
        cfg.record_steps = true;
        CancelController* ctl = nullptr;
        const WorkerLoop* lp = nullptr;
        cfg.on_step = [&](const FakeStepRecord& rec) {
            for (auto& it : rec.items)  // as the watcher thread would, while the step runs
                if (it.prefill && it.slot != 0) ctl->on_frame(lp->slots().at(it.slot).busy);
        };
        Rig r(cfg);
        ctl = &r.cancel;
        lp = r.loop.get();
        r.loop->handle_line(gen(1, "abc"));
        r.loop->step();  // prompt in, first token
        size_t from = r.sink.data.size();
        int churned = 0;
        for (uint64_t id = 2; id <= 9; ++id) {
            r.loop->handle_line(gen(id, std::string(300, 'c')));
            r.loop->step();
            auto recs = parse(r.sink.data, from);
            from = r.sink.data.size();
            CHECK_EQ(text_of(recs, 1).size(), size_t(1));  // this step's token of generation 1
            json t = terminal(recs, id);
            CHECK_EQ(t["type"], "done");
            CHECK_EQ(t["cancelled"], true);
            CHECK_EQ(t["completion_tokens"], 0);
            churned += t["cancelled"] == true;
        }
        CHECK_EQ(churned, 8);
        r.send_all({});
        CHECK_EQ(text_of(parse(r.sink.data), 1), std::string(30, 's'));
        const auto& log = r.engine.step_log();
        size_t aborted = 0, run = 0;
        for (auto& st : log) {
            if (st.aborted) { ++aborted; CHECK(++run <= 1); } else run = 0;  // never two aborts in a row
        }
        CHECK_EQ(aborted, size_t(8));
        for (int32_t s = 1; s < 4; ++s) CHECK(r.engine.slot_tokens(s).empty());  // nothing of theirs stayed
        CHECK_EQ(r.engine.slot_tokens(0).size(), size_t(3 + 30));
        CHECK(r.loop->idle_invariants_hold());
    }
    return trioserve_test::finish("test_worker_lifetime");
}
