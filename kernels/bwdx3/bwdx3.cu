// The backward's x3 unit (sm_90a): fp32 at head_dim 64 and 128 as three fp16 wgmma products per
// product, a unit per width (GQA_WIDTH). Two pre-passes, then the two kernels of
// bwdmma/kernels.cuh over X3Products:
//  1. x3_bwd_absmax_kernel: the largest finite |x| of each of q, k, v and dO (each then scaled by
//     its own power of two 2^e, x3/rules.cuh's x3_exponent: the largest into [2^14, 2^15)), and
//     the flag for Inf and NaN.
//  2. x3_bwd_split_kernel: each scaled row as fp16 hi = fp16(x 2^e) and lo = fp16(x 2^e - hi) into
//     the scratch ([B, T, heads, 2 DP]: hi, then lo), delta = rowsum(dO o) in fp32, and the
//     largest row norms of the scaled dO, V and o (o in V's scale), which bound |dP - delta|.
//  3. x3_bwd_channel_max_kernel: the largest |x| of each (head, channel) of q, k and dO (zeroed by
//     pre-pass 1); then
//     x3_bwd_precision_kernel flags the call for the row-wise fp32 kernels (bit 4 of p.nonfinite,
//     which attention.cu launches after these) where one power of two per tensor cannot keep fp32's
//     precision: rows of dO, or (head, channel)s of q, k or dO, too far apart in size (the spans
//     below). Those calls take the row-wise kernels' time.
//  4. The dQ and dK/dV kernels read those rows as 128-byte-swizzled tiles of width 2 DP (hi in the
//     first DP columns): S and dP as lo hi + hi lo + hi hi (lo lo, about 2^-22 of a product, is
//     dropped); P (<= 1) times 2^kX3BwdPShift and dS times a power of two that puts the bound of
//     |dS| at 2^14 are split in registers the same way for dV, dK and dQ. The gradients leave
//     with every power of two undone (BwdIo).

#include "bwdmma/kernels.cuh"
#include "common/tma.cuh"
#include "x3/rules.cuh"

namespace {

constexpr float kX3BwdPShift = 14.f;   // P <= 1, times 2^14 before its split
constexpr int kX3BwdThreads = 256;
// The largest spans (log2 of the largest over the smallest nonzero maximum) kept on these kernels:
// of dO's rows, and of the (head, channel)s of q, k and dO. Past them the call is flagged. Chosen
// between the spans measured within 4x of fp32 SDPA's errors row by row and channel by channel
// (2^7) and those measured far outside (2^26); bench/NOTES.md says what is left to measure.
constexpr float kX3RowSpanLog2 = 12.f, kX3ChannelSpanLog2 = 17.f;

// The scratch (gqa_x3_bwd_floats): the statistics (zeroed on every call), the split rows, the dQ
// kernel's rows of sum_j P_ij K_j (X3Products::kDeltaFix), then the channels' maxima (zeroed by
// pre-pass 1). kRowMinDoutFlipped holds ~bits of the smallest nonzero row maximum, so that
// atomicMax finds it from zero (0: no nonzero row).
enum X3BwdStat { kAbsQ = 0, kAbsK, kAbsV, kAbsDout, kNormDout, kNormV, kNormO, kRowMaxDout, kRowMinDoutFlipped, kX3BwdStats };
struct X3BwdWork {
    uint32_t* stats;                  // [kX3BwdStats]: float bits of non-negative values
    uint16_t *q, *k, *v, *dout;       // [B, T, heads, 2 DP] fp16: hi, then lo
    float* pk;                        // [B, T, Hq, DP]: the dQ kernel's sum_j P_ij K_j (kDeltaFix)
};
__host__ __device__ inline X3BwdWork x3_bwd_work(const GqaBwdParams& p) {
    char* base = static_cast<char*>(p.work);
    const int64_t rows_q = int64_t(p.B) * p.T * p.Hq * 2 * p.D, rows_kv = int64_t(p.B) * p.T * p.Hkv * 2 * p.D;
    X3BwdWork w;
    w.stats = reinterpret_cast<uint32_t*>(base);
    w.q = reinterpret_cast<uint16_t*>(base + kGqaX3BwdStatsBytes);
    w.dout = w.q + rows_q;
    w.k = w.dout + rows_q;
    w.v = w.k + rows_kv;
    w.pk = reinterpret_cast<float*>(w.v + rows_kv);
    return w;
}
// [Hq + Hkv + Hq, D]: the largest |x| of each (head, channel) of q, k and dO, as float bits, past
// the rows of x3_bwd_work (the main loops never compute this address).
__device__ __forceinline__ uint32_t* x3_bwd_channels(const GqaBwdParams& p) {
    return reinterpret_cast<uint32_t*>(x3_bwd_work(p).pk + int64_t(p.B) * p.T * p.Hq * p.D);
}
// Tensor z (X3BwdStat kAbsQ .. kAbsDout) of the call, its heads and its split rows.
__device__ __forceinline__ const float* x3_bwd_input(const GqaBwdParams& p, int z) {
    return static_cast<const float*>(z == kAbsQ ? p.q : z == kAbsK ? p.k : z == kAbsV ? p.v : p.dout);
}
__device__ __forceinline__ int x3_bwd_heads(const GqaBwdParams& p, int z) { return z == kAbsK || z == kAbsV ? p.Hkv : p.Hq; }
__device__ __forceinline__ uint16_t* x3_bwd_rows(const X3BwdWork& w, int z) {
    return z == kAbsQ ? w.q : z == kAbsK ? w.k : z == kAbsV ? w.v : w.dout;
}

// Pre-pass 1. Grid (blocks, 4): blockIdx.y is the tensor.
__global__ void __launch_bounds__(kX3BwdThreads) x3_bwd_absmax_kernel(const GqaBwdParams p) {
    const X3BwdWork w = x3_bwd_work(p);
    const int z = int(blockIdx.y);
    if (blockIdx.x == 0 && z == 0) {   // the channels' maxima of pre-pass 3 start from zero
        uint32_t* chan = x3_bwd_channels(p);
        for (int64_t i = threadIdx.x; i < gqa_x3_bwd_channel_words(p); i += kX3BwdThreads) chan[i] = 0u;
    }
    const float4* x = reinterpret_cast<const float4*>(x3_bwd_input(p, z));
    const int64_t n4 = int64_t(p.B) * p.T * x3_bwd_heads(p, z) * p.D / 4;   // D is 64 or 128
    uint32_t m = 0u;
    bool bad = false;
    for (int64_t i = int64_t(blockIdx.x) * kX3BwdThreads + threadIdx.x; i < n4; i += int64_t(gridDim.x) * kX3BwdThreads) {
        const float4 v = __ldg(x + i);
        const float c[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bool finite = isfinite(c[j]);
            bad |= !finite;
            m = finite ? max(m, __float_as_uint(fabsf(c[j]))) : m;
        }
    }
    m = __reduce_max_sync(0xffffffffu, m);
    bad = __any_sync(0xffffffffu, bad);
    if (threadIdx.x % 32 == 0) {
        if (m != 0u) atomicMax(&w.stats[z], m);
        if (bad) atomicOr(p.nonfinite, 1);
    }
}

// Sum (and largest value) over the kLanes lanes that hold one row (aligned groups of a warp).
template <int kLanes> __device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int m = kLanes / 2; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
template <int kLanes> __device__ __forceinline__ float row_max(float x) {
#pragma unroll
    for (int m = kLanes / 2; m > 0; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
    return x;
}

// Pre-pass 2. Grid (blocks, 4): blockIdx.y is the tensor; a row is DP / 4 lanes, a float4 each.
template <int DP>
__global__ void __launch_bounds__(kX3BwdThreads) x3_bwd_split_kernel(const GqaBwdParams p) {
    constexpr int kLanes = DP / 4, kRowsPerWarp = 32 / kLanes;
    const X3BwdWork w = x3_bwd_work(p);
    const int z = int(blockIdx.y), heads = x3_bwd_heads(p, z), lane = int(threadIdx.x) % 32, sub = lane % kLanes;
    const float* x = x3_bwd_input(p, z);
    uint16_t* dst = x3_bwd_rows(w, z);
    const int e = x3_exponent(w.stats[z]), e_v = x3_exponent(w.stats[kAbsV]);
    const int64_t rows = int64_t(p.B) * p.T * heads;
    const int64_t warps = int64_t(gridDim.x) * (kX3BwdThreads / 32);
    float norm2 = 0.f, o_norm2 = 0.f;   // largest squared row norms, scaled (z = dO: and of o)
    float row_hi = 0.f, row_lo = INFINITY;   // z = dO: the largest and the smallest nonzero row maximum
    // Warp-uniform rounds, so that every lane takes part in the row sums' shuffles.
    for (int64_t r0 = (int64_t(blockIdx.x) * (kX3BwdThreads / 32) + threadIdx.x / 32) * kRowsPerWarp; r0 < rows;
         r0 += warps * kRowsPerWarp) {
        const int64_t r = r0 + lane / kLanes;
        const bool valid = r < rows;
        const float4 v = valid ? __ldg(reinterpret_cast<const float4*>(x + r * DP) + sub) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float a[4] = {x3_scale(v.x, e), x3_scale(v.y, e), x3_scale(v.z, e), x3_scale(v.w, e)};
        uint32_t hi[2], lo[2];
        x3_split2(a[0], a[1], hi[0], lo[0]);
        x3_split2(a[2], a[3], hi[1], lo[1]);
        if (valid) {
            uint16_t* row = dst + r * (2 * DP) + 4 * sub;
            *reinterpret_cast<uint2*>(row) = make_uint2(hi[0], hi[1]);
            *reinterpret_cast<uint2*>(row + DP) = make_uint2(lo[0], lo[1]);
        }
        if (z == kAbsV || z == kAbsDout) norm2 = fmaxf(norm2, row_sum<kLanes>(a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3]));
        if (z == kAbsDout) {   // the row's largest |dO|, its delta, and the scaled norm of its o
            // (fmaxf drops NaN; Inf flags the call anyway)
            const float m = row_max<kLanes>(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            row_hi = fmaxf(row_hi, m);
            row_lo = m > 0.f ? fminf(row_lo, m) : row_lo;
            const float4 o = valid ? __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p.o) + r * DP) + sub)
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
            const float delta = row_sum<kLanes>(v.x * o.x + v.y * o.y + v.z * o.z + v.w * o.w);
            const float b[4] = {x3_scale(o.x, e_v), x3_scale(o.y, e_v), x3_scale(o.z, e_v), x3_scale(o.w, e_v)};
            o_norm2 = fmaxf(o_norm2, row_sum<kLanes>(b[0] * b[0] + b[1] * b[1] + b[2] * b[2] + b[3] * b[3]));
            if (valid && sub == 0) {
                const int h = int(r % heads), t = int(r / heads % p.T);
                p.delta[bwd_stat_row(r / heads / p.T, h, t, p)] = delta;
            }
        }
    }
    // Non-finite rows (flagged by pre-pass 1) make NaN norms, which fmaxf drops; the call then
    // takes the row-wise kernels anyway.
    if (z == kAbsV || z == kAbsDout) {
        norm2 = __reduce_max_sync(0xffffffffu, __float_as_uint(norm2)) == 0u ? 0.f
                                                                            : __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(norm2)));
        if (lane == 0 && norm2 > 0.f) atomicMax(&w.stats[z == kAbsV ? kNormV : kNormDout], __float_as_uint(norm2));
    }
    if (z == kAbsDout) {
        o_norm2 = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(o_norm2)));
        if (lane == 0 && o_norm2 > 0.f) atomicMax(&w.stats[kNormO], __float_as_uint(o_norm2));
        const uint32_t hi = __reduce_max_sync(0xffffffffu, __float_as_uint(row_hi));
        const uint32_t lo_flipped = __reduce_max_sync(0xffffffffu, ~__float_as_uint(row_lo));   // ~bits of +inf: none
        if (lane == 0 && hi != 0u) atomicMax(&w.stats[kRowMaxDout], hi);
        if (lane == 0 && lo_flipped != ~__float_as_uint(INFINITY)) atomicMax(&w.stats[kRowMinDoutFlipped], lo_flipped);
    }
}

// Pre-pass 3. The largest |x| of each (head, channel) of q, k and dO. Grid (chunks, heads, 3):
// blockIdx.z is the tensor (q, k, dO), blockIdx.y the first head; a block takes every
// gridDim.x-th group of kRowsAtOnce (batch, time) rows of its heads, a float4 of channels a thread.
template <int DP>
__global__ void __launch_bounds__(kX3BwdThreads) x3_bwd_channel_max_kernel(const GqaBwdParams p) {
    constexpr int kCols = DP / 4, kRowsAtOnce = kX3BwdThreads / kCols;
    const int z = blockIdx.z == 0 ? kAbsQ : blockIdx.z == 1 ? kAbsK : kAbsDout;
    const int heads = x3_bwd_heads(p, z), col = int(threadIdx.x) % kCols, sub = int(threadIdx.x) / kCols;
    const float* x = x3_bwd_input(p, z);
    uint32_t* chan = x3_bwd_channels(p) + (z == kAbsQ ? 0 : z == kAbsK ? int64_t(p.Hq) * DP : int64_t(p.Hq + p.Hkv) * DP);
    const int64_t rows = int64_t(p.B) * p.T;
    __shared__ float most[kX3BwdThreads][4];
    for (int h = int(blockIdx.y); h < heads; h += int(gridDim.y)) {   // block-uniform
        float m[4] = {0.f, 0.f, 0.f, 0.f};   // fmaxf drops NaN; Inf flags the call anyway
        for (int64_t r = int64_t(blockIdx.x) * kRowsAtOnce + sub; r < rows; r += int64_t(gridDim.x) * kRowsAtOnce) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(x + (r * heads + h) * DP) + col);
            m[0] = fmaxf(m[0], fabsf(v.x)), m[1] = fmaxf(m[1], fabsf(v.y));
            m[2] = fmaxf(m[2], fabsf(v.z)), m[3] = fmaxf(m[3], fabsf(v.w));
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) most[threadIdx.x][i] = m[i];
        __syncthreads();
        if (sub == 0) {
            for (int s = 1; s < kRowsAtOnce; ++s)
#pragma unroll
                for (int i = 0; i < 4; ++i) m[i] = fmaxf(m[i], most[s * kCols + col][i]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (m[i] > 0.f) atomicMax(&chan[int64_t(h) * DP + 4 * col + i], __float_as_uint(m[i]));
        }
        __syncthreads();   // `most` is written again for the next head
    }
}

// log2 of the largest over the smallest nonzero maximum (0 where there is no nonzero one).
__device__ __forceinline__ float x3_span_log2(uint32_t hi, uint32_t lo_flipped) {
    if (hi == 0u || lo_flipped == 0u) return 0.f;
    return log2f(__uint_as_float(hi)) - log2f(__uint_as_float(~lo_flipped));
}

// After the pre-passes: flags the call (bit 4 of *p.nonfinite) for the row-wise kernels where the
// spans of dO's rows or of a tensor's (head, channel)s pass kX3RowSpanLog2 or kX3ChannelSpanLog2.
// One CTA.
template <int DP>
__global__ void __launch_bounds__(kX3BwdThreads) x3_bwd_precision_kernel(const GqaBwdParams p) {
    const X3BwdWork w = x3_bwd_work(p);
    const uint32_t* chan = x3_bwd_channels(p);
    __shared__ uint32_t hi[3], lo_flipped[3];
    if (threadIdx.x < 3) hi[threadIdx.x] = 0u, lo_flipped[threadIdx.x] = 0u;
    __syncthreads();
    const int64_t counts[3] = {int64_t(p.Hq) * DP, int64_t(p.Hkv) * DP, int64_t(p.Hq) * DP};
    int64_t first = 0;
    for (int t = 0; t < 3; ++t) {
        uint32_t most = 0u, least_flipped = 0u;
        for (int64_t i = threadIdx.x; i < counts[t]; i += kX3BwdThreads) {
            const uint32_t bits = chan[first + i];
            most = max(most, bits);
            least_flipped = bits != 0u ? max(least_flipped, ~bits) : least_flipped;
        }
        atomicMax(&hi[t], most);
        atomicMax(&lo_flipped[t], least_flipped);
        first += counts[t];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bool uneven = x3_span_log2(w.stats[kRowMaxDout], w.stats[kRowMinDoutFlipped]) > kX3RowSpanLog2;
        for (int t = 0; t < 3; ++t) uneven |= x3_span_log2(hi[t], lo_flipped[t]) > kX3ChannelSpanLog2;
        if (uneven) atomicOr(p.nonfinite, 4);
    }
}

// The products policy of bwdmma/kernels.cuh for the split rows: wgmma from 128-byte-swizzled tiles
// of width 2 DP (hi, then lo), loads by TMA as WgProducts's (BwdTmaLoads).
template <int DP_> struct X3Products : BwdTmaLoads<kTile, 2 * DP_> {
    static constexpr bool kBf16 = false;   // the split rows are fp16
    static constexpr int kDtype = kGqaFloat32;
    static constexpr int DP = DP_, kRowValues = 2 * DP, kTileHalves = kTile * 2 * DP, kAlign = 1024, kOut = DP;
    static constexpr bool kDeltaGiven = true, kTma = true;
    // The accumulators into the fp32 rows of dK and dV every 4 steps, of dQ every 2 key tiles
    // (bwdmma/kernels.cuh, flush_rows; bench/NOTES.md v72, v74): 12 wgmma additions a step, each
    // truncating, so at most 48 and 24 of them between additions rounded to nearest.
    static constexpr int kFlushSteps = 4, kDqFlushSteps = 2;
    // The next step's products are not issued behind this step's last one (kBwdEarlyIssue): with
    // one warpgroup an SM at width 128 that lost 1.2x here (v74).
    static constexpr bool kEarlyIssue = false;
    static constexpr bool kFixedA = false;   // (bwdwg/bwdwg.cu)
    static constexpr int kDqCtas = 0;        // (bwdmma/kernels.cuh)
    static constexpr bool kDeltaFix = true;   // (bwdmma/kernels.cuh)
    // sum_j P_ij K_j needs about 1e-3 of its size (c_i is about 1e-6 of the row's scale): 32
    // truncating fp16 additions between fp32 ones leave it within 3% (bench/NOTES.md v76).
    static constexpr int kPkFlushSteps = 8;
    // lse2 and delta by 4-byte reads (read_columns): at width 128 (255 registers) the pairs brought
    // a spill load back into the dK/dV kernel's step loop (bench/NOTES.md v81).
    static constexpr bool kPairedStats = false;
    static constexpr int kKeyGroups = 1, kRowGroups = 1;
    static constexpr int kLoHalves = DP / 64 * kTile * 64;   // a tile's lo part, past its hi part
    using Out = float;
    static __device__ __forceinline__ const uint16_t* columns(const uint16_t* tile, int col0) { return tile + (col0 / 64) * kTile * 64; }
    static __device__ __forceinline__ uint16_t* aligned(uint16_t* smem) {
        const uint32_t misaligned = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) & (kAlign - 1);
        return smem + ((kAlign - misaligned) & (kAlign - 1)) / 2;
    }
    static __device__ __forceinline__ void load(uint16_t* tile, const uint16_t* base, int64_t b, int row0, int head,
                                                int heads, int T) {
        swizzled_load<2 * DP, kTile, kThreads>(tile, base, b, row0, head, heads, T);
    }
    static __device__ __forceinline__ void landed() { fence_async_proxy(); }
    static cudaError_t make_maps(const GqaBwdParams& p, typename BwdTmaLoads<kTile, 2 * DP_>::Maps* m) {
        const X3BwdWork w = x3_bwd_work(p);
        return BwdTmaLoads<kTile, 2 * DP_>::make_maps_of(p, {w.q, w.dout, w.k, w.v}, false, m);
    }
    // The scale factors, from the pre-passes' statistics (see the file's comment).
    static __device__ __forceinline__ BwdIo io(const GqaBwdParams& p) {
        const X3BwdWork w = x3_bwd_work(p);
        const int e_q = x3_exponent(w.stats[kAbsQ]), e_k = x3_exponent(w.stats[kAbsK]);
        const int e_v = x3_exponent(w.stats[kAbsV]), e_do = x3_exponent(w.stats[kAbsDout]);
        // |dP - delta| <= |dO| (|V| + |o|) row by row, in the scaled units.
        const float bound = sqrtf(__uint_as_float(w.stats[kNormDout])) *
                            (sqrtf(__uint_as_float(w.stats[kNormV])) + sqrtf(__uint_as_float(w.stats[kNormO])));
        const int e_ds = bound > 0.f ? 14 - int(ceilf(log2f(bound))) : 0;
        BwdIo io;
        io.q = w.q, io.k = w.k, io.v = w.v, io.dout = w.dout;
        io.scale_log2 = ldexpf(p.scale_log2, -(e_q + e_k));
        io.p_mul = exp2f(kX3BwdPShift);
        io.ds_mul = ldexpf(1.f, e_ds);
        io.e_delta = e_do + e_v;
        io.e_dq = -(e_do + e_v + e_ds + e_k);
        io.e_dk = -(e_do + e_v + e_ds + e_q);
        io.e_dv = -(int(kX3BwdPShift) + e_do);
        io.pk = w.pk;
        return io;
    }
    static __device__ __forceinline__ void store2(Out* out, float a, float b, int e) {
        *reinterpret_cast<float2*>(out) = make_float2(ldexpf(a, e), ldexpf(b, e));
    }
    // s = A B^T over the split rows: the two small terms first, then hi hi, as one commit group.
    static __device__ __forceinline__ void qk_issue(float (&s)[1][kTile / 8][4], const uint16_t* a, const uint16_t* b, int, int) {
        qk_wgmma<false, DP, kTile, kTile>(s[0], a + kLoHalves, 0, b);
        qk_wgmma<false, DP, kTile, kTile>(s[0], a, 0, b + kLoHalves, true);
        qk_wgmma<false, DP, kTile, kTile>(s[0], a, 0, b, true);
        wg_commit();
    }
    // o += (s mult) B, s mult split into hi (into pa) and lo A fragments, as one commit group.
    static __device__ __forceinline__ void pv_issue(float (&o)[1][kOut / 8][4], uint32_t (&pa)[kTile / 16][4],
                                                    const float (&s)[1][kTile / 8][4], const uint16_t* b, int, float mult) {
        uint32_t lo[kTile / 16][4];
#pragma unroll
        for (int ks = 0; ks < kTile / 16; ++ks) {
            x3_split2(s[0][2 * ks][0] * mult, s[0][2 * ks][1] * mult, pa[ks][0], lo[ks][0]);
            x3_split2(s[0][2 * ks][2] * mult, s[0][2 * ks][3] * mult, pa[ks][1], lo[ks][1]);
            x3_split2(s[0][2 * ks + 1][0] * mult, s[0][2 * ks + 1][1] * mult, pa[ks][2], lo[ks][2]);
            x3_split2(s[0][2 * ks + 1][2] * mult, s[0][2 * ks + 1][3] * mult, pa[ks][3], lo[ks][3]);
        }
        pv_wgmma<false, kOut, kTile>(o[0], lo, b);
        pv_wgmma<false, kOut, kTile>(o[0], pa, b + kLoHalves);
        pv_wgmma<false, kOut, kTile>(o[0], pa, b);
        wg_commit();
    }
    // pk += P K, P as fp16 A fragments, K's hi columns (`b`), an fp16 accumulator; one commit group.
    static __device__ __forceinline__ void pk_issue(uint32_t (&pk)[kOut / 8][2], const uint32_t (&pf)[kTile / 16][4],
                                                    const uint16_t* b) {
        pv_wgmma_f16acc<kOut, kTile, kTile / 16>(pk, pf, b);
        wg_commit();
    }
    template <int N> static __device__ __forceinline__ void wait() { wg_wait<N>(); }
    template <int X> static __device__ __forceinline__ void settle(float (&r)[1][X][4]) {
        fence_regs(reinterpret_cast<float(&)[X * 4]>(r));
    }
};

static_assert(GQA_DTYPE == kGqaFloat32 && (GQA_WIDTH == 64 || GQA_WIDTH == 128), "a unit for fp32 at width 64 or 128");

}  // namespace

extern "C" int gqa_launch_bwdx3(const GqaBwdParams* params, void* stream) {
    const GqaBwdParams& p = *params;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return int(err);
    if (p.dtype != kGqaFloat32 || p.D != GQA_WIDTH || p.work == nullptr) return int(cudaErrorInvalidValue);
    err = cudaMemsetAsync(x3_bwd_work(p).stats, 0, kX3BwdStats * sizeof(uint32_t), s);
    if (err != cudaSuccess) return int(err);
    const int64_t rows = int64_t(p.B) * p.T * p.Hq;   // the most rows of the four tensors
    const unsigned absmax_blocks = unsigned(std::min<int64_t>((rows * p.D / 4 + kX3BwdThreads - 1) / kX3BwdThreads, 1024));
    const unsigned split_blocks = unsigned(std::min<int64_t>((rows * (p.D / 4) + kX3BwdThreads - 1) / kX3BwdThreads, 4096));
    x3_bwd_absmax_kernel<<<dim3(absmax_blocks, 4), kX3BwdThreads, 0, s>>>(p);
    x3_bwd_split_kernel<GQA_WIDTH><<<dim3(split_blocks, 4), kX3BwdThreads, 0, s>>>(p);
    // chunks of each head's (batch, time) rows: at least 64 rows a thread group, at most 64 chunks
    const int64_t bt = int64_t(p.B) * p.T, at_once = kX3BwdThreads / (GQA_WIDTH / 4);
    const unsigned chunks = unsigned(std::max<int64_t>(1, std::min<int64_t>((bt + 64 * at_once - 1) / (64 * at_once), 64)));
    x3_bwd_channel_max_kernel<GQA_WIDTH><<<dim3(chunks, unsigned(std::min(p.Hq, 65535)), 3), kX3BwdThreads, 0, s>>>(p);
    x3_bwd_precision_kernel<GQA_WIDTH><<<1, kX3BwdThreads, 0, s>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return int(err);
    return int(bwd_launch<X3Products<GQA_WIDTH>>(p, s, dev));
}
