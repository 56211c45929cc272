// llama_custom_ops.h — trioserve's own CPU kernels for the two operators ExecuTorch's LLM
// exporter emits with `--use_sdpa_with_kv_cache`:
//
//   llama::update_cache.out(Tensor value, Tensor(a!) cache, SymInt start_pos, *, Tensor(b!) out)
//   llama::custom_sdpa.out(Tensor query, Tensor key, Tensor value, SymInt start_pos,
//                          Tensor? attn_mask=None, float drpout_p=0.0, bool is_causal=False,
//                          float? scale=None, *, Tensor(a!) out)
//
// (the schemas of executorch 1.5.1's custom_ops library). ExecuTorch ships their kernels only
// inside a libtorch-linked Python extension, so a `.pte` that uses them does not load in a
// program linked against the wheel's C++ runtime alone; registering these makes it load.
//
// Layouts (what the exporter's SDPACustom / CustomKVCache hand over, all contiguous):
//   query/out [B, S, H, D]; key/value caches [B, T, Hkv, D] with H a multiple of Hkv (grouped
//   query attention: query head h reads cache head h / (H / Hkv)); update_cache's value
//   [B, S, Hkv, D] is copied into cache[:, start_pos : start_pos + S].
// Attention: query row i sits at absolute position start_pos + i. Causal: it attends keys
//   [0, start_pos + i]. With an additive float mask [S, Tm] (the exporter's ring-buffer path,
//   is_causal false): keys [0, Tm) with the mask added. Neither: keys [0, start_pos + S).
//   Softmax in float with the row maximum subtracted; scale defaults to 1/sqrt(D).
// fp32 only: the exporter converts other dtypes to fp32 around the call (SDPACustom's
// fallback) except bf16, which is rejected here with a message.
//
// Errors (a shape or dtype this kernel does not handle) fail the kernel through the runtime
// context: the forward call returns an error, the worker reports engine_error for that request.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

namespace trioserve::llama_ops {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

/// True when `t` is a contiguous rank-4 tensor (strides of the default dim order).
inline bool contiguous4(const Tensor& t) {
    if (t.dim() != 4) return false;
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    int64_t expect = 1;
    for (int d = 3; d >= 0; --d) {
        if (sizes[d] != 1 && strides[d] != expect) return false;
        expect *= sizes[d];
    }
    return true;
}

inline void fail(KernelRuntimeContext& ctx, const char* op, const char* why) {
    std::fprintf(stderr, "trioserve-executorch-worker: %s: %s\n", op, why);
    ctx.fail(executorch::runtime::Error::InvalidArgument);
}

/// One KV cache buffer as update_cache_out() saw it: `rows` positions of `row_bytes` each,
/// contiguous from `data` (batch 1).
struct CacheBuffer {
    uint8_t* data = nullptr;
    int64_t rows = 0;
    size_t row_bytes = 0;
};

/// While non-null, update_cache_out() appends every cache it writes that is not already listed
/// (first-seen order: the program's layer order). The ExecuTorch engine sets it around one
/// warm-up forward call per instance, on the thread that calls forward (kernels run on the
/// calling thread), to learn where each instance's K/V buffers are: export_llama does not
/// name its mutable buffers, so this is the only place their addresses and shapes show.
inline std::vector<CacheBuffer>*& cache_log() {
    static std::vector<CacheBuffer>* log = nullptr;
    return log;
}

/// value [B,S,H,D] -> cache[:, start_pos:start_pos+S]. `cache` is mutated in place (the
/// schema's Tensor(a!)); `out` is the exporter's placeholder and is left as it is.
inline Tensor& update_cache_out(KernelRuntimeContext& ctx, const Tensor& value, const Tensor& cache, int64_t start_pos,
                                Tensor& out) {
    const char* op = "llama::update_cache.out";
    if (!contiguous4(value) || !contiguous4(cache)) { fail(ctx, op, "value and cache must be contiguous rank-4 tensors"); return out; }
    if (value.scalar_type() != cache.scalar_type()) { fail(ctx, op, "value and cache dtypes differ"); return out; }
    const int64_t B = value.size(0), S = value.size(1), T = cache.size(1);
    if (cache.size(0) != B || cache.size(2) != value.size(2) || cache.size(3) != value.size(3)) {
        fail(ctx, op, "value and cache shapes differ outside the sequence dimension");
        return out;
    }
    if (start_pos < 0 || start_pos + S > T) { fail(ctx, op, "start_pos + sequence length exceeds the cache"); return out; }
    const size_t row = value.nbytes() / static_cast<size_t>(std::max<int64_t>(1, B * S));  // bytes per position
    const auto* src = static_cast<const char*>(value.const_data_ptr());
    auto* dst = static_cast<char*>(cache.mutable_data_ptr());
    if (std::vector<CacheBuffer>* log = cache_log(); log != nullptr && B == 1) {
        auto* base = reinterpret_cast<uint8_t*>(dst);
        if (std::none_of(log->begin(), log->end(), [base](const CacheBuffer& c) { return c.data == base; }))
            log->push_back({base, T, row});
    }
    for (int64_t b = 0; b < B; ++b)
        std::memcpy(dst + (static_cast<size_t>(b * T + start_pos)) * row, src + static_cast<size_t>(b * S) * row,
                    static_cast<size_t>(S) * row);
    return out;
}

/// Scaled dot-product attention of a query chunk against the KV cache (see the header).
inline Tensor& custom_sdpa_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, int64_t start_pos,
                               const std::optional<Tensor>& attn_mask, double /*dropout_p: inference*/, bool is_causal,
                               std::optional<double> scale, Tensor& out) {
    const char* op = "llama::custom_sdpa.out";
    if (q.scalar_type() != ScalarType::Float || k.scalar_type() != ScalarType::Float ||
        v.scalar_type() != ScalarType::Float) {
        fail(ctx, op, "only float32 query/key/value are supported");
        return out;
    }
    if (!contiguous4(q) || !contiguous4(k) || !contiguous4(v)) { fail(ctx, op, "query/key/value must be contiguous rank-4"); return out; }
    const int64_t B = q.size(0), S = q.size(1), H = q.size(2), D = q.size(3);
    const int64_t T = k.size(1), Hkv = k.size(2);
    if (k.size(0) != B || v.size(0) != B || k.size(3) != D || v.size(3) != D || v.size(1) != T || v.size(2) != Hkv ||
        Hkv <= 0 || H % Hkv != 0) {
        fail(ctx, op, "incompatible query/key/value shapes");
        return out;
    }
    const float* mask = nullptr;
    int64_t mask_cols = 0;
    if (attn_mask.has_value()) {
        const Tensor& m = *attn_mask;
        if (m.scalar_type() != ScalarType::Float || m.dim() != 2 || m.size(0) != S || m.size(1) > T) {
            fail(ctx, op, "attn_mask must be float32 [seq_len, <= cache length]");
            return out;
        }
        mask = m.const_data_ptr<float>();
        mask_cols = m.size(1);
    }
    if (!mask && (start_pos < 0 || start_pos + S > T)) { fail(ctx, op, "start_pos + sequence length exceeds the cache"); return out; }
    if (executorch::runtime::resize_tensor(out, q.sizes()) != executorch::runtime::Error::Ok || !contiguous4(out) ||
        out.scalar_type() != ScalarType::Float) {
        fail(ctx, op, "cannot shape the output like the query");
        return out;
    }
    const float sc = scale.has_value() ? static_cast<float>(*scale) : 1.0f / std::sqrt(static_cast<float>(D));
    const int64_t group = H / Hkv;
    const float* qp = q.const_data_ptr<float>();
    const float* kp = k.const_data_ptr<float>();
    const float* vp = v.const_data_ptr<float>();
    float* op_ = out.mutable_data_ptr<float>();
    // One work item per (batch, head, query row): independent, so they spread over the pool.
    const int64_t items = B * H * S;
    const int64_t keys_max = mask ? mask_cols : start_pos + S;
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, keys_max * D));
    executorch::extension::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> w(static_cast<size_t>(std::max<int64_t>(1, keys_max)));
        for (int64_t it = begin; it < end; ++it) {
            const int64_t i = it % S, h = (it / S) % H, b = it / (S * H);
            const int64_t hk = h / group;
            int64_t n_keys = mask ? mask_cols : (is_causal ? start_pos + i + 1 : start_pos + S);
            const float* qrow = qp + ((b * S + i) * H + h) * D;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n_keys; ++j) {
                const float* krow = kp + ((b * T + j) * Hkv + hk) * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; ++d) dot += qrow[d] * krow[d];
                float s = dot * sc;
                if (mask) s += mask[i * mask_cols + j];
                w[static_cast<size_t>(j)] = s;
                mx = std::max(mx, s);
            }
            float* orow = op_ + ((b * S + i) * H + h) * D;
            std::fill(orow, orow + D, 0.0f);
            if (!(mx > -INFINITY)) continue;  // every key masked out: a zero row
            float sum = 0.0f;
            for (int64_t j = 0; j < n_keys; ++j) {
                const float e = std::exp(w[static_cast<size_t>(j)] - mx);
                w[static_cast<size_t>(j)] = e;
                sum += e;
            }
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < n_keys; ++j) {
                const float p = w[static_cast<size_t>(j)] * inv;
                const float* vrow = vp + ((b * T + j) * Hkv + hk) * D;
                for (int64_t d = 0; d < D; ++d) orow[d] += p * vrow[d];
            }
        }
    });
    return out;
}

/// Registers both kernels with ExecuTorch's operator registry (once per process; before a
/// program that uses them is loaded). Returns false when the registry refused them (e.g. the
/// names were already registered by another library).
inline bool register_llama_custom_ops() {
    static const bool ok = [] {
        static constexpr const char kUpdate[] = "llama::update_cache.out";
        static constexpr const char kSdpa[] = "llama::custom_sdpa.out";
        const executorch::runtime::Kernel kernels[] = {
            executorch::extension::make_boxed_kernel(kUpdate, EXECUTORCH_FN(update_cache_out, kUpdate)),
            executorch::extension::make_boxed_kernel(kSdpa, EXECUTORCH_FN(custom_sdpa_out, kSdpa)),
        };
        return executorch::runtime::register_kernels({kernels, 2}) == executorch::runtime::Error::Ok;
    }();
    return ok;
}

}  // namespace trioserve::llama_ops
