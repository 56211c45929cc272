// cli_args.h — minimal "--flag value" parsing for the worker mains (no dependency).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace trioserve {

/// Walks argv; each accessor consumes a flag it recognises. Unknown flags are an error.
class Args {
public:
    Args(int argc, char** argv) : args_(argv + 1, argv + argc) {}

    bool done() const { return i_ >= args_.size(); }
    const std::string& peek() const { return args_[i_]; }

    /// If the current token is `flag`, consumes it and returns true.
    bool flag(const char* name) {
        if (done() || args_[i_] != name) return false;
        ++i_;
        return true;
    }

    /// If the current token is `flag` (or `flag=value`), consumes it and its value.
    bool value(const char* name, std::string& out) {
        if (done()) return false;
        const std::string& a = args_[i_];
        const std::string n(name);
        if (a == n) {
            if (i_ + 1 >= args_.size()) fail(n + " needs a value");
            out = args_[i_ + 1];
            i_ += 2;
            return true;
        }
        if (a.compare(0, n.size() + 1, n + "=") == 0) {
            out = a.substr(n.size() + 1);
            ++i_;
            return true;
        }
        return false;
    }

    bool int_value(const char* name, long long& out, long long min_value) {
        std::string s;
        if (!value(name, s)) return false;
        char* end = nullptr;
        long long v = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0' || v < min_value)
            fail(std::string(name) + " must be an integer >= " + std::to_string(min_value));
        out = v;
        return true;
    }

    bool double_value(const char* name, double& out) {
        std::string s;
        if (!value(name, s)) return false;
        char* end = nullptr;
        double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || !(v >= 0)) fail(std::string(name) + " must be a number >= 0");
        out = v;
        return true;
    }

    [[noreturn]] static void fail(const std::string& msg) {
        std::fprintf(stderr, "error: %s (see --help)\n", msg.c_str());
        std::exit(2);
    }

private:
    std::vector<std::string> args_;
    size_t i_ = 0;
};

}  // namespace trioserve
