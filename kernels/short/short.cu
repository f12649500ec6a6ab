// The short family (rules.cuh describes it): fp32 at width 32 only, compiled into the entry
// library (attention.cu).

#include "short/rules.cuh"
#include "common/tile_io.cuh"

namespace {

// split_tf32 in integer arithmetic, for the short kernel, which is bound by its splits (cvt.rna
// compiles to about five instructions): big adds half a TF32 unit to the magnitude bits and clears
// the 13 low bits (round half away from zero); small = x - big is exact and goes to the tensor
// core as it is, which reads its top 19 bits (about 2^-21 |x| dropped instead of 2^-23, error
// unchanged: bench/NOTES.md v22). An x that rounds past the largest finite value gives big = inf and
// small = -inf, so its products come out NaN and take the exact path.
__device__ __forceinline__ void split_tf32_int(float x, uint32_t& big, uint32_t& small) {
    big = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big));
}

// q's A fragments for every k-step of DP, read and split (while K and V are still landing).
template <int DP, int LD>
__device__ __forceinline__ void short_q_split(uint32_t (&a_big)[DP / 8][4], uint32_t (&a_small)[DP / 8][4], const float* sQ,
                                              int lane) {
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int kk = 0; kk < DP / 8; ++kk) {
        const float* qa = sQ + gid * LD + kk * 8 + tig;
        split_tf32_int(qa[0], a_big[kk][0], a_small[kk][0]);
        split_tf32_int(qa[8 * LD], a_big[kk][1], a_small[kk][1]);
        split_tf32_int(qa[4], a_big[kk][2], a_small[kk][2]);
        split_tf32_int(qa[8 * LD + 4], a_big[kk][3], a_small[kk][3]);
    }
}

// Every m16n8k8 TF32 B fragment of a warp's product, read from shared memory before the first
// mma: a thread's two values of fragment (i, j) lie at at(i, j) and `step` floats further (4 for
// K, whose k index runs along a row; LD for V, whose k index runs down the rows).
template <int I, int J, typename At>
__device__ __forceinline__ void read_b_fragments(float (&frag)[I][J][2], At at, int step) {
#pragma unroll
    for (int i = 0; i < I; ++i)
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const float* src = at(i, j);
            frag[i][j][0] = src[0];
            frag[i][j][1] = src[step];
        }
}

// S (16 rows x kShortKeys keys) = Q K^T for one warp, three TF32 products per product. A short
// warp is one dependent chain, so every K fragment read is issued first and each (k-step parity,
// term) pair gets its own accumulator: twelve independent mma chains instead of two.
template <int DP, int LD>
__device__ __forceinline__ void short_qk(float (&s)[kShortKeys / 8][4], const uint32_t (&a_big)[DP / 8][4],
                                         const uint32_t (&a_small)[DP / 8][4], const float* sK, int lane) {
    constexpr int KS = DP / 8, NT = kShortKeys / 8;
    const int gid = lane >> 2, tig = lane & 3;
    float b[KS][NT][2];
    read_b_fragments(b, [&](int kk, int j) { return sK + (j * 8 + gid) * LD + kk * 8 + tig; }, 4);
    float acc[2][3][NT][4] = {};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            uint32_t b_big[2], b_small[2];
            split_tf32_int(b[kk][j][0], b_big[0], b_small[0]);
            split_tf32_int(b[kk][j][1], b_big[1], b_small[1]);
            mma_tf32(acc[kk & 1][0][j], a_small[kk], b_big);
            mma_tf32(acc[kk & 1][1][j], a_big[kk], b_small);
            mma_tf32(acc[kk & 1][2][j], a_big[kk], b_big);
        }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[j][e] = ((acc[0][0][j][e] + acc[1][0][j][e]) + (acc[0][1][j][e] + acc[1][1][j][e])) +
                      (acc[0][2][j][e] + acc[1][2][j][e]);
}

// O (16 rows x DP) = P V for one warp: P in the accumulator layout of S read as the A operand
// with key kappa of a k-step taken as key 2 kappa (kappa < 4) or 2 (kappa - 4) + 1, as pv_tf32
// does; one accumulator per term, every V fragment read first.
template <int DP, int LD>
__device__ __forceinline__ void short_pv(float (&o)[DP / 8][4], const float (&s)[kShortKeys / 8][4], const float* sV, int lane) {
    constexpr int KD = DP / 8, NT = kShortKeys / 8;
    const int gid = lane >> 2, tig = lane & 3;
    float vb[NT][KD][2];
    read_b_fragments(vb, [&](int j, int d) { return sV + (j * 8 + 2 * tig) * LD + d * 8 + gid; }, LD);
    float acc[3][KD][4] = {};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        uint32_t p_big[4], p_small[4];
        split_tf32_int(s[j][0], p_big[0], p_small[0]);
        split_tf32_int(s[j][2], p_big[1], p_small[1]);
        split_tf32_int(s[j][1], p_big[2], p_small[2]);
        split_tf32_int(s[j][3], p_big[3], p_small[3]);
#pragma unroll
        for (int d = 0; d < KD; ++d) {
            uint32_t v_big[2], v_small[2];
            split_tf32_int(vb[j][d][0], v_big[0], v_small[0]);
            split_tf32_int(vb[j][d][1], v_big[1], v_small[1]);
            mma_tf32(acc[0][d], p_small, v_big);
            mma_tf32(acc[1][d], p_big, v_small);
            mma_tf32(acc[2][d], p_big, v_big);
        }
    }
#pragma unroll
    for (int d = 0; d < KD; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[d][e] = (acc[0][d][e] + acc[1][d][e]) + acc[2][d][e];
}

// Unit u of a warp's parked state: one float2 per lane, 32 lanes wide.
__device__ __forceinline__ float2& park_unit(float* room, int u) {
    return reinterpret_cast<float2*>(room)[u * 32 + threadIdx.x % 32];
}

template <int DP>
__global__ void __launch_bounds__(32 * kShortWarps)
gqa_short_kernel(const GqaParams p, const TileDivs dv) {
    constexpr int LD = DP + 4;                      // 4 (mod 32): conflict-free fragment reads
    constexpr int kChunks = DP / 4;                 // 16-byte copies per row
    constexpr int kPer = kShortRows * kChunks / 32; // copies per lane of each of q, K and V
    constexpr int kDTiles = DP / 8;
    constexpr int kNTiles = kShortKeys / 8;
    extern __shared__ float4 smem_raw[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* sQ = reinterpret_cast<float*>(smem_raw) + warp * 3 * kShortRows * LD;   // this warp's [16][LD]
    float* sK = sQ + kShortRows * LD;
    float* sV = sK + kShortRows * LD;

    const int D = p.D, G = p.group, T = p.T, rows_total = T * G;
    const int n_qtiles = (rows_total + kShortRows - 1) / kShortRows;
    const int tile = dv.bh.div(int(blockIdx.x));
    const int bh = int(blockIdx.x) - tile * dv.bh.d;
    const int r0 = (n_qtiles - 1 - tile) * kShortRows;   // longest rows first
    const int b = dv.hkv.div(bh), kvh = bh - b * p.Hkv;
    const int t_hi = min(dv.group.div(r0 + kShortRows - 1), T - 1);
    const int key0 = warp * kShortKeys;
    const bool active = key0 <= t_hi;   // some row attends a key of this warp's slice
    const HeadRows<float> head(p, b, kvh);
    const float *q_base = head.q, *k_base = head.k, *v_base = head.v;
    const int gid = lane >> 2, tig = lane & 3;
    int row_t[2];   // time step of rows gid and gid + 8; -1 past the last row
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int R = r0 + gid + 8 * i;
        row_t[i] = R < rows_total ? dv.group.div(R) : -1;
    }

    // The copy plan: lane copies chunk c of rows r, r + 32 / kChunks, ... of q, K and V; rows
    // past the end and columns past D are zero-filled.
    const float* src[3][kPer];
    uint32_t dst[3][kPer];
    int bytes[3][kPer];
    const uint32_t s_warp = static_cast<uint32_t>(__cvta_generic_to_shared(sQ));
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
        const int i = lane + 32 * u, r = i / kChunks, c = 4 * (i % kChunks);
        const bool col = c < D;
        const int R = r0 + r, t = dv.group.div(R);
        const bool q_ok = col && R < rows_total, kv_ok = col && key0 + r <= t_hi;
        src[0][u] = q_ok ? head.q_at(p, t, R - t * G) + c : q_base;
        src[1][u] = kv_ok ? k_base + int64_t(key0 + r) * p.k_stride_t + c : k_base;
        src[2][u] = kv_ok ? v_base + int64_t(key0 + r) * p.v_stride_t + c : v_base;
        bytes[0][u] = q_ok ? 16 : 0;
        bytes[1][u] = bytes[2][u] = kv_ok ? 16 : 0;
#pragma unroll
        for (int z = 0; z < 3; ++z) {
            dst[z][u] = s_warp + 4u * uint32_t((z * kShortRows + r) * LD + c);
            asm volatile("" : "+l"(src[z][u]), "+r"(dst[z][u]), "+r"(bytes[z][u]));   // here, before the wait
        }
    }
    grid_dependency_wait();   // q, k and v may come from the kernel before this one
    allow_dependent_launch();

    float o[kDTiles][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};   // max of the scaled scores (log2); sum of exp2
#pragma unroll
    for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    if (active) {
        // q through L1 in a group of its own (the CTA's warps read the same q lines), then K and V.
#pragma unroll
        for (int u = 0; u < kPer; ++u)
            asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst[0][u]), "l"(src[0][u]), "r"(bytes[0][u]));
        cp_async_commit();
#pragma unroll
        for (int z = 1; z < 3; ++z)
#pragma unroll
            for (int u = 0; u < kPer; ++u)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst[z][u]), "l"(src[z][u]), "r"(bytes[z][u]));
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();
        uint32_t qa_big[kDTiles][4], qa_small[kDTiles][4];
        short_q_split<DP, LD>(qa_big, qa_small, sQ, lane);
        cp_async_wait<0>();
        __syncwarp();
        float s[kNTiles][4];
        auto any_nan = [](const auto& x) {
            bool bad = false;
#pragma unroll
            for (const auto& row : x)
#pragma unroll
                for (float y : row) bad |= y != y;
            return __any_sync(0xffffffffu, bad);
        };
        short_qk<DP, LD>(s, qa_big, qa_small, sK, lane);
        bool nonfinite = any_nan(s);
        if (nonfinite) qk_tf32<kShortKeys, DP, LD>(s, sQ, sK, D, 3, true, lane);   // plain fp32
        // Causal mask, the warp's max per row, probabilities.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                for (int e = 2 * i; e < 2 * i + 2; ++e) {
                    if (key0 + j * 8 + 2 * tig + (e & 1) > row_t[i]) s[j][e] = -INFINITY;
                    mx = fmaxf(mx, s[j][e]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            m[i] = mx * p.scale_log2;
            const float m_ref = m[i] == -INFINITY ? 0.f : m[i];   // no key of the slice attended
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                for (int e = 2 * i; e < 2 * i + 2; ++e) {
                    s[j][e] = fast_exp2(fmaf(s[j][e], p.scale_log2, -m_ref));
                    l[i] += s[j][e];
                }
        }
        if (!nonfinite) {
            short_pv<DP, LD>(o, s, sV, lane);
            nonfinite = any_nan(o);
            if (nonfinite)
#pragma unroll
                for (auto& tile : o) tile[0] = tile[1] = tile[2] = tile[3] = 0.f;
        }
        if (nonfinite) {
            // Plain fp32 over the attended keys only. p of (row, key) lives in the quad lane that
            // holds the key's column of S; the loops stay rolled (a rare path).
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll 1
                for (int kk = 0; kk < 8; ++kk) {
                    const float own0 = (kk & 1) ? s[j][1] : s[j][0];
                    const float own1 = (kk & 1) ? s[j][3] : s[j][2];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const float pk = __shfl_sync(0xffffffffu, i ? own1 : own0, (lane & ~3) | (kk >> 1));
                        if (key0 + j * 8 + kk > row_t[i]) continue;
                        const float* vr = sV + (j * 8 + kk) * LD + 2 * tig;
#pragma unroll
                        for (int d = 0; d < kDTiles; ++d) {
                            o[d][2 * i] = fmaf(pk, vr[d * 8], o[d][2 * i]);
                            o[d][2 * i + 1] = fmaf(pk, vr[d * 8 + 1], o[d][2 * i + 1]);
                        }
                    }
                }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
            l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        }
        // Park the state in this warp's own K/V room (its products are done with it), as float2
        // units 32 lanes wide: unit 2d + i holds o[d][2i], o[d][2i + 1]; unit 2 kDTiles + i holds
        // m[i], l[i] (row half i).
        __syncwarp();
#pragma unroll
        for (int d = 0; d < kDTiles; ++d)
#pragma unroll
            for (int i = 0; i < 2; ++i) park_unit(sK, d * 2 + i) = make_float2(o[d][2 * i], o[d][2 * i + 1]);
#pragma unroll
        for (int i = 0; i < 2; ++i) park_unit(sK, kDTiles * 2 + i) = make_float2(m[i], l[i]);
    }
    __syncthreads();

    // Merge: O = sum_w 2^(m_w - M) O_w / sum_w 2^(m_w - M) l_w with M = max_w m_w, over the warps
    // with keys. Warp w finishes the (column tile, row half) pairs w, w + kShortWarps, ...; the
    // lanes keep their fragment positions.
    const int n_active = min(kShortWarps, t_hi / kShortKeys + 1);
    float* o_base = static_cast<float*>(p.o) + b * p.o_stride_b + int64_t(kvh) * G * p.o_stride_h;
    for (int pr = warp; pr < 2 * kDTiles; pr += kShortWarps) {
        const int d = pr >> 1, i = pr & 1, c = d * 8 + 2 * tig;
        const int t = i ? row_t[1] : row_t[0];   // (a select: a runtime index would put row_t in local memory)
        if (t < 0 || c >= D) continue;
        // The units of every warp with keys are read up front (the others parked nothing).
        float mw[kShortWarps], lw[kShortWarps], ow0[kShortWarps], ow1[kShortWarps], M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kShortWarps; ++w) {
            const bool has = w < n_active;
            float* room = reinterpret_cast<float*>(smem_raw) + (w * 3 + 1) * kShortRows * LD;   // warp w's K/V room
            const float2 ml = has ? park_unit(room, kDTiles * 2 + i) : make_float2(-INFINITY, 0.f);
            const float2 oo = has ? park_unit(room, d * 2 + i) : make_float2(0.f, 0.f);
            mw[w] = ml.x, lw[w] = ml.y, ow0[w] = oo.x, ow1[w] = oo.y;
        }
#pragma unroll
        for (int w = 0; w < kShortWarps; ++w) M = w < n_active ? fmaxf(M, mw[w]) : M;
        float den = 0.f, y0 = 0.f, y1 = 0.f;
#pragma unroll
        for (int w = 0; w < kShortWarps; ++w) {
            const float f = w < n_active ? fast_exp2(mw[w] - M) : 0.f;
            den = w < n_active ? fmaf(f, lw[w], den) : den;
            y0 = w < n_active ? fmaf(f, ow0[w], y0) : y0;
            y1 = w < n_active ? fmaf(f, ow1[w], y1) : y1;
        }
        const float inv = 1.f / den;
        const int R = r0 + gid + 8 * i;
        float* dst_row = o_base + int64_t(t) * p.o_stride_t + int64_t(R - t * G) * p.o_stride_h;
        *reinterpret_cast<float2*>(dst_row + c) = make_float2(y0 * inv, y1 * inv);   // D % 4 == 0, c even
    }
}

template <int DP>
cudaError_t launch_short(const GqaParams& p, cudaStream_t stream, int dev) {
    static bool raised[kMaxDevices] = {};
    auto kernel = gqa_short_kernel<DP>;
    const cudaError_t err = raise_smem_limit(kernel, short_smem_bytes<DP>(), dev, raised);
    if (err != cudaSuccess) return err;
    TileDivs dv;
    dv.bh = FastDiv(p.B * p.Hkv);
    dv.hkv = FastDiv(p.Hkv);
    dv.group = FastDiv(p.group);
    return launch_overlapped(kernel, packed_row_ctas(p, kShortRows), 32 * kShortWarps, short_smem_bytes<DP>(), stream, dev, p, dv);
}

// The unit's launch, behind its entry point (GQA_FAMILY_ENTRY).
cudaError_t short_launch(const GqaParams& p, const GqaPlan& plan, cudaStream_t s, int dev) {
    return launch_short<32>(p, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(short)
