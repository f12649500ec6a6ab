// The backward's tensor-core kernels for fp16 and bf16 at head_dim 64 and 128, over a products
// policy: mma.sync m16n8k16 (bwdmma/bwdmma.cu) or the sm_90a warpgroup wgmma (bwdwg/bwdwg.cu), both
// with fp32 accumulators in the same per-warp layout. Other shapes and fp32 take the row-wise
// backward (backward/backward.cu), which is also these units' reference in the tests. Tiles of 64 rows, 16 per warp; every sum runs in a fixed order (no atomics).
//  1. Query tiles (64 time steps of one query head). delta = rowsum(dO o). Pass 1 over the key
//     tiles the tile attends: S = Q K^T and the rows' log-sum-exp (lse2, base 2). Pass 2: S again,
//     P = 2^(S log2(e) / sqrt(D) - lse2), dP = dO V^T, dS = P (dP - delta), dQ += dS K. Writes dQ,
//     and lse2 and delta for kernel 2.
//  2. Key tiles (64 keys of one kv head). For every query tile at or after them and every head of
//     the group: S^T = K Q^T, P^T from lse2, dP^T = V dO^T, dS^T = P^T (dP^T - delta),
//     dV += P^T dO, dK += dS^T Q.
// The products go through the policy as issue / wait / settle, so on wgmma the softmax steps of a
// product's result run while the next product is in flight; only tiles on the diagonal or at the
// end of the sequence build masks.
// P and dS are rounded to the input dtype before their products, as in FlashAttention. A masked
// (future or padding) entry is a hard zero, but a tile product still multiplies it by the values
// of keys and queries the row does not attend, and 0 * Inf is NaN: so the kernels check their
// inputs as they go (kernel 1 q, dO and o; kernel 2 k and v, each element by one CTA), a hit sets
// p.nonfinite, and the row-wise kernels launched after them redo the call (attention.cu). Kernel
// 2 leaves at once when kernel 1 has set it.

#ifndef GQA_BWDMMA_KERNELS_CUH
#define GQA_BWDMMA_KERNELS_CUH

#include "common/wgmma.cuh"

namespace {

constexpr int kTile = 64;                  // rows of a tile, and columns of a step
// A step's last product (dQ, or dV and dK) left running into the next step, whose first products
// are issued behind it before the loads of the step after it (which reuse its stage) start:
// the tensor core need not idle over the step's barrier and copies (bench/NOTES.md v51: with
// cp.async from every thread the copies then started too late; v70: with TMA from one thread).
constexpr bool kBwdEarlyIssue = true;   // the 16-bit policies' Pol::kEarlyIssue
// The dK/dV kernel reads its step's lse2 and delta (one per query column, in shared memory) into
// registers before each product's wait, 16 a thread, instead of once per element after it: ncu
// put 25% of its warp samples on short-scoreboard waits, most at the exponentials' first use of a
// value just read (bench/NOTES.md v56).
constexpr bool kBwdStatsInRegs = true;
// With TMA loads (Pol::kTma) only the tiles a CTA copies once at its start (the dQ kernel's Q and
// dO, the dK/dV kernel's K and V) come by cp.async, through the generic proxy: their wait and the
// proxy fence (MEMBAR.ALL.CTA and FENCE.VIEW.ASYNC.S in the SASS) are needed before the first
// product alone. true: in every step, as before (bench/NOTES.md v78).
constexpr bool kBwdFenceEveryStep = false;
constexpr int kWarps = kTile / 16;         // one 16-row m-tile per warp
constexpr int kThreads = 32 * kWarps;

// Shared memory of the two kernels, from the products' tile size (Pol::kTileHalves 16-bit values;
// Pol::kAlign: the tiles' alignment, whose slack is added).
template <class Pol> struct BwdSmem {
    static constexpr int kSlack = Pol::kAlign > 16 ? Pol::kAlign : 0;
    static constexpr int kDq = (2 * Pol::kRowGroups + 4) * Pol::kTileHalves * 2 + kSlack;   // Q, dO (kRowGroups tiles each), 2 x (K, V)
    // K and V (Pol::kKeyGroups tiles each), 2 x (Q, dO, lse2, delta)
    static constexpr int kDkdv = (2 * Pol::kKeyGroups + 4) * Pol::kTileHalves * 2 + 2 * 2 * kTile * 4 + kSlack;
};

// Fragment coordinates of an m16n8 accumulator: element e of n-tile n sits in row
// (lane / 4) + 8 (e / 2) and column 8 n + 2 (lane % 4) + e % 2.
__device__ __forceinline__ int frag_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int frag_col(int lane, int n, int e) { return 8 * n + 2 * (lane & 3) + (e & 1); }
// This thread's query columns c = frag_col(lane, n, e) of a step's per-row statistic (lse2 or
// delta, in shared memory) into registers: column[n][e & 1] (kBwdStatsInRegs). kPaired: each
// pair as one 8-byte read (stat is 1024-byte aligned and the pair's first column even), which
// the compiler, not knowing that, makes two 4-byte ones (Pol::kPairedStats; bench/NOTES.md v81).
template <bool kPaired>
__device__ __forceinline__ void read_columns(float (&column)[kTile / 8][2], const float* stat, int lane) {
#pragma unroll
    for (int n = 0; n < kTile / 8; ++n) {
        const float2 pair = kPaired ? *reinterpret_cast<const float2*>(stat + frag_col(lane, n, 0))
                                    : make_float2(stat[frag_col(lane, n, 0)], stat[frag_col(lane, n, 1)]);
        column[n][0] = pair.x, column[n][1] = pair.y;
    }
}

// What a policy's kernels read besides their tiles' layout, once a CTA (Pol::io): the 16-bit
// policies read the inputs as they are; the x3 policy (bwdx3/) reads its pre-pass's fp16 hi and lo
// copies, scaled by powers of two, and undoes the scales with these numbers.
struct BwdIo {
    const uint16_t *q, *k, *v, *dout;   // the tiles' sources: [B, T, heads, Pol::kRowValues] 16-bit
    float scale_log2;                   // S (as the products give it) to log2 units
    float p_mul, ds_mul;                // P and dS times these before their products
    int e_delta;                        // delta times 2^e_delta: dP's units
    int e_dq, e_dk, e_dv;               // the accumulators (dQ and dK times 1 / sqrt(D)) times 2^e
    float* pk;                          // Pol::kDeltaFix: [B, T, Hq, D] fp32 rows of sum_j P_ij K_j
};
// The 16-bit policies' part of the interface: inputs as they are, fp16 or bf16 outputs.
template <bool kBf16> struct Bwd16BitIo {
    static constexpr int kDtype = kBf16 ? kGqaBFloat16 : kGqaFloat16;
    static constexpr bool kDeltaGiven = false;   // the dQ kernel computes delta from dO and o
    static constexpr int kFlushSteps = 0;        // the accumulators stay in registers to the end
    static constexpr int kDqFlushSteps = 0;
    static constexpr bool kDeltaFix = false;     // delta as the forward's rowsum(dO o), used as it is
    static constexpr int kPkFlushSteps = 0;
    static constexpr bool kEarlyIssue = kBwdEarlyIssue;
    static constexpr bool kPairedStats = true;    // read_columns
    static constexpr bool kFixedA = false;        // S's and dP's loop-invariant A from shared memory (bwdwg/bwdwg.cu)
    static constexpr int kDqCtas = 0;             // the dQ kernel's CTAs an SM asked of ptxas (0: none)
    static __device__ __forceinline__ BwdIo io(const GqaBwdParams& p) {
        return {static_cast<const uint16_t*>(p.q), static_cast<const uint16_t*>(p.k), static_cast<const uint16_t*>(p.v),
                static_cast<const uint16_t*>(p.dout), p.scale_log2, 1.f, 1.f, 0, 0, 0, 0};
    }
    using Out = uint16_t;   // the gradients' element
    // Two values of a gradient at `out` (the exponent is 0 here).
    static __device__ __forceinline__ void store2(Out* out, float a, float b, int) { store_pair(out, a, b, kBf16); }
};

// Pol::kDeltaFix (x3): delta = rowsum(dO o) comes from the forward's o, whose last bits need not
// match the P these kernels recompute; then sum_j dS_ij = c_i is not zero, and where a row's dQ is
// small by cancellation (a nearly one-hot softmax) c_i sum_j P_ij K_j shows in it many times
// magnified (bench/NOTES.md v74, v75). The dQ kernel, which sees every key of its rows, sums c_i
// from the dS it uses and, in a low-precision product (fp16, added into fp32 rows every
// Pol::kPkFlushSteps key tiles), sum_j P_ij K_j; at its end it takes ds_mul c_i sum_j P_ij K_j
// off dQ and writes delta + c_i for the dK/dV kernel, whose dS then sum to zero as well.
//
// Pol::kFlushSteps, kDqFlushSteps > 0 (fp32 outputs): every kFlushSteps steps (the dQ kernel:
// kDqFlushSteps key tiles) a kernel adds its accumulator into
// the gradient's fp32 rows (in fp32, rounded to nearest) and restarts it from zero. The tensor
// core's own additions do not round to nearest, and over the hundreds of steps of a long sequence
// their bias reached 4e-5 of dK and dV (bench/NOTES.md v71). out_row(half) is the thread's fp32 row
// of accumulator rows frag_row(lane, 2 half), or null past T; `first`: store instead of add. The
// adds are reductions in L2 (nothing comes back, so nothing waits for a load: v74); only this
// thread touches its rows, in program order, so the sums are the same on every run.
// Adds pair(n, half) (a float2 of the thread's accumulator, which pair zeroes) at each of its X
// n-tiles' columns of row out_row(half).
template <int X, class RowOf, class PairOf>
__device__ __forceinline__ void flush_pairs(const RowOf& out_row, int lane, bool first, const PairOf& pair) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float* row = out_row(half);
#pragma unroll
        for (int n = 0; n < X; ++n) {
            const float2 add = pair(n, half);
            if (row == nullptr) continue;
            float2* at = reinterpret_cast<float2*>(row + frag_col(lane, n, 0));
            if (first) __stcg(at, add);
            else atomicAdd(at, add);
        }
    }
}
template <int X, class RowOf>
__device__ __forceinline__ void flush_rows(float (&acc)[1][X][4], const RowOf& out_row, int lane, bool first) {
    flush_pairs<X>(out_row, lane, first, [&](int n, int half) {
        const float2 x = make_float2(acc[0][n][2 * half], acc[0][n][2 * half + 1]);
        acc[0][n][2 * half] = acc[0][n][2 * half + 1] = 0.f;
        return x;
    });
}
// flush_rows for an fp16 accumulator (wgmma's fp16 layout: register 2 n + h holds elements 2 h and
// 2 h + 1 of n-tile n).
template <int X, class RowOf>
__device__ __forceinline__ void flush_half_rows(uint32_t (&acc)[X][2], const RowOf& out_row, int lane, bool first) {
    flush_pairs<X>(out_row, lane, first, [&](int n, int half) {
        const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&acc[n][half]));
        acc[n][half] = 0u;
        return x;
    });
}
// The flushed sums back into the accumulator, before its last store.
template <int X, class RowOf>
__device__ __forceinline__ void take_back_rows(float (&acc)[1][X][4], const RowOf& out_row, int lane) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float* row = out_row(half);
        if (row == nullptr) continue;
#pragma unroll
        for (int n = 0; n < X; ++n) {
            const float2 was = __ldcg(reinterpret_cast<const float2*>(row + frag_col(lane, n, 0)));
            acc[0][n][2 * half] += was.x;
            acc[0][n][2 * half + 1] += was.y;
        }
    }
}

// sum + the dot product of two vectors of eight 16-bit values, in order, in fp32.
__device__ __forceinline__ float dot8_16bit(const uint4& x, const uint4& y, float sum, bool bf16) {
    const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        sum = fmaf(to_float(uint16_t(xs[j] & 0xffffu), bf16), to_float(uint16_t(ys[j] & 0xffffu), bf16), sum);
        sum = fmaf(to_float(uint16_t(xs[j] >> 16), bf16), to_float(uint16_t(ys[j] >> 16), bf16), sum);
    }
    return sum;
}

// Whether any of kTiles consecutive tiles of the policy (their 64 rows of Pol::kRowValues values, not
// the rows' padding) holds Inf or NaN, over the CTA's kThreadsN threads in 16-byte reads: with its exponent
// field masked out of a word, adding one at the field's lowest bit carries into the value's sign
// bit when the field is all ones, and only then (no carry crosses into the word's other value).
template <class Pol, int kTiles, int kThreadsN>
__device__ __forceinline__ bool tiles_nonfinite(const uint16_t* tiles, bool bf16) {
    constexpr int kChunks = Pol::kRowValues / 8, kRowHalves = Pol::kTileHalves / kTile;
    const uint32_t field = bf16 ? 0x7f807f80u : 0x7c007c00u, unit = bf16 ? 0x00800080u : 0x04000400u;
    uint32_t hit = 0;
#pragma unroll 4
    for (int i = int(threadIdx.x); i < kTiles * kTile * kChunks; i += kThreadsN) {
        const uint4 w = *reinterpret_cast<const uint4*>(tiles + (i / kChunks) * kRowHalves + (i % kChunks) * 8);
        hit |= ((w.x & field) + unit) | ((w.y & field) + unit) | ((w.z & field) + unit) | ((w.w & field) + unit);
    }
    return (hit & 0x80008000u) != 0;
}
// Raises p.nonfinite when any thread of the CTA saw Inf or NaN.
__device__ __forceinline__ void flag_nonfinite(const GqaBwdParams& p, bool bad) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(p.nonfinite, 1);
}

// Where query row t of (batch b, head h) keeps its lse2 and delta: [B, Hq, T64]
// (gqa_bwd_stat_floats), a query tile's 64 values in one contiguous run, rows past T zero.
__device__ __forceinline__ int64_t bwd_stat_row(int64_t b, int h, int t, const GqaBwdParams& p) {
    return (b * p.Hq + h) * ((int64_t(p.T) + 63) / 64 * 64) + t;
}

// A CTA's batch, head and tile index in a grid of tiles x B x `heads`, heads fastest.
struct BwdCta {
    int64_t b;
    int head, tile;
};
__device__ __forceinline__ BwdCta bwd_cta(int B, int heads) {
    const int64_t bh = blockIdx.x % (int64_t(B) * heads);
    return {bh / heads, int(bh % heads), int(blockIdx.x / (int64_t(B) * heads))};
}

}  // namespace

#include "bwdmma/query_tiles.cuh"   // kernel 1: dQ, lse2 and delta per query tile
#include "bwdmma/key_tiles.cuh"     // kernel 2: dK and dV per key tile, and the launch of both

#endif  // GQA_BWDMMA_KERNELS_CUH
