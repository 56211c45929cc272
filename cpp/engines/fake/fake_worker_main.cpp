// trioserve-fake-worker: a deterministic worker for tests; the same worker loop (cpp/loop/) as the real
// one, over FakeEngine (spec §11). Flags: --help.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "engines/fake/fake_engine.h"
#include "swa_cache.h"
#include "cli_args.h"
#include "loop/worker_loop.h"
#include "worker_flags.h"
#include "worker_process.h"

using namespace trioserve;

static const char* kHelp = R"(usage: trioserve-fake-worker [flags]

A deterministic trioserve worker (protocol: spec/worker-protocol.md) for tests.
Tokenizer: one token per UTF-8 byte (id = byte value), id 256 = EOS.
Output: the k-th admitted generation (arrival order) emits script[k % len] byte by byte,
then EOS; without --script it echoes the last 64 bytes of its prompt, then EOS. Several
generations run at once (up to --capacity), each with exactly its solo output.

  --script FILE              JSON array of strings, one per generation, cycling
  --ctx N                    context window per slot in tokens (default and 0: 4096, the
                             fake's "training context")
  --capacity N               slots = generations at once; named sessions bind at most
                             N-1 of them (default 4)
  --spill-budget-bytes N host memory for the states of evicted named sessions (default
                        1 GiB; 0 = drop evicted sessions)
  --min-shared-prefix N      start a prompt from another slot's or a spilled session's
                             state when that holds at least N more of its prefix than
                             its own slot (default 16; 0 = never share across slots)
  --recurrent                model a hybrid recurrent state: slots cannot be cut back to
                             a shorter prefix (truncation unsupported), so states are
                             shared only whole; a checkpoint of the recurrent state at
                             each prompt's end brings a slot back there (spec §6.3)
  --swa N                    model a sliding-window model with an N-token window
                             (spec §6.3): with the small window cache a slot holds only
                             its last N positions after each step, so it can be cut back
                             only that far; older positions come back from checkpoints
  --swa-cache MODE           full | checkpoints | auto (default auto: full unless
                             --kv-budget-bytes is below the full-size cache, 4 bytes a
                             token per slot)
  --checkpoints N            checkpoints kept per slot with the small window cache or
                             --recurrent (default 4; 0 = none); --swa-checkpoints N is
                             the same flag
  --kv-budget-bytes N        the budget --swa-cache auto compares with (default 0 = none)
  --kv-cache-type T          f16 (default) | q8_0 | q4_0: scales the reported kv_cache_bytes
                             by 17/32 or 9/32, as llama.cpp's block sizes would
  --echo-digest              echo mode: prefix the output with a digest of the slot's
                             whole state (tests of shared-prefix isolation)
  --batch-tokens N           per-step token budget: decodes first, then prefill chunks
                             FIFO (default 512)
  --chat-template FILE       chat template reported in the ready record (default: ChatML)
  --no-chat-template         report no chat template (chat_template: null), like a GGUF
                             without one
  --fim-tokens               add fill-in-the-middle tokens: ids 257, 258, 259 (prefix,
                             suffix, middle; n_vocab 260), reported in the ready record
  --prefill-chunk N          largest prefill chunk of one generation per step (default 512)
  --step-target-ms MS        pace steps that carry decodes to about MS (default 0 = off)
  --heartbeat-ms MS          while one step has run MS, write a progress record every MS
                             (spec section 4.4; default 0 = none)
  --stream-interval-ms MS    write token records together at most every MS (a generation's
                             first at once; spec section 4.1; default 0 = each at once)
  --max-step-ms MS           shrink the prompt tokens per step (--batch-tokens >> k, at
                             least 64) while a step carrying prefill takes longer than MS;
                             grow them back when steps are fast (default 0 = fixed pieces)
  --token-delay-ms MS        period of the steps that sample tokens, once however many
                             streams are decoding: they end on a grid MS apart, the loop's
                             work between steps absorbed (default 0)
  --prefill-ms-per-token MS  sleep per prompt token in a step; a cancel of a generation
                             prefilling in that step interrupts it (default 0)
  --tokenize-us-per-byte US  sleep per text byte tokenized (a real tokenizer's cost); the
                             tokenize op's (call thread) can be cancelled between 10 ms slices
  --slow-start-ms MS         sleep before writing the ready record
  --grammar-unenforced       report grammar support but ignore grammars (the script is the
                             output): for tests of the constrained request paths
  --slow-grammar-ms MS       with --grammar-unenforced: every token of a generation that has
                             a grammar is a slow "masked sample" of MS ms, run on the
                             worker's sampler thread while the others keep stepping
  --no-cancel                ignore TRIOSERVE_CANCEL_FD; advertise supports_cancel: false
  --speculative MODE         auto | off (default off): self-speculative drafts from the
                             request's tokens and the global index (spec §4.4); the fake's
                             step cost model is flat, so auto drafts whenever a draft exists
  --draft-max N              most draft tokens of one generation per step (default 12)
  --global-draft-tokens N    ids the global draft index keeps (default 262144; 0 = none)
  --log-drafts               the chosen draft lengths to stderr
  --measure-step-cost        measure the step costs at start also with speculation off
  --dist SPEC                known probabilities instead of a script, e.g. "a:0.5,b:0.3":
                             every output byte drawn independently with the request's seed
  --dist-tokens N            bytes a --dist generation emits before EOS (default 64)
  --no-speculation           report supports_speculation false
fault injection (token counts are over the process life and all concurrent generations,
EOS excluded):
  --exit-after-tokens N      when asked for token N+1, exit abruptly with status 77
  --hang-after-tokens N      when asked for token N+1, hang forever: ignore cancel frames,
                             stdin EOF and cancel-pipe EOF; SIGTERM still kills it (default
                             disposition) unless --ignore-sigterm; SIGKILL always does
  --signal-after-tokens N    when asked for token N+1, die by the signal of --crash-signal
                             (a CPU kernel fault: the process ends by that signal, no exit)
  --crash-signal NAME        sigill (default), sigsegv, sigbus or sigabrt
  --ignore-sigterm           ignore SIGTERM for the whole process life
  --poison-token N           a step holding token id N (a prompt byte, or a byte of a
                             scripted output) fails with engine_error; only the generation
                             whose item holds it fails (the step is retried without it)
  --stuck-token N            a step holding token id N makes no progress and never returns
                             (its work counter stands still; cancels, stdin EOF and
                             cancel-pipe EOF are ignored; SIGTERM kills it unless
                             --ignore-sigterm): a kernel that stopped
  --garbage-line             write one non-JSON line on stdout at the start of the next
                             generate (once)
  --help                     this text
)";

static std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) Args::fail("cannot read " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

int main(int argc, char** argv) {
    FakeConfig cfg;
    WorkerFlags flags;  // the flags every worker takes (worker_flags.h)
    long long v = 0;
    double slow_start_d = 0;
    bool no_cancel = false, ignore_sigterm = false, garbage = false;
    std::string s;
    long long kv_budget = 0;
    Args a(argc, argv);
    while (!a.done()) {
        if (a.flag("--help") || a.flag("-h")) { std::fputs(kHelp, stdout); return 0; }
        else if (flags.parse(a, kAllWorkerFlags)) {}
        else if (a.value("--script", s)) {
            auto j = nlohmann::json::parse(read_file(s), nullptr, false);
            if (!j.is_array() || j.empty()) Args::fail("--script must hold a non-empty JSON array of strings");
            for (auto& x : j) {
                if (!x.is_string()) Args::fail("--script must hold a non-empty JSON array of strings");
                cfg.script.push_back(x.get<std::string>());
            }
        }
        else if (a.value("--chat-template", s)) cfg.chat_template = read_file(s);
        else if (a.flag("--no-chat-template")) cfg.no_chat_template = true;
        else if (a.flag("--fim-tokens")) cfg.fim_tokens = true;
        else if (a.flag("--grammar-unenforced")) cfg.grammar_unenforced = true;
        else if (a.flag("--recurrent")) cfg.recurrent = true;
        else if (a.flag("--echo-digest")) cfg.echo_digest = true;
        else if (a.int_value("--swa", v, 0)) cfg.swa = v;
        else if (a.int_value("--kv-budget-bytes", kv_budget, 0)) {}
        else if (a.double_value("--token-delay-ms", cfg.token_delay_ms)) {}
        else if (a.double_value("--prefill-ms-per-token", cfg.prefill_ms_per_token)) {}
        else if (a.double_value("--tokenize-us-per-byte", cfg.tokenize_us_per_byte)) {}
        else if (a.double_value("--slow-grammar-ms", cfg.slow_grammar_ms)) {}
        else if (a.double_value("--slow-start-ms", slow_start_d)) {}
        else if (a.int_value("--exit-after-tokens", v, 0)) cfg.exit_after_tokens = v;
        else if (a.int_value("--hang-after-tokens", v, 0)) cfg.hang_after_tokens = v;
        else if (a.int_value("--signal-after-tokens", v, 0)) cfg.signal_after_tokens = v;
        else if (a.value("--crash-signal", s)) {
            if (s == "sigill") cfg.crash_signal = SIGILL;
            else if (s == "sigsegv") cfg.crash_signal = SIGSEGV;
            else if (s == "sigbus") cfg.crash_signal = SIGBUS;
            else if (s == "sigabrt") cfg.crash_signal = SIGABRT;
            else Args::fail("--crash-signal must be sigill, sigsegv, sigbus or sigabrt");
        }
        else if (a.int_value("--poison-token", v, 0)) cfg.poison_token = v;
        else if (a.int_value("--stuck-token", v, 0)) cfg.stuck_token = v;
        else if (a.flag("--no-cancel")) no_cancel = true;
        else if (a.flag("--no-speculation")) cfg.speculation = false;
        else if (a.int_value("--dist-tokens", v, 0)) cfg.dist_tokens = v;
        else if (a.value("--dist", s)) {
            // "a:0.5,b:0.3": byte ':' probability, comma-separated
            size_t at = 0;
            while (at < s.size()) {
                size_t end = s.find(',', at);
                if (end == std::string::npos) end = s.size();
                const std::string part = s.substr(at, end - at);
                if (part.size() < 3 || part[1] != ':') Args::fail("--dist entries are BYTE:PROB");
                char* e = nullptr;
                const double p = std::strtod(part.c_str() + 2, &e);
                if (*e != '\0' || !(p > 0)) Args::fail("--dist probabilities must be numbers > 0");
                cfg.dist.emplace_back(part[0], p);
                at = end + 1;
            }
        }
        else if (a.flag("--ignore-sigterm")) ignore_sigterm = true;
        else if (a.flag("--garbage-line")) garbage = true;
        else Args::fail("unknown flag " + a.peek());
    }
    setup_process(ignore_sigterm);
    const int cancel_fd = take_cancel_fd(!no_cancel);
    if (slow_start_d > 0)
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(slow_start_d));

    if (flags.ctx) cfg.n_ctx = *flags.ctx > 0 ? *flags.ctx : 4096;  // 0: the fake's "training context"
    if (flags.capacity) cfg.capacity = *flags.capacity;
    cfg.kv_cache_type = flags.kv_cache_type;
    cfg.swa_full = keep_full_swa_cache(flags.swa_cache, static_cast<uint64_t>(cfg.n_ctx * cfg.capacity) * 4,
                                       static_cast<uint64_t>(kv_budget));
    FakeEngine engine(cfg);
    CancelController cancel;
    FdSink sink(1);
    WorkerOptions opts;
    flags.apply(opts);
    // A state store drains its writes when stdin closes (worker_process.h, spec §6.4).
    if (!opts.state_dir.empty()) g_exit_grace_ms.store(10000);
    opts.prefill_chunk = static_cast<size_t>(flags.prefill_chunk.value_or(512));
    opts.batch_tokens = static_cast<size_t>(flags.batch_tokens.value_or(512));
    opts.step_target_ms = flags.step_target_ms.value_or(0);
    opts.supports_cancel = cancel_fd >= 0;
    // Flat: a fake step costs its delay however many tokens it carries (deterministic tests).
    opts.step_cost = {{1, 1.0}, {4096, 1.0}};
    WorkerHooks hooks;
    if (garbage) {
        hooks.on_generate_start = [garbage_left = true](uint64_t, RecordSink& out) mutable {
            if (!garbage_left) return;
            garbage_left = false;
            out.write("this is not JSON {\n");
        };
    }
    WorkerLoop loop(engine, cancel, sink, opts, std::move(hooks));
    // Declared after the loop: destroyed (thread joined) before it, so no frame can arrive
    // while the loop goes away (cancel_controller.h keeps the flags alive regardless).
    ProcessWatcher watcher(cancel, cancel_fd);
    loop.calibrate_speculation();
    loop.write_ready();
    return loop.run(0);
}
