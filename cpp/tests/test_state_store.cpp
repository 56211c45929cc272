// test_state_store.cpp — the persistent state store alone (state_store.h, spec §6.4): a state
// written by one store is found by content by another on the same directory, the choice of
// the longest usable prefix, a damaged or foreign file never loaded, session removal with its
// branches, the byte bound.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "state_store.h"

using namespace trioserve;

namespace {

std::string temp_dir() {
    char tmpl[] = "/tmp/test_state_store.XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    return d ? std::string(d) + "/states" : std::string();
}

std::vector<TokenId> ids(size_t n, TokenId base) {
    std::vector<TokenId> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = base + static_cast<TokenId>(i);
    return v;
}

std::vector<uint8_t> body_of(size_t n, uint8_t seed) {
    std::vector<uint8_t> b(n);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 7);
    return b;
}

}  // namespace

int main() {
    // The checksum is the one trioserve/worker/state_files.py recomputes: values it gives.
    const uint8_t abc[] = {'a', 'b', 'c'};
    CHECK(state_hash(abc, 3) == 0xf32b9f58e4f77bd8ull);
    const std::string words = "0123456789abcdefXYZ";  // two 8-byte words and a tail
    CHECK(state_hash(reinterpret_cast<const uint8_t*>(words.data()), words.size(), 5) == 0x148d580644d6644bull);
    CHECK(state_hash(abc, 3) != state_hash(abc, 2));
    CHECK(state_hash(abc, 3, 1) != state_hash(abc, 3));

    const std::string dir = temp_dir();
    CHECK(!dir.empty());
    const std::vector<TokenId> a = ids(100, 1), b = ids(60, 1);
    {
        StateStore store(dir, 1 << 20, "model-1");
        CHECK(store.enabled());
        struct stat st {};
        CHECK(::stat(dir.c_str(), &st) == 0 && (st.st_mode & 0777) == 0700);
        CHECK(store.offer("s", a, body_of(1000, 1)));
        store.flush();
        CHECK(store.has("s", a));
        CHECK(!store.has("", a));
        CHECK_EQ(store.stats()["writes"].get<uint64_t>(), uint64_t(1));
    }  // destructor: the writer is joined

    {
        StateStore store(dir, 1 << 20, "model-1");
        CHECK_EQ(store.stats()["files"].get<uint64_t>(), uint64_t(1));
        std::vector<TokenId> prompt = a;
        prompt.push_back(7777);
        StoredState e;
        CHECK_EQ(store.best(prompt, 1, true, e), size_t(100));
        CHECK(e.session == "s" && e.tokens == a);
        std::vector<uint8_t> body;
        CHECK(store.load(e, body));
        CHECK(body == body_of(1000, 1));
        // A prompt that diverges inside the state: trimmed use only when the engine can trim.
        std::vector<TokenId> diverged = b;
        diverged.push_back(-5);
        CHECK_EQ(store.best(diverged, 1, true, e), size_t(60));
        CHECK_EQ(store.best(diverged, 1, false, e), size_t(0));
        CHECK_EQ(store.best(diverged, 61, true, e), size_t(0));  // below the floor
        // An anonymous state: a strict prefix of it is replaced; another session is kept.
        CHECK(store.offer("", b, body_of(10, 2)));
        store.flush();
        CHECK(store.offer("", a, body_of(10, 3)));
        store.flush();
        CHECK(!store.has("", b) && store.has("", a) && store.has("s", a));
        // A branch of "s" (the control plane's "s" + U+001F + label) goes with it.
        CHECK(store.offer(std::string("s\x1f") + "b2", ids(30, 9), body_of(10, 4)));
        store.flush();
        CHECK_EQ(store.erase_session("s"), size_t(2));
        CHECK(!store.has("s", a) && store.has("", a));
    }

    {
        // Another model's store sees nothing; its own file is left alone.
        StateStore other(dir, 1 << 20, "model-2");
        CHECK_EQ(other.stats()["files"].get<uint64_t>(), uint64_t(0));
        StoredState e;
        CHECK_EQ(other.best(a, 1, true, e), size_t(0));
    }

    {
        // A corrupt body of this model is found at load, refused and removed.
        StateStore store(dir, 1 << 20, "model-1");
        StoredState e;
        std::vector<TokenId> prompt = a;
        prompt.push_back(1);
        CHECK_EQ(store.best(prompt, 1, true, e), size_t(100));
        const std::string path = dir + "/" + e.file;
        {
            std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
            f.seekp(-1, std::ios::end);
            f.put('\x55');
        }
        std::vector<uint8_t> body;
        CHECK(!store.load(e, body));
        CHECK(::access(path.c_str(), F_OK) != 0);
        CHECK_EQ(store.stats()["load_failures"].get<uint64_t>(), uint64_t(1));
        CHECK_EQ(store.best(prompt, 1, true, e), size_t(0));
    }

    {
        // The bound: least recently used first.
        StateStore store(dir, 5000, "model-1");
        CHECK(store.offer("x", ids(50, 100), body_of(2000, 5)));
        store.flush();
        ::usleep(20000);  // distinct mtimes
        CHECK(store.offer("y", ids(50, 200), body_of(2000, 6)));
        store.flush();
        CHECK(store.has("x", ids(50, 100)) && store.has("y", ids(50, 200)));
        ::usleep(20000);
        CHECK(store.offer("z", ids(50, 300), body_of(2000, 7)));
        store.flush();
        CHECK(!store.has("x", ids(50, 100)));
        CHECK(store.has("y", ids(50, 200)) && store.has("z", ids(50, 300)));
        CHECK(store.stats()["dir_bytes"].get<uint64_t>() <= 5000);
    }

    {
        // Off: no directory touched, nothing offered.
        StateStore off("", 1 << 20, "model-1");
        CHECK(!off.enabled() && !off.room() && !off.offer("s", a, body_of(10, 1)));
        CHECK(off.ready().is_null());
    }
    return trioserve_test::finish("test_state_store");
}
