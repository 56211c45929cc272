// state_store.h — the persistent state store: saved slot states as files in a directory, the
// tier below host memory (spill), so a session or a shared prefix survives a worker restart,
// a crash and a move to another replica (spec/worker-protocol.md §6.4).
//
// Files. One file per saved state, named `<fp>-<key>.tss`: `fp` the hash of the engine's
// state fingerprint (Engine::state_fingerprint(): model file identity, engine, KV type,
// context — whatever changes the bits of a state), `key` the hash of the token ids it holds
// (and of the session key, when a named session's). The file is a header — magic, format
// version, fingerprint, session key, token ids, body length, body checksum, header checksum —
// then the body (Engine::save_state() bytes). Mode 0600. Written atomically: a temp file
// `.tmp-<pid>-<n>` in the same directory, fsync, rename, fsync of the directory; a reader
// never sees half a file, and two writers of one key (two replicas) both leave a whole file.
//
// Index. The headers (not the bodies) of every `*.tss` regular file whose fingerprint is this
// engine's are kept in memory: at start and whenever the directory's mtime changed (a file
// added or removed by this worker or another process sharing the directory), checked before
// each lookup. A file that is not a regular file (a symlink), whose header does not parse,
// whose format version is not this one, whose fingerprint is another's, or whose size is not
// the header's is skipped (logged once per file) and never loaded. A body whose checksum does
// not match at load is logged, its file removed (the header says it is this model's), and the
// request is served cold. Nothing in a request names a path: only this directory's own
// `*.tss` files are ever opened.
//
// Writes run on one writer thread (owned here, joined by the destructor after it finished the
// queued writes: stdin EOF drains them), never on the step path; the loop hands it a saved
// state (offer()) and goes on. The queue holds at most kMaxQueued states; a state offered
// while it is full is not written (counted in `writes_skipped`; the next idle moment offers
// the slot again). A failed write (full disk, read-only or vanished directory, a file size
// limit) removes the temp file, is logged and counted in `write_failures`; the worker serves
// on; a directory removed meanwhile is created again by the next write. After each write the
// directory is brought within its byte bound, least recently used
// first (file mtime: a load touches it), counting every `*.tss` file in it whatever its model.
//
// Thread-safety: the index and counters are under mu_; the loop thread calls every public
// method; the writer thread runs write_one() and bound(). No method throws except bad_alloc.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "engine.h"
#include "stable_hash.h"

namespace trioserve {

/// One stored state as the index knows it (its header).
struct StoredState {
    std::string file;              ///< name in the directory
    std::string session;           ///< "" for an anonymous prefix
    std::vector<TokenId> tokens;   ///< the ids the state holds
    uint64_t body_bytes = 0, body_hash = 0, file_bytes = 0;
    int64_t mtime_ns = 0;
};

class StateStore {
public:
    static constexpr uint32_t kVersion = 1;
    static constexpr char kMagic[8] = {'T', 'R', 'I', 'O', 'S', 'T', 'A', 'T'};
    static constexpr size_t kMaxQueued = 2;
    /// A temp file older than this is a crashed writer's: removed by the bound pass.
    static constexpr int64_t kStaleTempNs = int64_t(600) * 1000000000;

    /// Off (enabled() false) when `dir` or `fingerprint` is empty. Otherwise creates `dir`
    /// (mode 0700) when missing, indexes it and starts the writer thread; a directory that
    /// cannot be created or read is logged and stays empty (writes then fail and are
    /// counted). Ignores SIGXFSZ so a file size limit is a failed write, not a dead worker.
    /// `trimmable`: the engine's states can be cut back to any prefix, so a longer anonymous
    /// state also serves its prefixes and replaces them; otherwise (recurrent, hybrid) each
    /// prefix state is kept (the checkpoint positions, spec §6.4).
    StateStore(std::string dir, uint64_t bound_bytes, std::string fingerprint, bool trimmable = true)
        : dir_(std::move(dir)), bound_(bound_bytes), fingerprint_(std::move(fingerprint)), trimmable_(trimmable) {
        if (!enabled()) return;
        ::signal(SIGXFSZ, SIG_IGN);
        char buf[17];
        std::snprintf(buf, sizeof buf, "%016llx",
                      static_cast<unsigned long long>(state_hash(reinterpret_cast<const uint8_t*>(fingerprint_.data()),
                                                                 fingerprint_.size())));
        fp_hex_ = buf;
        if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST)
            std::fprintf(stderr, "trioserve-worker: state dir %s cannot be created (%s); serving without it\n",
                         dir_.c_str(), std::strerror(errno));
        refresh();
        bound();  // dir_bytes_, and a bound lowered since the last run
        writer_ = std::thread([this] { write_loop(); });
    }

    /// Finishes the queued writes, then joins the writer.
    ~StateStore() {
        if (!writer_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_ = true;
        }
        cv_.notify_all();
        writer_.join();
    }
    StateStore(const StateStore&) = delete;
    StateStore& operator=(const StateStore&) = delete;

    bool enabled() const { return !dir_.empty() && !fingerprint_.empty(); }

    /// Re-reads the directory when its mtime changed since the last look (or `force`): new
    /// files' headers are indexed, vanished files dropped. A directory that vanished empties
    /// the index. Loop thread.
    void refresh(bool force = false) {
        if (!enabled()) return;
        struct stat st {};
        if (::stat(dir_.c_str(), &st) != 0) {
            std::lock_guard<std::mutex> lock(mu_);
            if (!index_.empty() || dir_seen_)
                std::fprintf(stderr, "trioserve-worker: state dir %s is unreadable (%s)\n", dir_.c_str(),
                             std::strerror(errno));
            index_.clear();
            dir_seen_ = false;
            dir_mtime_ns_ = -1;
            return;
        }
        const int64_t m = mtime_ns(st);
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (!force && dir_seen_ && m == dir_mtime_ns_) return;
        }
        scan_index(m);
    }

    /// The indexed state (not `exclude`d) that provides the most of `prompt`: its common prefix
    /// with the prompt, capped at prompt.size() - 1, at least `floor`; a state that cannot be
    /// cut back (`trimmable` false) only when all of it is a prefix. Returns the tokens it
    /// provides (0: none) and sets `out` to a copy of its header.
    size_t best(const std::vector<TokenId>& prompt, size_t floor, bool trimmable, StoredState& out) {
        std::lock_guard<std::mutex> lock(mu_);
        size_t best_keep = 0;
        for (const auto& [name, e] : index_) {
            size_t k = common_prefix_of(e.tokens, prompt);
            if (!prompt.empty() && k >= prompt.size()) k = prompt.size() - 1;
            if (k < floor || k <= best_keep) continue;
            if (k < e.tokens.size() && !trimmable) continue;
            best_keep = k;
            out = e;
        }
        return best_keep;
    }

    /// The file name a state of `session` holding `tokens` is stored under (its identity).
    std::string key_of(const std::string& session, const std::vector<TokenId>& tokens) const {
        return file_name(session, tokens);
    }

    /// Whether a state of `session` holding exactly `tokens` is stored already.
    bool has(const std::string& session, const std::vector<TokenId>& tokens) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = index_.find(file_name(session, tokens));
        return it != index_.end() && it->second.tokens == tokens && it->second.session == session;
    }

    /// Reads `e`'s body into `body` and checks it against the header (fingerprint, ids,
    /// checksum). False (logged; a corrupt file of this model is removed) when it cannot be
    /// used: the caller serves the request cold. On success the file's mtime is set to now
    /// (least recently used order). Loop thread.
    bool load(const StoredState& e, std::vector<uint8_t>& body) {
        std::string why;
        bool remove = false;
        if (read_checked(e, body, why, remove)) {
            struct timespec now[2] = {{0, UTIME_NOW}, {0, UTIME_NOW}};
            ::utimensat(AT_FDCWD, path(e.file).c_str(), now, AT_SYMLINK_NOFOLLOW);
            std::lock_guard<std::mutex> lock(mu_);
            ++hits_;
            return true;
        }
        std::fprintf(stderr, "trioserve-worker: stored state %s not used (%s); prefilling instead\n", e.file.c_str(),
                     why.c_str());
        if (remove) ::unlink(path(e.file).c_str());
        std::lock_guard<std::mutex> lock(mu_);
        ++load_failures_;
        index_.erase(e.file);
        skipped_.insert(e.file);
        return false;
    }

    /// Whether offer() would take a state now (save one only then).
    bool room() {
        std::lock_guard<std::mutex> lock(mu_);
        return enabled() && queue_.size() < kMaxQueued;
    }

    /// Queues a state for writing. False when the queue is full (not written; counted).
    bool offer(std::string session, std::vector<TokenId> tokens, std::vector<uint8_t> body) {
        if (!enabled()) return false;
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (queue_.size() >= kMaxQueued) {
                ++writes_skipped_;
                return false;
            }
            queue_.push_back(Job{std::move(session), std::move(tokens), std::move(body)});
        }
        cv_.notify_all();
        return true;
    }

    /// Removes every stored state of `session` and of its branches (`session` + U+001F +
    /// label: the control plane's worker session names for one key, spec/README.md §12), files
    /// too. Returns how many. Loop thread.
    size_t erase_session(const std::string& session) {
        if (!enabled() || session.empty()) return 0;
        refresh(true);
        std::lock_guard<std::mutex> lock(mu_);
        size_t n = 0;
        for (auto it = index_.begin(); it != index_.end();) {
            const std::string& o = it->second.session;
            if (o == session || (o.size() > session.size() && o.compare(0, session.size(), session) == 0 &&
                                 o[session.size()] == '\x1f')) {
                ::unlink(path(it->first).c_str());
                it = index_.erase(it);
                ++n;
            } else {
                ++it;
            }
        }
        return n;
    }

    /// Counters for the ready and done records (spec §4.2, §6.4).
    nlohmann::json stats() {
        std::lock_guard<std::mutex> lock(mu_);
        uint64_t bytes = 0;
        for (const auto& [name, e] : index_) bytes += e.file_bytes;
        return nlohmann::json{{"files", index_.size()}, {"bytes", bytes}, {"dir_bytes", dir_bytes_},
                              {"hits", hits_}, {"load_failures", load_failures_}, {"writes", writes_},
                              {"write_failures", write_failures_}, {"writes_skipped", writes_skipped_},
                              {"skipped_files", skipped_.size()}};
    }

    /// The ready record's `state_store` field (spec §3): null when off.
    nlohmann::json ready() {
        if (!enabled()) return nullptr;
        nlohmann::json j = stats();
        j["dir"] = dir_;
        j["bound_bytes"] = bound_;
        j["format_version"] = kVersion;
        return j;
    }

    /// Blocks until the writer has nothing queued or running (tests, drain). No deadline of its
    /// own: a write is bounded by its size, and a process whose stdin closed is ended by the
    /// watcher thread once its grace is up (worker_process.h g_exit_grace_ms).
    void flush() {
        std::unique_lock<std::mutex> lock(mu_);
        idle_cv_.wait(lock, [this] { return queue_.empty() && !writing_; });
    }

private:
    struct Job {
        std::string session;
        std::vector<TokenId> tokens;
        std::vector<uint8_t> body;
    };

    static int64_t mtime_ns(const struct stat& st) {
        return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    }
    static size_t common_prefix_of(const std::vector<TokenId>& a, const std::vector<TokenId>& b) {
        const size_t lim = std::min(a.size(), b.size());
        size_t k = 0;
        while (k < lim && a[k] == b[k]) ++k;
        return k;
    }
    std::string path(const std::string& name) const { return dir_ + "/" + name; }

    std::string file_name(const std::string& session, const std::vector<TokenId>& tokens) const {
        uint64_t h = state_hash(reinterpret_cast<const uint8_t*>(tokens.data()), tokens.size() * sizeof(TokenId));
        if (!session.empty())
            h ^= state_hash(reinterpret_cast<const uint8_t*>(session.data()), session.size(), 0x5e55) * 3;
        char buf[17];
        std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
        return fp_hex_ + "-" + buf + ".tss";
    }

    static void put_u32(std::vector<uint8_t>& o, uint32_t v) {
        for (int b = 0; b < 4; ++b) o.push_back(static_cast<uint8_t>(v >> (8 * b)));
    }
    static void put_u64(std::vector<uint8_t>& o, uint64_t v) {
        for (int b = 0; b < 8; ++b) o.push_back(static_cast<uint8_t>(v >> (8 * b)));
    }

    /// The header of a state file (everything before the body).
    std::vector<uint8_t> header(const std::string& session, const std::vector<TokenId>& tokens,
                                const std::vector<uint8_t>& body) const {
        std::vector<uint8_t> h(kMagic, kMagic + 8);
        put_u32(h, kVersion);
        put_u32(h, static_cast<uint32_t>(fingerprint_.size()));
        h.insert(h.end(), fingerprint_.begin(), fingerprint_.end());
        put_u32(h, static_cast<uint32_t>(session.size()));
        h.insert(h.end(), session.begin(), session.end());
        put_u32(h, static_cast<uint32_t>(tokens.size()));
        for (TokenId t : tokens) put_u32(h, static_cast<uint32_t>(t));
        put_u64(h, body.size());
        put_u64(h, state_hash(body.data(), body.size()));
        put_u64(h, state_hash(h.data(), h.size()));
        return h;
    }

    /// Bounded reader of a header held in memory.
    struct Cursor {
        const std::vector<uint8_t>& b;
        size_t at = 0;
        bool ok = true;
        uint64_t u(int bytes) {
            if (!ok || b.size() - at < static_cast<size_t>(bytes)) { ok = false; return 0; }
            uint64_t v = 0;
            for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(b[at + i]) << (8 * i);
            at += static_cast<size_t>(bytes);
            return v;
        }
        std::string str(uint64_t n) {
            if (!ok || b.size() - at < n) { ok = false; return {}; }
            std::string s(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
            at += n;
            return s;
        }
    };

    /// Reads and checks the header of the open file `fd` (size `size`). Empty `why` when it
    /// is this model's, and `e` filled.
    bool read_header(int fd, uint64_t size, StoredState& e, std::string& why) const {
        // magic 8 + version 4 + fp len 4: then the fingerprint, session, ids (bounded by size).
        std::vector<uint8_t> b;
        auto grow = [&](size_t n) {
            if (n > size) return false;
            const size_t old = b.size();
            if (n <= old) return true;
            b.resize(n);
            return ::pread(fd, b.data() + old, n - old, static_cast<off_t>(old)) == static_cast<ssize_t>(n - old);
        };
        if (!grow(16)) { why = "too short for a header"; return false; }
        if (std::memcmp(b.data(), kMagic, 8) != 0) { why = "not a state file"; return false; }
        Cursor c{b, 8};
        const uint64_t version = c.u(4);
        if (version != kVersion) { why = "format version " + std::to_string(version); return false; }
        const uint64_t fp_len = c.u(4);
        if (!grow(16 + fp_len + 4)) { why = "truncated header"; return false; }
        if (c.str(fp_len) != fingerprint_) { why = "another model's state"; return false; }
        const uint64_t s_len = c.u(4);
        if (!grow(c.at + s_len + 4)) { why = "truncated header"; return false; }
        e.session = c.str(s_len);
        const uint64_t n_tok = c.u(4);
        if (n_tok > (size - c.at) / 4 || !grow(c.at + n_tok * 4 + 24)) { why = "truncated header"; return false; }
        e.tokens.resize(n_tok);
        for (uint64_t i = 0; i < n_tok; ++i) e.tokens[i] = static_cast<TokenId>(static_cast<uint32_t>(c.u(4)));
        e.body_bytes = c.u(8);
        e.body_hash = c.u(8);
        const size_t hashed = c.at;
        const uint64_t hh = c.u(8);
        if (!c.ok || hh != state_hash(b.data(), hashed)) { why = "header checksum mismatch"; return false; }
        if (size != c.at + e.body_bytes) { why = "file size is not the header's (truncated?)"; return false; }
        e.file_bytes = size;
        return true;
    }

    bool read_checked(const StoredState& e, std::vector<uint8_t>& body, std::string& why, bool& remove) const {
        const int fd = ::open(path(e.file).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) { why = std::string("open: ") + std::strerror(errno); return false; }
        struct stat st {};
        StoredState h;
        bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
        if (!ok) why = "not a regular file";
        else ok = read_header(fd, static_cast<uint64_t>(st.st_size), h, why);
        if (ok && (h.tokens != e.tokens || h.session != e.session)) { ok = false; why = "file changed"; }
        if (ok) {
            try {
                body.resize(h.body_bytes);
            } catch (const std::bad_alloc&) {
                ::close(fd);
                why = "out of memory";
                return false;
            }
            const off_t at = static_cast<off_t>(h.file_bytes - h.body_bytes);
            size_t got = 0;
            while (got < body.size()) {
                const ssize_t r = ::pread(fd, body.data() + got, body.size() - got, at + static_cast<off_t>(got));
                if (r <= 0) break;
                got += static_cast<size_t>(r);
            }
            if (got != body.size()) { ok = false; why = "short read"; }
            else if (state_hash(body.data(), body.size()) != h.body_hash) {
                ok = false;
                why = "body checksum mismatch";
                remove = true;  // the header is this model's: the file is corrupt, never usable
            }
        }
        ::close(fd);
        return ok;
    }

    /// Rebuilds the index from the directory listing (headers of new files only).
    void scan_index(int64_t dir_mtime) {
        std::map<std::string, StoredState> fresh;
        std::set<std::string> skipped;
        std::map<std::string, StoredState> old;
        {
            std::lock_guard<std::mutex> lock(mu_);
            old = std::move(index_);  // a state the writer indexes meanwhile is in the listing
            index_.clear();
            skipped = skipped_;
        }
        DIR* d = ::opendir(dir_.c_str());
        if (d == nullptr) {
            std::lock_guard<std::mutex> lock(mu_);
            index_.clear();
            dir_seen_ = false;
            return;
        }
        std::set<std::string> present;
        while (const dirent* ent = ::readdir(d)) {
            const std::string name = ent->d_name;
            if (name.size() < 5 || name.compare(name.size() - 4, 4, ".tss") != 0) continue;
            present.insert(name);
            struct stat st {};
            if (::fstatat(::dirfd(d), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
            auto it = old.find(name);
            if (it != old.end() && it->second.file_bytes == static_cast<uint64_t>(st.st_size)) {
                fresh.emplace(name, std::move(it->second));
                continue;
            }
            if (skipped.count(name) != 0) continue;
            StoredState e;
            e.file = name;
            e.mtime_ns = mtime_ns(st);
            std::string why;
            bool ok = S_ISREG(st.st_mode);
            if (!ok) why = "not a regular file";
            if (ok) {
                const int fd = ::openat(::dirfd(d), name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
                ok = fd >= 0 && read_header(fd, static_cast<uint64_t>(st.st_size), e, why);
                if (fd < 0) why = std::string("open: ") + std::strerror(errno);
                if (fd >= 0) ::close(fd);
            }
            if (ok) {
                fresh.emplace(name, std::move(e));
            } else {
                skipped.insert(name);
                // Another model's files are expected in a shared directory: not worth a line each.
                if (why != "another model's state")
                    std::fprintf(stderr, "trioserve-worker: state file %s skipped (%s)\n", name.c_str(), why.c_str());
            }
        }
        ::closedir(d);
        for (auto it = skipped.begin(); it != skipped.end();) it = present.count(*it) ? std::next(it) : skipped.erase(it);
        std::lock_guard<std::mutex> lock(mu_);
        index_ = std::move(fresh);
        skipped_ = std::move(skipped);
        dir_seen_ = true;
        dir_mtime_ns_ = dir_mtime;
    }

    void write_loop() {
        for (;;) {
            Job job;
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
                if (queue_.empty()) return;  // stopping, everything written
                job = std::move(queue_.front());
                queue_.pop_front();
                writing_ = true;
            }
            write_one(job);
            bound();
            {
                std::lock_guard<std::mutex> lock(mu_);
                writing_ = false;
            }
            idle_cv_.notify_all();
        }
    }

    /// Writes one state atomically; indexes it and drops the states it replaces (the same
    /// session's older ones; an anonymous state's strict prefixes when states are trimmable).
    void write_one(const Job& job) {
        const std::string name = file_name(job.session, job.tokens);
        const std::string tmp = path(".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(++tmp_counter_));
        const std::vector<uint8_t> head = header(job.session, job.tokens, job.body);
        std::string err;
        const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW;
        int fd = ::open(tmp.c_str(), flags, 0600);
        // A directory removed under the worker is made again (the store heals itself).
        if (fd < 0 && errno == ENOENT && ::mkdir(dir_.c_str(), 0700) == 0) fd = ::open(tmp.c_str(), flags, 0600);
        if (fd < 0) err = std::string("create: ") + std::strerror(errno);
        auto write_all = [&](const uint8_t* p, size_t n) {
            while (n > 0 && err.empty()) {
                const ssize_t w = ::write(fd, p, n);
                if (w < 0 && errno == EINTR) continue;
                if (w <= 0) err = std::string("write: ") + std::strerror(w < 0 ? errno : ENOSPC);
                else { p += w; n -= static_cast<size_t>(w); }
            }
        };
        if (err.empty()) write_all(head.data(), head.size());
        if (err.empty()) write_all(job.body.data(), job.body.size());
        if (err.empty() && ::fsync(fd) != 0) err = std::string("fsync: ") + std::strerror(errno);
        if (fd >= 0 && ::close(fd) != 0 && err.empty()) err = std::string("close: ") + std::strerror(errno);
        if (err.empty() && ::rename(tmp.c_str(), path(name).c_str()) != 0)
            err = std::string("rename: ") + std::strerror(errno);
        if (!err.empty()) {
            if (fd >= 0) ::unlink(tmp.c_str());
            std::fprintf(stderr, "trioserve-worker: writing a state to %s failed (%s); serving on without it\n",
                         dir_.c_str(), err.c_str());
            std::lock_guard<std::mutex> lock(mu_);
            ++write_failures_;
            return;
        }
        if (const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
            ::fsync(dfd);  // the rename itself survives a power loss
            ::close(dfd);
        }
        StoredState e;
        e.file = name;
        e.session = job.session;
        e.tokens = job.tokens;
        e.body_bytes = job.body.size();
        e.body_hash = 0;
        e.file_bytes = head.size() + job.body.size();
        std::lock_guard<std::mutex> lock(mu_);
        ++writes_;
        skipped_.erase(name);
        for (auto it = index_.begin(); it != index_.end();) {
            const StoredState& o = it->second;
            const bool replaced = o.file != name && o.session == job.session &&
                                  (!job.session.empty() ||
                                   (trimmable_ && o.tokens.size() < job.tokens.size() &&
                                    std::equal(o.tokens.begin(), o.tokens.end(), job.tokens.begin())));
            if (replaced) {
                ::unlink(path(o.file).c_str());
                it = index_.erase(it);
            } else {
                ++it;
            }
        }
        index_[name] = std::move(e);
    }

    /// Brings the directory within bound_ bytes, least recently used (oldest mtime) first;
    /// removes crashed writers' temp files. Writer thread.
    void bound() {
        struct F { int64_t mtime; uint64_t bytes; std::string name; };
        std::vector<F> files;
        uint64_t total = 0;
        const int64_t now = static_cast<int64_t>(::time(nullptr)) * 1000000000;
        DIR* d = ::opendir(dir_.c_str());
        if (d == nullptr) return;
        while (const dirent* ent = ::readdir(d)) {
            const std::string name = ent->d_name;
            struct stat st {};
            if (::fstatat(::dirfd(d), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) continue;
            if (name.rfind(".tmp-", 0) == 0) {
                if (now - mtime_ns(st) > kStaleTempNs) ::unlinkat(::dirfd(d), name.c_str(), 0);
                continue;
            }
            if (name.size() < 5 || name.compare(name.size() - 4, 4, ".tss") != 0) continue;
            files.push_back(F{mtime_ns(st), static_cast<uint64_t>(st.st_size), name});
            total += static_cast<uint64_t>(st.st_size);
        }
        std::sort(files.begin(), files.end(), [](const F& a, const F& b) { return a.mtime < b.mtime; });
        std::vector<std::string> dropped;
        for (const F& f : files) {
            if (total <= bound_) break;
            if (::unlinkat(::dirfd(d), f.name.c_str(), 0) == 0) {
                total -= f.bytes;
                dropped.push_back(f.name);
            }
        }
        ::closedir(d);
        std::lock_guard<std::mutex> lock(mu_);
        for (const std::string& n : dropped) index_.erase(n);
        dir_bytes_ = total;
    }

    const std::string dir_;
    const uint64_t bound_;
    const std::string fingerprint_;
    const bool trimmable_;
    std::string fp_hex_;
    std::mutex mu_;
    std::condition_variable cv_, idle_cv_;
    std::map<std::string, StoredState> index_;  ///< file name → header (this model's only)
    std::set<std::string> skipped_;             ///< files not to look at again (while present)
    bool dir_seen_ = false;
    int64_t dir_mtime_ns_ = -1;
    std::deque<Job> queue_;
    bool writing_ = false;
    bool stopping_ = false;
    uint64_t tmp_counter_ = 0;  ///< writer thread only
    uint64_t hits_ = 0, load_failures_ = 0, writes_ = 0, write_failures_ = 0, writes_skipped_ = 0, dir_bytes_ = 0;
    std::thread writer_;  ///< last: started when everything above exists
};

}  // namespace trioserve
