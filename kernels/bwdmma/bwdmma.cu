// The backward on tensor cores: fp16 and bf16 inputs at head_dim 64 and 128 (mma.sync m16n8k16,
// fp32 accumulators), a unit per dtype and width (GQA_DTYPE, GQA_WIDTH). Other shapes and fp32
// take the row-wise backward (backward/backward.cu), which is also this unit's reference in the
// tests. Tiles of 64 rows, 16 per warp; every sum runs in a fixed order (no atomics).
//  1. Query tiles (64 time steps of one query head). delta = rowsum(dO o). Pass 1 over the key
//     tiles the tile attends: S = Q K^T and the rows' log-sum-exp (lse2, base 2). Pass 2: S again,
//     P = 2^(S log2(e) / sqrt(D) - lse2), dP = dO V^T, dS = P (dP - delta), dQ += dS K. Writes dQ,
//     and lse2 and delta for kernel 2.
//  2. Key tiles (64 keys of one kv head). For every query tile at or after them and every head of
//     the group: S^T = K Q^T, P^T from lse2, dP^T = V dO^T, dS^T = P^T (dP^T - delta),
//     dV += P^T dO, dK += dS^T Q.
// P and dS are rounded to the input dtype before their products, as in FlashAttention. A masked
// (future or padding) entry is a hard zero, but a tile product still multiplies it by the values
// of keys and queries the row does not attend, and 0 * Inf is NaN: so a call whose inputs hold Inf
// or NaN (a scan sets p.nonfinite first) leaves these kernels at once and takes the row-wise ones.

#include "common/mma.cuh"

namespace {

constexpr int kTile = 64;                  // rows of a tile, and columns of a step
constexpr int kWarps = kTile / 16;         // one 16-row m-tile per warp
constexpr int kThreads = 32 * kWarps;

template <int DP> struct BwdShape {
    static constexpr int LD = DP + 8;                                   // halves per shared row
    static constexpr int kTileHalves = kTile * LD;
    static constexpr int kDqSmemBytes = 4 * kTileHalves * 2;            // Q, dO, K, V
    // K, V, then two stages of Q, dO, lse2 and delta
    static constexpr int kDkdvSmemBytes = 6 * kTileHalves * 2 + 2 * 2 * kTile * 4;
};

// Rows [row0, row0 + 64) of one head of a contiguous [B, T, H, DP] tensor into a shared tile, 16
// bytes per copy; rows at or past T are zeros.
template <int DP>
__device__ __forceinline__ void load_tile(uint16_t* tile, const uint16_t* base, int64_t b, int row0, int head,
                                          int heads, int T) {
    constexpr int kChunks = DP / 8;   // 16-byte pieces per row
    for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads) {
        const int r = i / kChunks, c = i % kChunks;
        const int t = row0 + r;
        const bool valid = t < T;
        const uint16_t* src = base + ((b * T + (valid ? t : 0)) * heads + head) * int64_t(DP) + 8 * c;
        cp_async16(tile + r * BwdShape<DP>::LD + 8 * c, src, valid ? 16 : 0);
    }
}

// Fragment coordinates of an m16n8 accumulator: element e of n-tile n sits in row
// (lane / 4) + 8 (e / 2) and column 8 n + 2 (lane % 4) + e % 2.
__device__ __forceinline__ int frag_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int frag_col(int lane, int n, int e) { return 8 * n + 2 * (lane & 3) + (e & 1); }

// A CTA's batch, head and tile index in a grid of tiles x B x `heads`, heads fastest.
struct BwdCta {
    int64_t b;
    int head, tile;
};
__device__ __forceinline__ BwdCta bwd_cta(int B, int heads) {
    const int64_t bh = blockIdx.x % (int64_t(B) * heads);
    return {bh / heads, int(bh % heads), int(blockIdx.x / (int64_t(B) * heads))};
}

// Kernel 1: one CTA per (query tile, batch, head); the tiles with the most keys start first.
template <bool kBf16, int DP>
__global__ void __launch_bounds__(kThreads) gqa_bwd_dq_kernel(const GqaBwdParams p) {
    using Shape = BwdShape<DP>;
    extern __shared__ __align__(16) uint16_t smem[];
    constexpr int H = Shape::kTileHalves;
    uint16_t *q_tile = smem, *do_tile = smem + H, *k_tile = smem + 2 * H, *v_tile = smem + 3 * H;

    if (*p.nonfinite) return;   // the row-wise kernels take this call
    const BwdCta cta = bwd_cta(p.B, p.Hq);
    const int64_t b = cta.b;
    const int h = cta.head, kv_head = h / p.group, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qt = (p.T + kTile - 1) / kTile - 1 - cta.tile, q0 = qt * kTile;
    const bool bf16 = kBf16;

    load_tile<DP>(q_tile, static_cast<const uint16_t*>(p.q), b, q0, h, p.Hq, p.T);
    load_tile<DP>(do_tile, static_cast<const uint16_t*>(p.dout), b, q0, h, p.Hq, p.T);
    cp_async_commit();

    // delta of this lane's two rows (every lane of a quad computes the same value).
    float delta[2], lse2[2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        float sum = 0.f;
        if (t < p.T) {
            const int64_t row = ((b * p.T + t) * p.Hq + h) * int64_t(DP);
            for (int d = (lane & 3); d < DP; d += 4)
                sum = fmaf(to_float(static_cast<const uint16_t*>(p.dout)[row + d], bf16),
                           to_float(static_cast<const uint16_t*>(p.o)[row + d], bf16), sum);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        delta[half] = sum;
    }

    const uint16_t* q_rows = q_tile + 16 * warp * Shape::LD;
    const uint16_t* do_rows = do_tile + 16 * warp * Shape::LD;
    auto masked = [&](int kt, int n, int e) {
        const int t = q0 + 16 * warp + frag_row(lane, e), j = kt * kTile + frag_col(lane, n, e);
        return j > t || j >= p.T;
    };

    // Pass 1: the rows' maximum and sum, online over the key tiles. K tile kt lands in k_tile
    // (kt even) or v_tile (kt odd) while the tile before it is in use.
    auto k_stage = [&](int kt) { return kt & 1 ? v_tile : k_tile; };
    load_tile<DP>(k_stage(0), static_cast<const uint16_t*>(p.k), b, 0, kv_head, p.Hkv, p.T);
    cp_async_commit();
    for (int kt = 0; kt <= qt; ++kt) {
        if (kt < qt) load_tile<DP>(k_stage(kt + 1), static_cast<const uint16_t*>(p.k), b, (kt + 1) * kTile, kv_head, p.Hkv, p.T);
        cp_async_commit();    // (empty on the last tile)
        cp_async_wait<1>();   // everything but the tile just issued has landed
        __syncthreads();
        float s[1][kTile / 8][4] = {};
        qk_16bit<kBf16, kTile, DP, Shape::LD, 1>(s, q_rows, k_stage(kt), DP / 16, lane);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e) {
                    s[0][n][e] = masked(kt, n, e) ? -INFINITY : s[0][n][e] * p.scale_log2;
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
        __syncthreads();   // this stage takes tile kt + 2, issued at the top of the next iteration
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) lse2[half] = m[half] + log2f(l[half]);

    // Pass 2: dQ.
    float dq[1][DP / 8][4] = {};
    for (int kt = 0; kt <= qt; ++kt) {
        load_tile<DP>(k_tile, static_cast<const uint16_t*>(p.k), b, kt * kTile, kv_head, p.Hkv, p.T);
        load_tile<DP>(v_tile, static_cast<const uint16_t*>(p.v), b, kt * kTile, kv_head, p.Hkv, p.T);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        float s[1][kTile / 8][4] = {}, dp[1][kTile / 8][4] = {};
        qk_16bit<kBf16, kTile, DP, Shape::LD, 1>(s, q_rows, k_tile, DP / 16, lane);
        qk_16bit<kBf16, kTile, DP, Shape::LD, 1>(dp, do_rows, v_tile, DP / 16, lane);
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float prob = masked(kt, n, e) ? 0.f : fast_exp2(s[0][n][e] * p.scale_log2 - lse2[e >> 1]);
                s[0][n][e] = prob * (dp[0][n][e] - delta[e >> 1]);   // dS
            }
        pv_16bit<kBf16, kTile, DP, Shape::LD, 1>(dq, s, k_tile, DP / 8, lane);
        __syncthreads();
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        if (t >= p.T) continue;
        const int64_t row = (b * p.T + t) * p.Hq + h;
        uint16_t* out = static_cast<uint16_t*>(p.dq) + row * DP;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n)
            store_pair(out + frag_col(lane, n, 2 * half), dq[0][n][2 * half] * p.scale, dq[0][n][2 * half + 1] * p.scale, bf16);
        if ((lane & 3) == 0) {
            p.lse2[row] = lse2[half];
            p.delta[row] = delta[half];
        }
    }
}

// Kernel 2: one CTA per (key tile, batch, kv head); the tiles with the most queries start first.
template <bool kBf16, int DP>
__global__ void __launch_bounds__(kThreads) gqa_bwd_dkdv_kernel(const GqaBwdParams p) {
    if (*p.nonfinite) return;   // the row-wise kernels take this call
    using Shape = BwdShape<DP>;
    extern __shared__ __align__(16) uint16_t smem[];
    constexpr int H = Shape::kTileHalves;
    uint16_t *k_tile = smem, *v_tile = smem + H;
    auto q_tile = [&](int st) { return smem + (2 + 2 * st) * H; };
    auto do_tile = [&](int st) { return smem + (3 + 2 * st) * H; };
    auto lse2_s = [&](int st) { return reinterpret_cast<float*>(smem + 6 * H) + st * 2 * kTile; };
    auto delta_s = [&](int st) { return lse2_s(st) + kTile; };

    const BwdCta cta = bwd_cta(p.B, p.Hkv);
    const int64_t b = cta.b;
    const int kv_head = cta.head, warp = threadIdx.x / 32, lane = threadIdx.x % 32, tiles = (p.T + kTile - 1) / kTile;
    const int kt = cta.tile, k0 = kt * kTile;
    const bool bf16 = kBf16;

    load_tile<DP>(k_tile, static_cast<const uint16_t*>(p.k), b, k0, kv_head, p.Hkv, p.T);
    load_tile<DP>(v_tile, static_cast<const uint16_t*>(p.v), b, k0, kv_head, p.Hkv, p.T);
    cp_async_commit();
    const uint16_t* k_rows = k_tile + 16 * warp * Shape::LD;
    const uint16_t* v_rows = v_tile + 16 * warp * Shape::LD;

    // Step i is query tile kt + i / G of head kv_head * G + i % G: its Q, dO, lse2 and delta go to
    // stage i % 2 while step i - 1 computes from the other stage.
    const int steps = (tiles - kt) * p.group;
    auto load_step = [&](int i, int st) {
        const int q0 = (kt + i / p.group) * kTile, h = kv_head * p.group + i % p.group;
        load_tile<DP>(q_tile(st), static_cast<const uint16_t*>(p.q), b, q0, h, p.Hq, p.T);
        load_tile<DP>(do_tile(st), static_cast<const uint16_t*>(p.dout), b, q0, h, p.Hq, p.T);
        for (int r = threadIdx.x; r < kTile; r += kThreads) {
            const int t = q0 + r;
            const int64_t row = (b * p.T + (t < p.T ? t : 0)) * p.Hq + h;
            cp_async4(lse2_s(st) + r, p.lse2 + row, t < p.T ? 4 : 0);
            cp_async4(delta_s(st) + r, p.delta + row, t < p.T ? 4 : 0);
        }
    };
    load_step(0, 0);
    cp_async_commit();

    float dk[1][DP / 8][4] = {}, dv[1][DP / 8][4] = {};
    for (int i = 0; i < steps; ++i) {
        const int st = i & 1, q0 = (kt + i / p.group) * kTile;
        if (i + 1 < steps) load_step(i + 1, st ^ 1);
        cp_async_commit();    // (empty on the last step)
        cp_async_wait<1>();   // everything but the step just issued has landed
        __syncthreads();
        const float* lse2_t = lse2_s(st);
        const float* delta_t = delta_s(st);
        float s[1][kTile / 8][4] = {}, dp[1][kTile / 8][4] = {};
        qk_16bit<kBf16, kTile, DP, Shape::LD, 1>(s, k_rows, q_tile(st), DP / 16, lane);    // S^T
        qk_16bit<kBf16, kTile, DP, Shape::LD, 1>(dp, v_rows, do_tile(st), DP / 16, lane);  // dP^T
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = k0 + 16 * warp + frag_row(lane, e), c = frag_col(lane, n, e), t = q0 + c;
                const bool masked = t < j || t >= p.T || j >= p.T;
                const float prob = masked ? 0.f : fast_exp2(s[0][n][e] * p.scale_log2 - lse2_t[c]);
                s[0][n][e] = prob;                                  // P^T
                dp[0][n][e] = prob * (dp[0][n][e] - delta_t[c]);    // dS^T
            }
        pv_16bit<kBf16, kTile, DP, Shape::LD, 1>(dv, s, do_tile(st), DP / 8, lane);
        pv_16bit<kBf16, kTile, DP, Shape::LD, 1>(dk, dp, q_tile(st), DP / 8, lane);
        __syncthreads();   // stage st takes step i + 2, issued at the top of the next iteration
    }

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int j = k0 + 16 * warp + frag_row(lane, 2 * half);
        if (j >= p.T) continue;
        const int64_t row = (b * p.T + j) * p.Hkv + kv_head;
        uint16_t* dk_out = static_cast<uint16_t*>(p.dk) + row * DP;
        uint16_t* dv_out = static_cast<uint16_t*>(p.dv) + row * DP;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
            const int c = frag_col(lane, n, 2 * half);
            store_pair(dk_out + c, dk[0][n][2 * half] * p.scale, dk[0][n][2 * half + 1] * p.scale, bf16);
            store_pair(dv_out + c, dv[0][n][2 * half], dv[0][n][2 * half + 1], bf16);
        }
    }
}

cudaError_t bwdmma_launch(const GqaBwdParams& p, cudaStream_t stream, int dev) {
    constexpr bool kBf16 = GQA_DTYPE == kGqaBFloat16;
    constexpr int DP = GQA_WIDTH;
    static_assert(GQA_DTYPE != kGqaFloat32 && (DP == 64 || DP == 128), "a unit for fp16 or bf16 at width 64 or 128");
    if (p.dtype != GQA_DTYPE || p.D != DP) return cudaErrorInvalidValue;
    static bool raised_dq[kMaxDevices] = {}, raised_dkdv[kMaxDevices] = {};
    constexpr size_t dq_smem = BwdShape<DP>::kDqSmemBytes, dkdv_smem = BwdShape<DP>::kDkdvSmemBytes;
    const int64_t tiles = (p.T + kTile - 1) / kTile;
    const int64_t dq_ctas = tiles * p.B * p.Hq, dkdv_ctas = tiles * p.B * p.Hkv;
    if (dq_ctas > 0x7fffffff || dkdv_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
    cudaError_t err = raise_smem_limit(gqa_bwd_dq_kernel<kBf16, DP>, dq_smem, dev, raised_dq);
    if (err != cudaSuccess) return err;
    err = raise_smem_limit(gqa_bwd_dkdv_kernel<kBf16, DP>, dkdv_smem, dev, raised_dkdv);
    if (err != cudaSuccess) return err;
    gqa_bwd_dq_kernel<kBf16, DP><<<unsigned(dq_ctas), kThreads, dq_smem, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    gqa_bwd_dkdv_kernel<kBf16, DP><<<unsigned(dkdv_ctas), kThreads, dkdv_smem, stream>>>(p);
    return cudaGetLastError();
}

}  // namespace

// The unit's entry point (gqa_params.h: GqaBwdLauncher).
extern "C" int gqa_launch_bwdmma(const GqaBwdParams* p, void* stream) {
    int dev = 0;
    const cudaError_t err = cudaGetDevice(&dev);
    return int(err != cudaSuccess ? err : bwdmma_launch(*p, static_cast<cudaStream_t>(stream), dev));
}
