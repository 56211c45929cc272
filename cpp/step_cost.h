// step_cost.h — what a speculative step costs, measured on the steps that actually ran, and the
// per-step choice of draft lengths from it (pure; unit-tested in cpp/tests/test_speculation.cpp).
// Spec: spec/worker-protocol.md §4.6.
//
// Why measured in service and keyed by shape: a start-up model (one stream, 64-token context)
// underestimated what drafting costs where it was used. A verified position attends over the
// whole context, so at 1,500 tokens a drafted step costs more than at 64; and with several
// streams llama.cpp splits a batch of per-sequence KV streams into micro-batches of equal
// tokens per sequence, so one stream's draft becomes a graph compute of its own. Both losses
// (0.84x on an edit at depth, 0.63x at 4 streams) came from costs the model had never seen.
// So the table keys every decode-only step by its shape — streams in the batch, context depth
// (octave buckets of the deepest stream's position) — and stores, per number of draft tokens
// in the step, its time relative to the plain step of the same shape (exponential averages).
// Relative, because the shared machine's load moves every absolute time: the plain step is
// measured nearly every step, a drafted size only when it runs, and a ratio taken at the time
// of the drafted step stays right when the load changes.
//
// A shape with no drafted step measured drafts nothing; probes (one stream's confident
// candidate verified anyway) measure it: draft sizes 1, 2, 4 and 8 once each, and again when
// a size's measurement is kReprobeSteps plain steps of the shape old. With several streams a measured curve admits one drafting stream per step:
// the table does not key by batch composition, and each further distinct draft length would be
// another micro-batch whose cost nobody measured.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace trioserve {

/// Milliseconds of a one-stream step of n tokens, piecewise linear over points: the start-up
/// calibration (a 64-token context) or an operator's fixed model (--step-cost-ms). Made
/// non-decreasing from the right (each point becomes the least of itself and every bigger
/// step's), so one measurement that a busy machine spiked is bounded by its neighbours.
/// Beyond the last point it grows in proportion.
class StepCostModel {
public:
    /// Points (tokens, ms), any order; needs at least the 1-token point.
    void set(std::vector<std::pair<size_t, double>> pts) {
        std::sort(pts.begin(), pts.end());
        pts_.clear();
        for (auto& p : pts)
            if (p.first > 0 && p.second > 0) pts_.push_back(p);
        for (size_t i = pts_.size(); i-- > 1;)
            pts_[i - 1].second = std::min(pts_[i - 1].second, pts_[i].second);
    }
    bool empty() const { return pts_.empty(); }
    const std::vector<std::pair<size_t, double>>& points() const { return pts_; }

    double ms(size_t n) const {
        if (pts_.empty()) return static_cast<double>(n);
        if (n <= pts_.front().first) return pts_.front().second;
        for (size_t i = 1; i < pts_.size(); ++i) {
            if (n <= pts_[i].first) {
                const auto& a = pts_[i - 1];
                const auto& b = pts_[i];
                const double f = static_cast<double>(n - a.first) / static_cast<double>(b.first - a.first);
                return a.second + f * (b.second - a.second);
            }
        }
        const auto& last = pts_.back();
        return last.second * static_cast<double>(n) / static_cast<double>(last.first);
    }

private:
    std::vector<std::pair<size_t, double>> pts_;
};

/// One shape's step cost relative to its plain step: rel(e) for a step with e draft tokens
/// (rel(0) = 1), +infinity where nothing tells (no size measured at this shape); linear
/// between measured sizes, the smallest's below it, in proportion beyond the biggest.
class StepCurve {
public:
    static constexpr double kUnknown = std::numeric_limits<double>::infinity();

    /// From measured points (e, ratio), e ascending and > 0.
    static StepCurve measured(size_t streams, std::vector<std::pair<size_t, double>> pts) {
        StepCurve c;
        c.streams_ = std::max<size_t>(streams, 1);
        c.pts_ = std::move(pts);
        for (size_t i = c.pts_.size(); i-- > 1;)  // a spiked size is bounded by bigger ones
            c.pts_[i - 1].second = std::min(c.pts_[i - 1].second, c.pts_[i].second);
        return c;
    }
    /// From a fixed one-stream model (an operator's, a test's): every stream's draft is
    /// believed, so several streams may draft at once.
    static StepCurve fixed(size_t streams, const StepCostModel& m) {
        StepCurve c;
        c.streams_ = std::max<size_t>(streams, 1);
        c.fixed_ = &m;
        return c;
    }

    /// At most one stream drafts in a step of several (measured curves: see the file comment).
    bool one_drafter() const { return fixed_ == nullptr; }

    double rel(size_t e) const {
        if (e == 0) return 1.0;
        if (fixed_ != nullptr) return fixed_->ms(streams_ + e) / fixed_->ms(streams_);
        if (pts_.empty()) return kUnknown;
        // Below the smallest measured size: that size's cost (a drafted step of several streams
        // is a micro-batch of its own, whose fixed part a line through (0, 1) would miss).
        if (e <= pts_.front().first) return pts_.front().second;
        size_t e0 = pts_.front().first;
        double r0 = pts_.front().second;
        for (const auto& [e1, r1] : pts_) {
            if (e <= e1) return r0 + (r1 - r0) * static_cast<double>(e - e0) / static_cast<double>(e1 - e0);
            e0 = e1;
            r0 = r1;
        }
        // Beyond the biggest measured step: in proportion to its tokens (no cheaper than that).
        return r0 * static_cast<double>(streams_ + e) / static_cast<double>(streams_ + e0);
    }

private:
    size_t streams_ = 1;
    std::vector<std::pair<size_t, double>> pts_;
    const StepCostModel* fixed_ = nullptr;
};

/// The cost of the decode-only steps this worker ran, by shape (see the file comment).
class StepCostTable {
public:
    static constexpr size_t kStreams = 16;   ///< shapes of 16 or more streams share one row
    static constexpr size_t kDepths = 8;     ///< < 256, < 512, ... < 16384, the rest
    static constexpr size_t kExtra = 64;     ///< draft tokens per step tracked
    static constexpr size_t kMinPlain = 3;   ///< plain steps of a shape before its probe
    static constexpr size_t kReprobeSteps = 256;
    static constexpr size_t kProbeSizes[] = {1, 2, 4, 8};  ///< draft tokens probed per shape
    static constexpr double kPlainWeight = 0.1, kDraftWeight = 0.3;

    static size_t depth_bucket(int64_t depth) {
        size_t b = 0;
        for (int64_t d = 256; depth >= d && b + 1 < kDepths; d *= 2) ++b;
        return b;
    }

    /// An operator's or a test's model for every shape; observe() then changes nothing.
    void fix(std::vector<std::pair<size_t, double>> pts) {
        fixed_.set(std::move(pts));
        is_fixed_ = true;
    }
    /// The start-up calibration (one stream, a 64-token context) as the first estimate of
    /// the one-stream shallow shape; live steps of that shape average into it.
    void seed(const StepCostModel& start) {
        if (start.empty() || is_fixed_) return;
        Shape& s = at(1, 0);
        s.plain = {start.ms(1), 0, 0};
        for (const auto& [n, ms] : start.points())
            if (n > 1 && n - 1 <= kExtra) s.extra[n - 1] = {ms / start.ms(1), 1, 0};
    }

    /// A decode-only step of `streams` items, `tokens` tokens in all, whose deepest stream
    /// sat at `depth`, took `ms` (planning, engine and verification: all it cost).
    void observe(size_t streams, int64_t depth, size_t tokens, double ms) {
        if (is_fixed_ || streams == 0 || tokens < streams || !(ms > 0)) return;
        const size_t e = tokens - streams;
        if (e > kExtra) return;
        Shape& s = at(streams, depth);
        if (e == 0) {
            s.plain.v = s.plain.n > 0 ? (1 - kPlainWeight) * s.plain.v + kPlainWeight * ms : ms;
            ++s.plain.n;
            return;
        }
        if (s.plain.n == 0) return;  // nothing to relate it to yet
        Cell& c = s.extra[e];
        const double r = ms / s.plain.v;
        c.v = c.n > 0 ? (1 - kDraftWeight) * c.v + kDraftWeight * r : r;
        ++c.n;
        c.at = s.plain.n;
    }

    /// The curve this step's choice uses (choose_draft_lengths()).
    StepCurve curve(size_t streams, int64_t depth) const {
        if (is_fixed_) return StepCurve::fixed(streams, fixed_);
        const Shape& s = at(streams, depth);
        std::vector<std::pair<size_t, double>> pts;
        if (s.plain.n > 0 || s.plain.v > 0)
            for (size_t e = 1; e <= kExtra; ++e)
                if (s.extra[e].n > 0) pts.emplace_back(e, s.extra[e].v);
        return StepCurve::measured(streams, std::move(pts));
    }

    /// The draft size (one stream's) to measure at this shape by verifying a confident
    /// candidate anyway: a size of kProbeSizes never measured, else (unless `unmeasured_only`)
    /// the one measured longest ago if that was kReprobeSteps plain steps of the shape back;
    /// 0 when none is due. The caller asks for unmeasured sizes only while the curve already
    /// chooses drafts: the curve grows in proportion beyond its biggest measured size, so a
    /// shape whose small probes paid would otherwise never try the bigger ones.
    size_t probe_size(size_t streams, int64_t depth, bool unmeasured_only = false) const {
        if (is_fixed_) return 0;
        const Shape& s = at(streams, depth);
        if (s.plain.n < kMinPlain) return 0;
        size_t oldest = 0;
        for (const size_t e : kProbeSizes) {
            if (s.extra[e].n == 0) return e;
            if (oldest == 0 || s.extra[e].at < s.extra[oldest].at) oldest = e;
        }
        return !unmeasured_only && s.plain.n - s.extra[oldest].at >= kReprobeSteps ? oldest : 0;
    }

    /// Plain-step ms of a shape (0: never seen): diagnostics and tests.
    double plain_ms(size_t streams, int64_t depth) const { return at(streams, depth).plain.v; }

private:
    struct Cell {
        double v = 0;    ///< plain: ms; extra: ratio to the plain step (exponential average)
        uint64_t n = 0;  ///< steps averaged
        uint64_t at = 0; ///< extra: the shape's plain-step count when last measured
    };
    struct Shape {
        Cell plain;
        Cell extra[kExtra + 1];
    };
    size_t index(size_t streams, int64_t depth) const {
        return (std::min(std::max<size_t>(streams, 1), kStreams) - 1) * kDepths + depth_bucket(depth);
    }
    Shape& at(size_t streams, int64_t depth) { return shapes_[index(streams, depth)]; }
    const Shape& at(size_t streams, int64_t depth) const { return shapes_[index(streams, depth)]; }

    std::vector<Shape> shapes_ = std::vector<Shape>(kStreams * kDepths);
    StepCostModel fixed_;
    bool is_fixed_ = false;
};

/// The draft lengths of one step. `alpha[i]`, `avail[i]`: acceptance estimate and available
/// draft tokens of speculating generation i; `n_decode`: decode streams in the step (one token
/// each); `cost`: the step's shape curve. Fills `k` (same size) to maximise expected emitted
/// tokens per unit of step cost, where a draft of k tokens adds alpha + ... + alpha^k expected
/// tokens; greedy by the largest marginal expected gain, keeping the best configuration seen.
/// All zero unless it beats the plain step by `min_gain` (a margin against measurement noise),
/// and where the curve knows no cost. With a measured curve and several streams only the one
/// generation whose draft pays most drafts (StepCurve::one_drafter). Pure.
inline void choose_draft_lengths(const std::vector<double>& alpha, const std::vector<size_t>& avail, size_t n_decode,
                                 const StepCurve& cost, double min_gain, std::vector<size_t>& k) {
    const size_t m = alpha.size();
    k.assign(m, 0);
    if (m == 0 || n_decode == 0) return;
    double best_rate = static_cast<double>(n_decode) * (1.0 + min_gain);
    std::vector<size_t> cur(m);
    std::vector<double> next_gain(m);
    // One greedy pass over the generations in [lo, hi).
    auto pass = [&](size_t lo, size_t hi) {
        std::fill(cur.begin(), cur.end(), 0);
        for (size_t i = 0; i < m; ++i) next_gain[i] = i >= lo && i < hi && avail[i] > 0 ? alpha[i] : 0.0;
        double expected = static_cast<double>(n_decode);
        size_t extra = 0;
        for (;;) {
            size_t bi = m;
            double bg = 0;
            for (size_t i = lo; i < hi; ++i)
                if (cur[i] < avail[i] && next_gain[i] > bg) { bg = next_gain[i]; bi = i; }
            if (bi == m || bg < 0.02) break;  // nothing left worth a token of compute
            ++cur[bi];
            ++extra;
            expected += bg;
            next_gain[bi] *= alpha[bi];
            const double rate = expected / cost.rel(extra);
            if (rate > best_rate) {
                best_rate = rate;
                k = cur;
            }
        }
    };
    if (cost.one_drafter() && n_decode > 1)
        for (size_t i = 0; i < m; ++i) pass(i, i + 1);
    else
        pass(0, m);
}

}  // namespace trioserve
