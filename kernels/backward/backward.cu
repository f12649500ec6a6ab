// Causal GQA, backward: dQ, dK and dV from q, k, v, the forward's output o and the output's
// gradient dO, for fp32, fp16 and bf16 inputs (fp32 arithmetic, gradients in the input dtype).
// Compiled into the entry library.
//
// With s_ij = q_i . k_j times the scale over the keys j that query i sees (p.geo: causal attention
// with Tq = Tk for every plan's fallback, any geometry for attention(); common/geometry.cuh),
// p = softmax(s) and delta_i = dO_i . o_i:
//   dS_ij = p_ij (dO_i . v_j - delta_i)
//   dQ_i  = sum_j dS_ij k_j times the scale
//   dK_j  = sum_i dS_ij q_i times the scale   over every row i (all G query heads of j's kv head)
//   dV_j  = sum_i p_ij dO_i
// Two kernels, one warp per row, each lane holding head-dim elements lane, lane + 32, ...; every
// sum runs in a fixed order, so results are bitwise equal across runs (no atomics):
//   1. query rows: delta_i, then one pass over the keys with an online softmax that also carries
//      dQ (rescaled when the running maximum grows, divided by the row's sum at the end; two more
//      passes where delta_i is not finite, below, or p.delta_from_p asks for delta from p); writes
//      dQ and the row's log-sum-exp and delta for kernel 2. No forward statistics are needed, so
//      the forward keeps nothing when no backward follows.
//   2. key rows (batch, time, kv head): every query row that sees the key, in the G heads of the
//      group, recomputes p_ij from the stored log-sum-exp and adds into dK and dV. A query row that
//      sees no key has dQ = 0 and is seen by no key row.
// Plain FMA, no tensor cores: fp32 inputs, and 16-bit ones at head dims without a tensor-core unit
// (bwdmma/: fp16 and bf16 at 64 and 128), whose reference it also is in the tests; and, on every
// plan, the whole call when q, k, v, o or dO holds Inf or NaN (attention.cu).
//
// Inf and NaN: NaN, +Inf and -Inf land where float64 autograd of the definition puts them. Every
// sum's kind (NaN, +-Inf or finite) is the same in any order: NaN if a term is NaN or +Inf and -Inf
// both occur, else the Inf's sign. What does depend on the formula is which Inf - Inf is formed:
// dO_i . o_i and autograd's sum_j p_ij dp_ij are equal numbers but not equal Infs. The rule: dS is
// autograd's, dS_ij = p_ij (dp_ij - delta_i) with delta_i = sum_j p_ij dp_ij (softmax's backward,
// dp_ij = dO_i . v_j), taken where dO_i . o_i is not finite (kernel 1 then makes a second and a
// third pass over the row's keys: delta, then dQ from p_ij = 2^(s2_ij - lse2_i)); elsewhere the two
// are the same finite number and dO_i . o_i serves. A worked example, T = 2, D = 1, row 1 with
// p_1 = (3/4, 1/4), v = (1, -1), so o_1 = 1/2, and dO_1 = +Inf:
//   dp_1 = (+Inf, -Inf). dO_1 . o_1 = +Inf would give dS_1 = (3/4 (Inf - Inf), 1/4 (-Inf - Inf))
//   = (NaN, -Inf); autograd's delta_1 = 3/4 Inf + 1/4 (-Inf) = NaN gives dS_1 = (NaN, NaN), as
//   here. With v = (1, 2): dp_1 = (+Inf, +Inf), delta_1 = +Inf either way, dS_1 = (NaN, NaN).
// So a row whose dO holds Inf has dS NaN at every key it attends (a one-key row too: dp - dp),
// and dK of those keys is NaN, never +-Inf, as in the reference. fp32 sums can still overflow to
// +-Inf where float64's do not (finite inputs near fp32's range); that is the one difference.

#include "common/base.cuh"

namespace {

constexpr int kBwdWarps = 8;                        // warps per CTA; one row each
constexpr int kBwdLaneElems = kGqaMaxHeadDim / 32;  // head-dim elements per lane, at most
constexpr int kBwdKeyBlock = 32;                    // kernel 2's query times per partial sum

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Elements lane, lane + 32, ... of a D-long row, in fp32; zeros past D.
template <typename Elem>
__device__ __forceinline__ void load_row(float (&dst)[kBwdLaneElems], const Elem* row, int D, int lane, bool bf16) {
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) {
        const int d = lane + 32 * e;
        dst[e] = d < D ? to_float(row[d], bf16) : 0.f;
    }
}

template <typename Elem>
__device__ __forceinline__ void store_row(Elem* row, const float (&src)[kBwdLaneElems], float scale, int D, int lane,
                                          bool bf16) {
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) {
        const int d = lane + 32 * e;
        if (d < D) row[d] = from_float<Elem>(src[e] * scale, bf16);
    }
}

__device__ __forceinline__ float dot(const float (&a)[kBwdLaneElems], const float (&b)[kBwdLaneElems]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) s = fmaf(a[e], b[e], s);
    return warp_sum(s);
}

// This warp's row of a [B, T, H, D] tensor in the CTA's `unit` of kBwdWarps rows (one warp a row).
struct WarpRow {
    int64_t row, b;
    int t, head, lane;
    bool valid;
};
__device__ __forceinline__ WarpRow warp_row(int B, int T, int heads, int64_t unit) {
    WarpRow w;
    w.row = unit * kBwdWarps + threadIdx.x / 32;
    w.lane = threadIdx.x % 32;
    w.valid = w.row < int64_t(B) * T * heads;
    w.head = int(w.row % heads);
    w.t = int(w.row / heads % T);
    w.b = w.row / heads / T;
    return w;
}

// Kernel 1: one warp per query row (b, t, h), rows in [B, T, Hq] order.
template <typename Elem>
__device__ __forceinline__ void query_row(const GqaBwdParams& p, const WarpRow& w) {
    const int64_t row = w.row, b = w.b;
    const int lane = w.lane, t = w.t;
    const bool bf16 = p.dtype == kGqaBFloat16;
    const int64_t kv_head = w.head / p.group;
    const int64_t rd = row * p.D;

    float q[kBwdLaneElems], dout[kBwdLaneElems], acc[kBwdLaneElems], x[kBwdLaneElems], y[kBwdLaneElems];
    load_row(q, static_cast<const Elem*>(p.q) + rd, p.D, lane, bf16);
    load_row(dout, static_cast<const Elem*>(p.dout) + rd, p.D, lane, bf16);
    load_row(x, static_cast<const Elem*>(p.o) + rd, p.D, lane, bf16);
    float delta = dot(dout, x);
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) acc[e] = 0.f;

    // Key j's row of k into x and of v into y; its score s2 (log2 units) and dp = dO . v_j.
    auto key = [&](int j, float& s2, float& dp) {
        const int64_t kd = ((b * p.geo.Tk + j) * p.Hkv + kv_head) * p.D;
        load_row(x, static_cast<const Elem*>(p.k) + kd, p.D, lane, bf16);
        load_row(y, static_cast<const Elem*>(p.v) + kd, p.D, lane, bf16);
        s2 = dot(q, x) * p.scale_log2;
        dp = dot(dout, y);
    };
    // Scores in log2 units: s2 = s * log2(e). m: running maximum, l: running sum of 2^(s2 - m);
    // acc: sum of 2^(s2 - m) (dO . v_j - delta) k_j.
    const GqaRange keys = p.geo.keys_any(t, t);
    if (keys.empty()) {   // a row that sees no key: output 0, so every gradient through it is 0
#pragma unroll
        for (int e = 0; e < kBwdLaneElems; ++e) acc[e] = 0.f;
        store_row(static_cast<Elem*>(p.dq) + rd, acc, 1.f, p.D, lane, bf16);
        if (lane == 0) p.lse2[row] = -INFINITY, p.delta[row] = 0.f;   // read by no key row
        return;
    }
    float m = -INFINITY, l = 0.f, s2, dp;
    for (int j = keys.first; j <= keys.last; ++j) {
        key(j, s2, dp);
        if (s2 > m) {
            const float r = exp2f(m - s2);
            l *= r;
#pragma unroll
            for (int e = 0; e < kBwdLaneElems; ++e) acc[e] *= r;
            m = s2;
        }
        const float w = s2 == -INFINITY ? 0.f : exp2f(s2 - m);   // p = 0 there, even while m is -inf
        l += w;
        const float ds = w * (dp - delta);
#pragma unroll
        for (int e = 0; e < kBwdLaneElems; ++e) acc[e] = fmaf(ds, x[e], acc[e]);
    }
    // A score of +inf makes lse2 NaN (l = inf - inf): every p_ij of the row NaN, as torch.softmax's
    const float lse2 = m + log2f(l);
    float dq_scale = p.scale / l;
    // dO . o not finite (the same in every lane), or p.delta_from_p: delta and dQ again as autograd
    // forms them (the header's rule), delta = sum_j p_j dp_j, then dS_j = p_j (dp_j - delta), p_j =
    // 2^(s2 - lse2).
    if (!isfinite(delta) || p.delta_from_p) {
        const GqaRange keys = p.geo.keys_any(t, t);   // again: the first loop's range need not stay live
        delta = 0.f;
        for (int j = keys.first; j <= keys.last; ++j) {
            key(j, s2, dp);
            delta = fmaf(exp2f(s2 - lse2), dp, delta);
        }
#pragma unroll
        for (int e = 0; e < kBwdLaneElems; ++e) acc[e] = 0.f;
        for (int j = keys.first; j <= keys.last; ++j) {
            key(j, s2, dp);
            const float ds = exp2f(s2 - lse2) * (dp - delta);
#pragma unroll
            for (int e = 0; e < kBwdLaneElems; ++e) acc[e] = fmaf(ds, x[e], acc[e]);
        }
        dq_scale = p.scale;
    }
    store_row(static_cast<Elem*>(p.dq) + rd, acc, dq_scale, p.D, lane, bf16);
    if (lane == 0) {
        p.lse2[row] = lse2;
        p.delta[row] = delta;
    }
}

// Kernel 2: one warp per key row (b, j, kv head), rows in [B, T, Hkv] order, so the keys with the
// most query rows after them start first.
template <typename Elem>
__device__ __forceinline__ void key_row(const GqaBwdParams& p, const WarpRow& w) {
    const int64_t b = w.b;
    const int lane = w.lane, j = w.t, kv_head = w.head;
    const bool bf16 = p.dtype == kGqaBFloat16;
    const int64_t kd = w.row * p.D;

    float k[kBwdLaneElems], v[kBwdLaneElems], dk[kBwdLaneElems], dv[kBwdLaneElems];
    float q[kBwdLaneElems], dout[kBwdLaneElems];
    load_row(k, static_cast<const Elem*>(p.k) + kd, p.D, lane, bf16);
    load_row(v, static_cast<const Elem*>(p.v) + kd, p.D, lane, bf16);
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) dk[e] = dv[e] = 0.f;

    // Summed in blocks of kBwdKeyBlock query times (times G heads) before joining dK and dV, so that
    // fp32's rounding grows with T / kBwdKeyBlock + kBwdKeyBlock G terms, not T G.
    float dk_block[kBwdLaneElems], dv_block[kBwdLaneElems];
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) dk_block[e] = dv_block[e] = 0.f;
    const GqaRange queries = p.geo.queries_any(j, j);   // the query rows that see key j
    for (int i = queries.first; i <= queries.last; ++i) {
        if ((i - queries.first) % kBwdKeyBlock == 0) {
#pragma unroll
            for (int e = 0; e < kBwdLaneElems; ++e) {
                dk[e] += dk_block[e], dv[e] += dv_block[e];
                dk_block[e] = dv_block[e] = 0.f;
            }
        }
        for (int g = 0; g < p.group; ++g) {
            const int64_t qrow = (b * p.T + i) * p.Hq + int64_t(kv_head) * p.group + g;
            load_row(q, static_cast<const Elem*>(p.q) + qrow * p.D, p.D, lane, bf16);
            load_row(dout, static_cast<const Elem*>(p.dout) + qrow * p.D, p.D, lane, bf16);
            const float s2 = dot(q, k) * p.scale_log2;
            const float dp = dot(dout, v);
            const float prob = exp2f(s2 - p.lse2[qrow]);
            const float ds = prob * (dp - p.delta[qrow]);
#pragma unroll
            for (int e = 0; e < kBwdLaneElems; ++e) {
                dv_block[e] = fmaf(prob, dout[e], dv_block[e]);
                dk_block[e] = fmaf(ds, q[e], dk_block[e]);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) dk[e] += dk_block[e], dv[e] += dv_block[e];
    store_row(static_cast<Elem*>(p.dk) + kd, dk, p.scale, p.D, lane, bf16);
    store_row(static_cast<Elem*>(p.dv) + kd, dv, 1.f, p.D, lane, bf16);
}

// The kernels: a CTA per unit of kBwdWarps rows; or, as the tensor-core plans' fallback
// (p.rows_if_nonfinite, kLoop), a grid of a few CTAs per SM walking the units, so that on finite
// inputs, where every CTA returns at once, the launch costs microseconds whatever the size (a CTA
// per unit measured 48 us at (1, 8192, 32, 8, 128); bench/NOTES.md v49).
// Four CTAs per SM (at most 64 registers): the non-finite rows' passes moved ptxas to 70-80 in
// three of the four kernels (64 before them), with 0 spills at 64.
template <typename Elem, bool kLoop>
__global__ void __launch_bounds__(32 * kBwdWarps, 4) gqa_bwd_query_kernel(const GqaBwdParams p) {
    if (p.rows_if_nonfinite && *p.nonfinite == 0) return;
    for (int64_t unit = blockIdx.x;; unit += gridDim.x) {
        const WarpRow w = warp_row(p.B, p.T, p.Hq, unit);
        if (!w.valid) return;
        query_row<Elem>(p, w);
        if (!kLoop) return;
    }
}

// Two CTAs per SM (at most 128 registers): the blocked sums of dK and dV took 109-113, where three
// (85) spilled 64-128 bytes.
template <typename Elem, bool kLoop>
__global__ void __launch_bounds__(32 * kBwdWarps, 2) gqa_bwd_key_kernel(const GqaBwdParams p) {
    if (p.rows_if_nonfinite && *p.nonfinite == 0) return;
    for (int64_t unit = blockIdx.x;; unit += gridDim.x) {
        const WarpRow w = warp_row(p.B, p.geo.Tk, p.Hkv, unit);
        if (!w.valid) return;
        key_row<Elem>(p, w);
        if (!kLoop) return;
    }
}

template <typename Elem, bool kLoop>
cudaError_t launch_backward_rows(const GqaBwdParams& p, cudaStream_t stream, int64_t max_ctas) {
    const int64_t query_units = (int64_t(p.B) * p.T * p.Hq + kBwdWarps - 1) / kBwdWarps;
    const int64_t key_units = (int64_t(p.B) * p.geo.Tk * p.Hkv + kBwdWarps - 1) / kBwdWarps;
    if (query_units > 0x7fffffff || key_units > 0x7fffffff) return cudaErrorInvalidConfiguration;
    if (query_units > 0)
        gqa_bwd_query_kernel<Elem, kLoop><<<unsigned(std::min(query_units, max_ctas)), 32 * kBwdWarps, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    if (key_units > 0)   // none where there are no keys (attention() with Tk = 0)
        gqa_bwd_key_kernel<Elem, kLoop><<<unsigned(std::min(key_units, max_ctas)), 32 * kBwdWarps, 0, stream>>>(p);
    return cudaGetLastError();
}

// Whether the element of w under the exponent mask `exp` is Inf or NaN: that field all ones.
__device__ __forceinline__ bool exp_all_ones(uint32_t w, uint32_t exp) { return (w & exp) == exp; }

// Whether any of the n elements at x (16-byte aligned: the binding's packed copies) is Inf or NaN,
// over this thread's share of the grid: 16-byte loads, kLoads in flight, then the last n % kVec
// elements one at a time. `exp` is the exponent mask of one element (an fp32's, or a 16-bit one's
// in the low half of a word).
template <typename Elem>
__device__ __forceinline__ bool any_nonfinite(const Elem* x, int64_t n, uint32_t exp, int64_t tid, int64_t threads) {
    using Bits = typename std::conditional<sizeof(Elem) == 4, uint32_t, uint16_t>::type;
    constexpr int kVec = 16 / sizeof(Elem), kLoads = 4;
    const uint32_t high = exp << 16;   // a 16-bit pair's second element
    const int64_t vecs = n / kVec;
    const uint4* body = reinterpret_cast<const uint4*>(x);
    bool bad = false;
    for (int64_t i = tid; i < vecs; i += kLoads * threads) {
        uint4 w[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) w[u] = i + u * threads < vecs ? __ldg(body + i + u * threads) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
            const uint32_t words[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) bad |= exp_all_ones(words[j], exp) | (sizeof(Elem) == 2 && exp_all_ones(words[j], high));
        }
    }
    const Bits* bits = reinterpret_cast<const Bits*>(x);
    for (int64_t i = vecs * kVec + tid; i < n; i += threads) bad |= exp_all_ones(bits[i], exp);
    return bad;
}

// Sets *p.nonfinite when q, k, v, o or dout holds Inf or NaN (the flag starts at zero). Each is
// contiguous ([B, T, H, D]).
template <typename Elem>
__global__ void __launch_bounds__(256) gqa_bwd_scan_kernel(const GqaBwdParams p) {
    const int64_t nq = int64_t(p.B) * p.T * p.Hq * p.D, nkv = int64_t(p.B) * p.geo.Tk * p.Hkv * p.D;
    const uint32_t exp = sizeof(Elem) == 4 ? 0x7f800000u : p.dtype == kGqaBFloat16 ? 0x7f80u : 0x7c00u;
    const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, threads = int64_t(gridDim.x) * blockDim.x;
    const bool bad = any_nonfinite(static_cast<const Elem*>(p.q), nq, exp, tid, threads) ||
                     any_nonfinite(static_cast<const Elem*>(p.o), nq, exp, tid, threads) ||
                     any_nonfinite(static_cast<const Elem*>(p.dout), nq, exp, tid, threads) ||
                     any_nonfinite(static_cast<const Elem*>(p.k), nkv, exp, tid, threads) ||
                     any_nonfinite(static_cast<const Elem*>(p.v), nkv, exp, tid, threads);
    if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) atomicOr(p.nonfinite, 1);
}

cudaError_t scan_nonfinite(const GqaBwdParams& p, cudaStream_t stream) {
    cudaError_t err = cudaMemsetAsync(p.nonfinite, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
    const int64_t vecs = int64_t(p.B) * p.T * p.Hq * p.D * (p.dtype == kGqaFloat32 ? 4 : 2) / 16 + 1;
    const int blocks = int(std::min<int64_t>((vecs + 255) / 256, 4096));
    if (p.dtype == kGqaFloat32) {
        gqa_bwd_scan_kernel<float><<<blocks, 256, 0, stream>>>(p);
    } else {
        gqa_bwd_scan_kernel<Half16><<<blocks, 256, 0, stream>>>(p);
    }
    return cudaGetLastError();
}

// The row-wise backward for any dtype and head_dim: the plan's own kernels, or the tensor-core
// plans' fallback (p.rows_if_nonfinite), four CTAs per SM walking the rows.
cudaError_t backward_rows(const GqaBwdParams& p, cudaStream_t stream) {
    if (p.rows_if_nonfinite) {
        int dev = 0;
        const cudaError_t err = cudaGetDevice(&dev);
        if (err != cudaSuccess) return err;
        const int64_t ctas = 4 * int64_t(sm_count(dev));
        return p.dtype == kGqaFloat32 ? launch_backward_rows<float, true>(p, stream, ctas)
                                      : launch_backward_rows<Half16, true>(p, stream, ctas);
    }
    return p.dtype == kGqaFloat32 ? launch_backward_rows<float, false>(p, stream, INT64_MAX)
                                  : launch_backward_rows<Half16, false>(p, stream, INT64_MAX);
}

}  // namespace
