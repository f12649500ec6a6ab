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

// Kernel 1: one CTA per (query tile, batch, head); the tiles with the most keys start first. A
// query tile is Pol::kRowGroups groups of 64 rows, one a warpgroup (kThreads threads), which share
// each key tile's copies.
// kStats: pass 1 and delta only (lse2 and delta for a kernel that computes dQ itself).
template <class Pol, bool kStats = false>
__global__ void __launch_bounds__(kThreads * Pol::kRowGroups, Pol::kDqCtas) gqa_bwd_dq_kernel(const GqaBwdParams p, const __grid_constant__ typename Pol::Maps maps) {
    constexpr bool kBf16 = Pol::kBf16;
    constexpr int DP = Pol::DP, H = Pol::kTileHalves, OUT = Pol::kOut, RG = Pol::kRowGroups;
    const int col0 = OUT == DP ? 0 : int(blockIdx.y) * OUT;   // this CTA's dQ columns (OUT < DP: a grid of DP / OUT)
    extern __shared__ __align__(16) uint16_t smem_raw[];
    uint16_t* smem = Pol::aligned(smem_raw);
    // Q and dO (a tile per group), then two stages of (K, V): pass 1 alternates K between the first
    // stage's two tiles, pass 2 alternates whole stages.
    uint16_t *q_tiles = smem, *do_tiles = smem + RG * H;
    auto k_of = [&](int st) { return smem + (2 * RG + 2 * st) * H; };
    auto v_of = [&](int st) { return smem + (2 * RG + 1 + 2 * st) * H; };

    const BwdCta cta = bwd_cta(p.B, p.Hq);
    const int64_t b = cta.b;
    const int h = cta.head, kv_head = h / p.group, lane = threadIdx.x % 32;
    // This thread's row group (a constant 0 with one group, so that the tiles' addresses and the
    // wgmma descriptors built from them stay uniform: bench/NOTES.md v79), warp in it.
    const int wg = RG == 1 ? 0 : int(threadIdx.x) / kThreads, warp = int(threadIdx.x) % kThreads / 32;
    const bool loader = int(threadIdx.x) < kThreads;   // the first group's threads make the cp.async copies
    const int tiles = (p.T + kTile - 1) / kTile, ctiles = (tiles + RG - 1) / RG;
    const int qt_cta = (ctiles - 1 - cta.tile) * RG, kt_last = min(qt_cta + RG, tiles) - 1;   // the CTA's first query tile, last key tile
    const int qt = qt_cta + wg, q0 = qt * kTile;   // this group's query tile (past the last one: rows past T)
    uint16_t *q_tile = q_tiles + wg * H, *do_tile = do_tiles + wg * H;
    const bool bf16 = kBf16;
    const BwdIo io = Pol::io(p);
    const uint16_t *k_in = io.k, *v_in = io.v;
    // Pol::kTma: pass 2's K and V tiles come by TMA, issued by thread 0, and land on their stage's
    // barrier (phase k: the stage's k-th tile).
    constexpr bool kTmaKv = Pol::kTma && !kStats;
    __shared__ uint64_t landed_bar[2];
    if constexpr (kTmaKv) {
        if (threadIdx.x == 0) Pol::init_landed(landed_bar);
        __syncthreads();
    }
    // Key tile kt of pass 2 into stage st.
    auto load_kv_tile = [&](int kt, int st) {
        if constexpr (kTmaKv) {
            if (threadIdx.x == 0) Pol::load_kv(maps, k_of(st), v_of(st), &landed_bar[st], b, kt * kTile, kv_head);
        } else if (loader) {
            Pol::load(k_of(st), k_in, b, kt * kTile, kv_head, p.Hkv, p.T);
            Pol::load(v_of(st), v_in, b, kt * kTile, kv_head, p.Hkv, p.T);
        }
    };

    if (loader)
        for (int g = 0; g < RG; ++g) {
            Pol::load(q_tiles + g * H, io.q, b, (qt_cta + g) * kTile, h, p.Hq, p.T);
            Pol::load(do_tiles + g * H, io.dout, b, (qt_cta + g) * kTile, h, p.Hq, p.T);
        }
    cp_async_commit();
    // Pass 2's first K and V (stage 1, which pass 1 leaves alone), landed by pass 1's first wait.
    if (!kStats) load_kv_tile(0, 1);
    cp_async_commit();

    // delta of this lane's two rows (every lane of a quad computes the same value).
    float delta[2], lse2[2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        float sum = 0.f;
        if constexpr (Pol::kDeltaGiven) {   // by the policy's pre-pass, in the input's units
            if (t < p.T) sum = ldexpf(p.delta[bwd_stat_row(b, h, t, p)], io.e_delta);
        } else if (t < p.T) {   // the quad's row in 16-byte reads, lane l of the quad chunks l, l + 4, ..
            const int64_t row = ((b * p.T + t) * p.Hq + h) * int64_t(DP);
            const uint4* dout_row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.dout) + row);
            const uint4* o_row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.o) + row);
            uint4 x[DP / 32], y[DP / 32];
#pragma unroll
            for (int i = 0; i < DP / 32; ++i) x[i] = __ldg(dout_row + (lane & 3) + 4 * i), y[i] = __ldg(o_row + (lane & 3) + 4 * i);
#pragma unroll
            for (int i = 0; i < DP / 32; ++i) sum = dot8_16bit(x[i], y[i], sum, bf16);
        }
        if constexpr (!Pol::kDeltaGiven) {
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        }
        delta[half] = sum;
    }

    // The forward's log-sum-exp of these rows, when it kept a number for every one of them: then
    // pass 1 has nothing to do (its loop runs to -1; a branch around products would serialise them).
    float given[2] = {0.f, 0.f};
    bool kept = p.lse2_in != nullptr;
    if (kept) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
            if (t < p.T) given[half] = p.lse2_in[(b * p.T + t) * p.Hq + h];
            kept = kept && isfinite(given[half]);
        }
    }
    kept = __syncthreads_and(kept);
    const int pass1_last = kept ? -1 : kt_last;

    // Only the group's diagonal tile (kt == qt, which is also the one holding keys past T) and, for
    // an earlier group, the CTA's tiles after it (every key masked) mask.
    auto masked = [&](int kt, int n, int e) {
        const int t = q0 + 16 * warp + frag_row(lane, e), j = kt * kTile + frag_col(lane, n, e);
        return j > t || j >= p.T;
    };

    // Pass 1: the rows' maximum and sum, online over the key tiles. K tile kt lands in stage 0's
    // K (kt even) or V tile (kt odd) while the tile before it is in use.
    auto k_stage = [&](int kt) { return kt & 1 ? v_of(0) : k_of(0); };
    if (!kept && loader) Pol::load(k_stage(0), k_in, b, 0, kv_head, p.Hkv, p.T);   // (pass 2 refills stage 0 at once)
    cp_async_commit();
    for (int kt = 0; kt <= pass1_last; ++kt) {
        if (kt < kt_last && loader) Pol::load(k_stage(kt + 1), k_in, b, (kt + 1) * kTile, kv_head, p.Hkv, p.T);
        cp_async_commit();    // (empty on the last tile)
        cp_async_wait<1>();   // everything but the tile just issued has landed
        Pol::landed();
        __syncthreads();
        float s[1][kTile / 8][4];
        Pol::qk_issue(s, q_tile, k_stage(kt), warp, lane);
        Pol::template wait<0>();
        Pol::settle(s);
        const bool edge = kt >= qt;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e) {
                    s[0][n][e] = edge && masked(kt, n, e) ? -INFINITY : s[0][n][e] * io.scale_log2;
                    tile_max = fmaxf(tile_max, s[0][n][e]);
                }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float m_new = fmaxf(m[half], tile_max);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e)
                    sum += s[0][n][e] == -INFINITY ? 0.f : fast_exp2(s[0][n][e] - m_new);
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l[half] = (m[half] == -INFINITY ? 0.f : l[half] * fast_exp2(m[half] - m_new)) + sum;
            m[half] = m_new;
        }
        __syncthreads();   // this tile takes tile kt + 2, issued at the top of the next iteration
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) lse2[half] = kept ? given[half] : m[half] + log2f(l[half]);

    // Pass 2: dQ. Key tile kt sits in stage (kt + 1) % 2; the next one loads during this one.
    float dq[1][OUT / 8][4] = {};
    // Pol::kDqFlushSteps: this thread's fp32 rows of dQ (flushed after key tiles kDqFlushSteps - 1,
    // 2 kDqFlushSteps - 1, ..).
    auto row_of = [&](float* rows, int half) -> float* {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        return t < p.T ? rows + ((b * p.T + t) * p.Hq + h) * DP + col0 : nullptr;
    };
    auto dq_row = [&](int half) { return row_of(reinterpret_cast<float*>(p.dq), half); };
    // Pol::kDeltaFix: this thread's part of c (its two rows' sums of dS over its columns), and
    // sum_j P_ij K_j in fp16, flushed with dQ into the fp32 rows io.pk.
    float ds_sum[2] = {0.f, 0.f};
    uint32_t pk[Pol::kDeltaFix ? OUT / 8 : 1][2] = {};
    auto pk_row = [&](int half) { return row_of(io.pk, half); };
    // dQ's products (and P K, committed before them) have completed: their registers may be read.
    auto settle_dq = [&] {
        Pol::settle(dq);
        if constexpr (Pol::kDeltaFix) fence_regs(reinterpret_cast<uint32_t(&)[OUT / 4]>(pk));
    };
    auto load_kv = [&](int kt) {   // key tile kt + 1 into the other stage
        if (kt < kt_last) load_kv_tile(kt + 1, ((kt + 1) & 1) ^ 1);
        cp_async_commit();    // (empty on the last tile)
    };
    // Pol::kFixedA: the group's Q and dO rows as register A operands, read once before the loop
    // and on every path (read inside it at the first key tile only, the registers had no value on
    // the later tiles' path).
    uint32_t qa[Pol::kFixedA ? DP / 16 : 1][4], doa[Pol::kFixedA ? DP / 16 : 1][4];
    const uint32_t a_zero = uint32_t(p.dtype) >> 8;   // 0 (Pol::settle_a)
    if constexpr (Pol::kFixedA) {
        if (!kStats) {
            cp_async_wait<0>();   // Q and dO (and a first K and V by cp.async, which the loop waits for anyway)
            __syncthreads();
            Pol::load_a(qa, q_tile, warp, lane);
            Pol::load_a(doa, do_tile, warp, lane);
        }
    }
    for (int kt = 0; kt <= (kStats ? -1 : kt_last); ++kt) {
        const int st = (kt + 1) & 1;
        if (!Pol::kEarlyIssue && !kTmaKv) load_kv(kt);
        if (!kTmaKv || kBwdFenceEveryStep || kt == 0) {
            cp_async_wait<Pol::kEarlyIssue || kTmaKv ? 0 : 1>();   // key tile kt has landed (kTma: Q and dO)
            Pol::landed();
        }
        // (kTma with Pol::kEarlyIssue: only Q and dO need it, and the tile's stage was freed by the
        // barrier in the middle of the tile before)
        if (!(kTmaKv && Pol::kEarlyIssue) || kt == 0) __syncthreads();
        if constexpr (kTmaKv) Pol::await_step(&landed_bar[st], uint32_t((kt >> 1) & 1));
        float s[1][kTile / 8][4], dp[1][kTile / 8][4];
        if constexpr (Pol::kFixedA) Pol::qk_issue_rs(s, qa, k_of(st));
        else Pol::qk_issue(s, q_tile, k_of(st), warp, lane);
        // kDpLate: dP issued after the last tile's dQ product has completed (S queued behind it
        // keeps the tensor pipe busy), so that dQ's A fragments are dead before dP's accumulators
        // are live: 16 registers fewer at the peak with dO's fragments held too.
        constexpr bool kDpLate = Pol::kFixedA && Pol::kEarlyIssue;
        auto issue_dp = [&] {
            if constexpr (Pol::kFixedA) Pol::qk_issue_rs(dp, doa, v_of(st));
            else Pol::qk_issue(dp, do_tile, v_of(st), warp, lane);
        };
        if constexpr (!kDpLate) issue_dp();
        // kTma: tile kt + 1 goes out under the products (its stage was freed by the barrier that
        // ended tile kt - 1; with Pol::kEarlyIssue by the one below).
        if constexpr (kTmaKv && !Pol::kEarlyIssue) load_kv(kt);
        if (Pol::kEarlyIssue) {
            Pol::template wait<kDpLate ? 1 : 2>();   // the last tile's dQ product: its stage is free
            settle_dq();
            if constexpr (kDpLate) issue_dp();
            __syncthreads();
            load_kv(kt);
        }
        Pol::template wait<1>();   // S; dP still running
        Pol::settle(s);
        if constexpr (Pol::kFixedA) Pol::settle_a(qa, a_zero);
        // P for every element, then the masked ones zeroed on the diagonal tile alone (with the
        // mask in the same expression the compiler tested it, and reloaded scale_log2, for every
        // element of every tile: bench/NOTES.md v63).
        const float scale_log2 = io.scale_log2;
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = fast_exp2(s[0][n][e] * scale_log2 - lse2[e >> 1]);   // P
        if (kt >= qt) {
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (masked(kt, n, e)) s[0][n][e] = 0.f;
        }
        if constexpr (Pol::kDeltaFix) {   // sum_j P_ij K_j += P K (K's hi part), in fp16
            uint32_t pf[kTile / 16][4];
            pack_p<false, kTile / 8>(pf, s[0]);
            Pol::pk_issue(pk, pf, Pol::columns(k_of(st), col0));
        }
        Pol::template wait<Pol::kDeltaFix ? 1 : 0>();   // dP (P K may still run: it is settled with dQ)
        Pol::settle(dp);
        if constexpr (Pol::kFixedA) Pol::settle_a(doa, a_zero);
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[0][n][e] *= dp[0][n][e] - delta[e >> 1];   // dS
                if constexpr (Pol::kDeltaFix) ds_sum[e >> 1] += s[0][n][e];
            }
        uint32_t pa[kTile / 16][4];
        Pol::pv_issue(dq, pa, s, Pol::columns(k_of(st), col0), lane, io.ds_mul);
        if (!Pol::kEarlyIssue) {
            Pol::template wait<0>();
            settle_dq();
            __syncthreads();   // this stage takes tile kt + 2, issued at the top of the next iteration
        }
        if constexpr (Pol::kDqFlushSteps > 0 && !kStats) {
            if ((kt + 1) % Pol::kDqFlushSteps == 0) {
                if constexpr (Pol::kEarlyIssue) Pol::template wait<0>(), settle_dq();   // (still running)
                flush_rows(dq, dq_row, lane, kt + 1 == Pol::kDqFlushSteps);
            }
        }
        if constexpr (Pol::kDeltaFix) {
            if ((kt + 1) % Pol::kPkFlushSteps == 0) {
                if constexpr (Pol::kEarlyIssue) Pol::template wait<0>(), settle_dq();
                flush_half_rows(pk, pk_row, lane, kt + 1 == Pol::kPkFlushSteps);
            }
        }
    }
    Pol::template wait<0>();
    settle_dq();
    if constexpr (Pol::kDqFlushSteps > 0 && !kStats) {
        if (kt_last + 1 >= Pol::kDqFlushSteps) take_back_rows(dq, dq_row, lane);
    }
    if constexpr (Pol::kDeltaFix && !kStats) {   // dS - c_i P_ij in place of dS, in dQ and in delta
        static_assert(Pol::kPkFlushSteps > 0, "sum_j P_ij K_j is flushed into fp32 rows");
        float pk_f[1][OUT / 8][4];
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&pk[n][half]));
                pk_f[0][n][2 * half] = x.x, pk_f[0][n][2 * half + 1] = x.y;
            }
        if (kt_last + 1 >= Pol::kPkFlushSteps) take_back_rows(pk_f, pk_row, lane);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            ds_sum[half] += __shfl_xor_sync(0xffffffffu, ds_sum[half], 1);
            ds_sum[half] += __shfl_xor_sync(0xffffffffu, ds_sum[half], 2);
            delta[half] += ds_sum[half];
        }
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[0][n][e] -= io.ds_mul * ds_sum[e >> 1] * pk_f[0][n][e];
    }
    // The inputs' check: Inf or NaN in this CTA's Q tiles, or in its rows of dO or o, which makes
    // delta not finite (so does an fp32 overflow of finite bf16 products: the row-wise kernels
    // take that call too).
    cp_async_wait<0>();
    __syncthreads();
    flag_nonfinite(p, tiles_nonfinite<Pol, RG, kThreads * RG>(q_tiles, bf16) || !isfinite(delta[0]) || !isfinite(delta[1]));

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        if ((lane & 3) == 0 && col0 == 0 && qt < tiles) {   // every row of the tile, zeros past T
            const int64_t stat = bwd_stat_row(b, h, t, p);
            p.lse2[stat] = t < p.T ? lse2[half] : 0.f;
            p.delta[stat] = t < p.T ? delta[half] : 0.f;
        }
        if (t >= p.T) continue;
        typename Pol::Out* out = static_cast<typename Pol::Out*>(p.dq) + ((b * p.T + t) * p.Hq + h) * DP + col0;
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n)
            if (!kStats)
                Pol::store2(out + frag_col(lane, n, 2 * half), dq[0][n][2 * half] * p.scale, dq[0][n][2 * half + 1] * p.scale, io.e_dq);
    }
}

// Kernel 2: one CTA per (key tile, batch, kv head); the tiles with the most queries start first.
// A key tile is Pol::kKeyGroups groups of 64 keys, one a warpgroup (kThreads threads), which share
// each step's Q, dO, lse2 and delta.
template <class Pol>
__global__ void __launch_bounds__(kThreads * Pol::kKeyGroups) gqa_bwd_dkdv_kernel(const GqaBwdParams p, const __grid_constant__ typename Pol::Maps maps) {
    if (*p.nonfinite) return;   // kernel 1 found Inf or NaN: the row-wise kernels take this call
    constexpr bool kBf16 = Pol::kBf16;
    constexpr int DP = Pol::DP, H = Pol::kTileHalves, OUT = Pol::kOut, KG = Pol::kKeyGroups;
    const int col0 = OUT == DP ? 0 : int(blockIdx.y) * OUT;   // this CTA's dK and dV columns
    extern __shared__ __align__(16) uint16_t smem_raw[];
    uint16_t* smem = Pol::aligned(smem_raw);
    uint16_t *k_tiles = smem, *v_tiles = smem + KG * H;   // a 64-key tile per group
    auto q_tile = [&](int st) { return smem + (2 * KG + 2 * st) * H; };
    auto do_tile = [&](int st) { return smem + (2 * KG + 1 + 2 * st) * H; };
    auto lse2_s = [&](int st) { return reinterpret_cast<float*>(smem + (2 * KG + 4) * H) + st * 2 * kTile; };
    auto delta_s = [&](int st) { return lse2_s(st) + kTile; };

    const BwdCta cta = bwd_cta(p.B, p.Hkv);
    const int64_t b = cta.b;
    const int kv_head = cta.head, lane = threadIdx.x % 32, tiles = (p.T + kTile - 1) / kTile;
    const int wg = KG == 1 ? 0 : int(threadIdx.x) / kThreads, warp = int(threadIdx.x) % kThreads / 32;   // as kernel 1's
    const bool loader = int(threadIdx.x) < kThreads;   // the first group's threads make the cp.async copies
    const int kt = cta.tile, k0 = kt * kTile * KG, kw0 = k0 + kTile * wg;   // the CTA's first key, this group's
    uint16_t *k_tile = k_tiles + wg * H, *v_tile = v_tiles + wg * H;
    const bool bf16 = kBf16;
    const BwdIo io = Pol::io(p);
    // Pol::kTma: a stage's Q, dO, lse2 and delta come by TMA, issued by thread 0, and land on the
    // stage's barrier (phase k: the stage's k-th step).
    __shared__ uint64_t landed_bar[2];
    if constexpr (Pol::kTma) {
        if (threadIdx.x == 0) Pol::init_landed(landed_bar);
        __syncthreads();
    }

    if (loader)
        for (int g = 0; g < KG; ++g) {
            Pol::load(k_tiles + g * H, io.k, b, k0 + g * kTile, kv_head, p.Hkv, p.T);
            Pol::load(v_tiles + g * H, io.v, b, k0 + g * kTile, kv_head, p.Hkv, p.T);
        }
    cp_async_commit();

    // Step i is query tile kt KG + i / G of head kv_head * G + i % G: its Q, dO, lse2 and delta go to
    // stage i % 2 while step i - 1 computes from the other stage. The steps are loaded in order, so
    // the next one's tile and head are counted on (no division a step).
    const int steps = (tiles - kt * KG) * p.group;
    int load_qt = kt * KG, load_g = 0;   // the next step to load: its query tile, and its head in the group
    auto load_next = [&](int st) {
        const int q0 = load_qt * kTile, h = kv_head * p.group + load_g;
        if (++load_g == p.group) load_g = 0, ++load_qt;
        const int64_t stat = bwd_stat_row(b, h, q0, p);   // 64 values, zeros past T
        if constexpr (Pol::kTma) {
            if (threadIdx.x == 0)
                Pol::load_step(maps, q_tile(st), do_tile(st), lse2_s(st), delta_s(st), p.lse2 + stat, p.delta + stat,
                               &landed_bar[st], b, q0, h);
        } else if (loader) {
            Pol::load(q_tile(st), io.q, b, q0, h, p.Hq, p.T);
            Pol::load(do_tile(st), io.dout, b, q0, h, p.Hq, p.T);
            if (threadIdx.x < kTile / 4) {
                cp_async16(lse2_s(st) + 4 * threadIdx.x, p.lse2 + stat + 4 * threadIdx.x, 16);
                cp_async16(delta_s(st) + 4 * threadIdx.x, p.delta + stat + 4 * threadIdx.x, 16);
            }
        }
    };
    load_next(0);
    cp_async_commit();

    float dk[1][OUT / 8][4] = {}, dv[1][OUT / 8][4] = {};
    // Pol::kFlushSteps: this thread's fp32 rows of dK and dV (flushed after steps kFlushSteps - 1,
    // 2 kFlushSteps - 1, ..).
    auto key_row = [&](float* grad, int half) -> float* {
        const int j = kw0 + 16 * warp + frag_row(lane, 2 * half);
        return j < p.T ? grad + ((b * p.T + j) * p.Hkv + kv_head) * DP + col0 : nullptr;
    };
    auto dk_row = [&](int half) { return key_row(reinterpret_cast<float*>(p.dk), half); };
    auto dv_row = [&](int half) { return key_row(reinterpret_cast<float*>(p.dv), half); };
    int step_qt = kt * KG, step_g = 0;   // step i's query tile and head in the group, counted on
    // Pol::kFixedA: the group's K and V rows as register A operands, read once before the loop
    // (as the dQ kernel's Q and dO).
    uint32_t ka[Pol::kFixedA ? DP / 16 : 1][4], va[Pol::kFixedA ? DP / 16 : 1][4];
    const uint32_t a_zero = uint32_t(p.dtype) >> 8;   // 0 (Pol::settle_a)
    if constexpr (Pol::kFixedA) {
        cp_async_wait<Pol::kTma ? 0 : 1>();   // K and V (cp.async: the first step's copies may still run)
        __syncthreads();
        Pol::load_a(ka, k_tile, warp, lane);
        Pol::load_a(va, v_tile, warp, lane);
    }
    for (int i = 0; i < steps; ++i) {
        const int st = i & 1, q0 = step_qt * kTile;
        if (++step_g == p.group) step_g = 0, ++step_qt;
        if (!Pol::kEarlyIssue && !Pol::kTma) {
            if (i + 1 < steps) load_next(st ^ 1);
            cp_async_commit();    // (empty on the last step)
        }
        if (!Pol::kTma || kBwdFenceEveryStep || i == 0) {
            cp_async_wait<Pol::kEarlyIssue ? 0 : 1>();   // step i has landed (kTma: K and V)
            Pol::landed();
        }
        // (kTma with Pol::kEarlyIssue: only K and V need it, and the step's stage was freed by the
        // barrier in the middle of the step before)
        if (!(Pol::kTma && Pol::kEarlyIssue) || i == 0) __syncthreads();
        if constexpr (Pol::kTma) Pol::await_step(&landed_bar[st], uint32_t((i >> 1) & 1));
        const float* lse2_t = lse2_s(st);
        const float* delta_t = delta_s(st);
        float s[1][kTile / 8][4], dp[1][kTile / 8][4];
        if constexpr (Pol::kFixedA) {
            Pol::qk_issue_rs(s, ka, q_tile(st));     // S^T
            Pol::qk_issue_rs(dp, va, do_tile(st));   // dP^T
        } else {
            Pol::qk_issue(s, k_tile, q_tile(st), warp, lane);     // S^T
            Pol::qk_issue(dp, v_tile, do_tile(st), warp, lane);   // dP^T
        }
        // kTma: step i + 1's copies go out under the products (its stage was freed by the barrier
        // that ended step i - 1; with Pol::kEarlyIssue by the one below), so the issuing warp does
        // not hold up this step's barrier.
        if constexpr (Pol::kTma && !Pol::kEarlyIssue) {
            if (i + 1 < steps) load_next(st ^ 1);
        }
        if (Pol::kEarlyIssue) {
            Pol::template wait<2>();   // the last step's dV and dK: its stage is free
            Pol::settle(dv);
            Pol::settle(dk);
            __syncthreads();
            if (i + 1 < steps) load_next(st ^ 1);
            cp_async_commit();    // (empty on the last step)
        }
        // Masks only where a query can precede a key (the group's diagonal tile, and for a later
        // group the tiles before it) or a row or key is past T.
        const bool edge = q0 <= kw0 || q0 + kTile > p.T;
        const int j_base = kw0 + 16 * warp;
        float column[kTile / 8][2] = {};
        auto stat_of = [&](const float* stat, int n, int e) { return kBwdStatsInRegs ? column[n][e & 1] : stat[frag_col(lane, n, e)]; };
        if (kBwdStatsInRegs) read_columns<Pol::kPairedStats>(column, lse2_t, lane);
        Pol::template wait<1>();   // S^T; dP^T still running
        Pol::settle(s);
        if constexpr (Pol::kFixedA) Pol::settle_a(ka, a_zero);
        // P^T for every element, then the masked ones zeroed on edge tiles alone: with the mask in
        // the same expression the compiler branched around each exponential (BSSY, two BRA,
        // BSYNC an element, edge tile or not; bench/NOTES.md v59).
        const float scale_log2 = io.scale_log2;
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = fast_exp2(s[0][n][e] * scale_log2 - stat_of(lse2_t, n, e));
        if (edge) {
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = j_base + frag_row(lane, e), t = q0 + frag_col(lane, n, e);
                    if (t < j || t >= p.T || j >= p.T) s[0][n][e] = 0.f;
                }
        }
        uint32_t pa[kTile / 16][4], pa2[kTile / 16][4];
        Pol::pv_issue(dv, pa, s, Pol::columns(do_tile(st), col0), lane, io.p_mul);   // dV += P^T dO
        if (kBwdStatsInRegs) read_columns<Pol::kPairedStats>(column, delta_t, lane);
        Pol::template wait<1>();   // dP^T; dV still running
        Pol::settle(dp);
        if constexpr (Pol::kFixedA) Pol::settle_a(va, a_zero);
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[0][n][e] = s[0][n][e] * (dp[0][n][e] - stat_of(delta_t, n, e));   // dS^T
        Pol::pv_issue(dk, pa2, dp, Pol::columns(q_tile(st), col0), lane, io.ds_mul);   // dK += dS^T Q
        if (!Pol::kEarlyIssue) {
            Pol::template wait<0>();
            Pol::settle(dv);
            Pol::settle(dk);
            __syncthreads();   // stage st takes step i + 2, issued at the top of the next iteration
        }
        if constexpr (Pol::kFlushSteps > 0) {
            if ((i + 1) % Pol::kFlushSteps == 0) {
                if constexpr (Pol::kEarlyIssue) Pol::template wait<0>(), Pol::settle(dv), Pol::settle(dk);   // (still running)
                flush_rows(dk, dk_row, lane, i + 1 == Pol::kFlushSteps);
                flush_rows(dv, dv_row, lane, i + 1 == Pol::kFlushSteps);
            }
        }
    }
    Pol::template wait<0>();
    Pol::settle(dv);
    Pol::settle(dk);
    if constexpr (Pol::kFlushSteps > 0) {
        if (steps >= Pol::kFlushSteps) take_back_rows(dk, dk_row, lane), take_back_rows(dv, dv_row, lane);
    }
    // The inputs' check: Inf or NaN in this CTA's K and V tiles (consecutive in shared memory).
    cp_async_wait<0>();
    __syncthreads();
    flag_nonfinite(p, tiles_nonfinite<Pol, 2 * KG, kThreads * KG>(k_tiles, bf16));

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int j = kw0 + 16 * warp + frag_row(lane, 2 * half);
        if (j >= p.T) continue;
        const int64_t row = (b * p.T + j) * p.Hkv + kv_head;
        typename Pol::Out* dk_out = static_cast<typename Pol::Out*>(p.dk) + row * DP + col0;
        typename Pol::Out* dv_out = static_cast<typename Pol::Out*>(p.dv) + row * DP + col0;
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n) {
            const int c = frag_col(lane, n, 2 * half);
            Pol::store2(dk_out + c, dk[0][n][2 * half] * p.scale, dk[0][n][2 * half + 1] * p.scale, io.e_dk);
            Pol::store2(dv_out + c, dv[0][n][2 * half], dv[0][n][2 * half + 1], io.e_dv);
        }
    }
}

// Both kernels of one policy's unit, after p.nonfinite is zeroed (attention.cu) on the same stream.
template <class Pol>
cudaError_t bwd_launch(const GqaBwdParams& p, cudaStream_t stream, int dev) {
    if (p.dtype != Pol::kDtype || p.D != Pol::DP) return cudaErrorInvalidValue;
    static bool raised_dq[kMaxDevices] = {}, raised_dkdv[kMaxDevices] = {};
    constexpr size_t dq_smem = BwdSmem<Pol>::kDq, dkdv_smem = BwdSmem<Pol>::kDkdv;
    static_assert(dq_smem <= 227 * 1024 && dkdv_smem <= 227 * 1024, "each kernel's tiles fit one CTA's shared memory");
    const int64_t tiles = (p.T + kTile - 1) / kTile, key_tiles = (p.T + kTile * Pol::kKeyGroups - 1) / (kTile * Pol::kKeyGroups);
    const int64_t dq_ctas = (tiles + Pol::kRowGroups - 1) / Pol::kRowGroups * p.B * p.Hq, dkdv_ctas = key_tiles * p.B * p.Hkv;
    if (dq_ctas > 0x7fffffff || dkdv_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
    cudaError_t err = raise_smem_limit(gqa_bwd_dq_kernel<Pol>, dq_smem, dev, raised_dq);
    if (err != cudaSuccess) return err;
    err = raise_smem_limit(gqa_bwd_dkdv_kernel<Pol>, dkdv_smem, dev, raised_dkdv);
    if (err != cudaSuccess) return err;
    constexpr unsigned kHalves = Pol::DP / Pol::kOut;   // CTAs a tile, each its output columns
    typename Pol::Maps maps;
    err = Pol::make_maps(p, &maps);
    if (err != cudaSuccess) return err;
    gqa_bwd_dq_kernel<Pol><<<dim3(unsigned(dq_ctas), kHalves), kThreads * Pol::kRowGroups, dq_smem, stream>>>(p, maps);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    gqa_bwd_dkdv_kernel<Pol><<<dim3(unsigned(dkdv_ctas), kHalves), kThreads * Pol::kKeyGroups, dkdv_smem, stream>>>(p, maps);
    return cudaGetLastError();
}

// The unit's entry point, gqa_launch_<family> (gqa_params.h: GqaBwdLauncher), for policy POL.
#define GQA_BWD_ENTRY(family, POL)                                                                    \
    extern "C" int gqa_launch_##family(const GqaBwdParams* p, void* stream) {                         \
        int dev = 0;                                                                                   \
        const cudaError_t err = cudaGetDevice(&dev);                                                   \
        return int(err != cudaSuccess ? err : bwd_launch<POL>(*p, static_cast<cudaStream_t>(stream), dev)); \
    }

}  // namespace
#endif  // GQA_BWDMMA_KERNELS_CUH
