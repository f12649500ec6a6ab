// Warp-level primitives: cp.async, exp2, the TF32 split and 3xTF32 products, ldmatrix and the
// 16-bit mma.sync tile products.
#ifndef GQA_COMMON_MMA_CUH
#define GQA_COMMON_MMA_CUH

#include "common/base.cuh"

namespace {

// ---------------------------------------------------------------------------------------------
// Small device helpers.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int src_bytes) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 2^x in one MUFU instruction. Results below 2^-126 flush to zero (without .ftz the compiler
// wraps every exp in a range test and two multiplies): a probability that small is below fp32's
// resolution next to the row maximum's 1.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 2^x on the FMA and integer pipes, no MUFU: x = n + f with n = round(x) (added to 1.5 * 2^23, whose
// low mantissa bits then hold n), 2^f by a degree-4 polynomial (relative error 2.7e-6 on
// [-0.5, 0.5], below half an fp16 ulp), n added to the exponent field. For x <= 0 (a score minus
// its row's maximum); below -126 it gives 0 as fast_exp2 does (a masked key's -inf included: a
// bf16 P of 2^-126 times a V near bf16's largest would not vanish), and NaN stays NaN.
__device__ __forceinline__ float fma_exp2(float x) {
    const float xc = x < -126.f ? -126.f : x;   // (false for NaN)
    const float t = xc + 12582912.f;
    const float f = xc - (t - 12582912.f);
    float p = 0.009570036f;
    p = fmaf(p, f, 0.05591771f);
    p = fmaf(p, f, 0.24024744f);
    p = fmaf(p, f, 0.69312185f);
    p = fmaf(p, f, 0.99999928f);
    // t's bits are 0x4b400000 + n, and 0x4b400000 << 23 is 0 in 32 bits: the shift leaves n << 23.
    const float y = __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
    return x >= -126.f ? y : x != x ? x : 0.f;
}

__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// x = big + small, both rounded to TF32; the remainder dropped is about 2^-22 |x|. (Leaving small
// to the tensor core's truncation instead doubles that, past the fp32 error bound: bench/NOTES.md.)
__device__ __forceinline__ void split_tf32(float x, uint32_t& big, uint32_t& small) {
    big = to_tf32(x);
    small = to_tf32(x - __uint_as_float(big));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[n] += a * b[n] for N independent n-tiles, from TF32 terms:
//   3 = small*big + big*small + big*big (fp32 accuracy), 2 = without big*small (b exact in TF32,
//   as fp16 and bf16 inputs are), 1 = big*big alone.
// `b` holds each n-tile's two raw fp32 operands. Issuing term by term across the n-tiles keeps N
// independent products between two that share an accumulator.
// `acc(n)` names n-tile n's accumulator (a lambda, so register arrays are indexed by constants).
template <int N, typename Acc>
__device__ __forceinline__ void mma_terms(Acc acc, const uint32_t (&a_big)[4], const uint32_t (&a_small)[4],
                                          const float (&b)[N][2], int terms) {
    uint32_t b_big[N][2], b_small[N][2];
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (terms == 3) split_tf32(b[n][i], b_big[n][i], b_small[n][i]);
            else b_big[n][i] = to_tf32(b[n][i]);
        }
    if (terms >= 2) {
#pragma unroll
        for (int n = 0; n < N; ++n) mma_tf32(acc(n), a_small, b_big[n]);
    }
    if (terms == 3) {
#pragma unroll
        for (int n = 0; n < N; ++n) mma_tf32(acc(n), a_big, b_small[n]);
    }
#pragma unroll
    for (int n = 0; n < N; ++n) mma_tf32(acc(n), a_big, b_big[n]);
}

// 16-bit operands (m16n8k16). ldmatrix gives each lane its fragment of four 8x8 matrices; lane
// 8i + r names row r of matrix i. `.trans` hands out the transposed matrices (used for V).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* smem) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* smem) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
template <bool kBf16>
__device__ __forceinline__ void mma_16bit(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kBf16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
// Two fp32 values rounded to one 16-bit pair, `lo` in the low half (the lower k index).
template <bool kBf16> __device__ __forceinline__ uint32_t pack_16bit(float lo, float hi) {
    if constexpr (kBf16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&h);
    } else {
        const __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&h);
    }
}

// One x4 ldmatrix of B holds two 8-column n-tiles: c's n-tiles j and j + 1 take their products
// for every m-tile.
template <bool kBf16, int MT, int NT>
__device__ __forceinline__ void mma_16bit_pair(float (&c)[MT][NT][4], int j, const uint32_t (&a)[MT][4], const uint32_t (&b)[4]) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        mma_16bit<kBf16>(c[t][j], a[t], b[0], b[1]);
        mma_16bit<kBf16>(c[t][j + 1], a[t], b[2], b[3]);
    }
}

// S (MT m-tiles of 16 rows x BN keys) = Q K^T for one warp from 16-bit shared memory, k-steps of
// 16 columns. One ldmatrix gives an m-tile's A fragment (rows 0-7 / 8-15, columns 0-7 / 8-15),
// another the B fragments of two 8-key n-tiles (K rows are B's columns, so no transpose), which
// every m-tile uses.
template <bool kBf16, int BN, int DP, int LD, int MT>
__device__ __forceinline__ void qk_16bit(float (&s)[MT][BN / 8][4], const uint16_t* q_rows, const uint16_t* k_rows,
                                         int ksteps, int lane) {
    const uint16_t* qa = q_rows + (lane & 15) * LD + 8 * (lane >> 4);
    const uint16_t* kb = k_rows + ((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        if (kk >= ksteps) break;
        uint32_t a[MT][4];
#pragma unroll
        for (int t = 0; t < MT; ++t) ldmatrix_x4(a[t], qa + t * 16 * LD + kk * 16);
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
            uint32_t b[4];
            ldmatrix_x4(b, kb + j * 8 * LD + kk * 16);
            mma_16bit_pair<kBf16>(s, j, a, b);
        }
    }
}

// O (MT m-tiles of 16 rows x DP) += P V for one warp. The A fragment of a 16-key step is the S
// accumulators of two adjacent 8-key n-tiles, rounded to 16 bits; V's fragments come from a
// transposing ldmatrix, two O n-tiles per load, used by every m-tile. O n-tiles wholly in the zero
// padding (from `dtiles` on, in pairs) are skipped.
template <bool kBf16, int BN, int DP, int LD, int MT>
__device__ __forceinline__ void pv_16bit(float (&o)[MT][DP / 8][4], const float (&s)[MT][BN / 8][4],
                                         const uint16_t* v_rows, int dtiles, int lane) {
    const uint16_t* vb = v_rows + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4);
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t a[MT][4];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            a[t][0] = pack_16bit<kBf16>(s[t][2 * ks][0], s[t][2 * ks][1]);
            a[t][1] = pack_16bit<kBf16>(s[t][2 * ks][2], s[t][2 * ks][3]);
            a[t][2] = pack_16bit<kBf16>(s[t][2 * ks + 1][0], s[t][2 * ks + 1][1]);
            a[t][3] = pack_16bit<kBf16>(s[t][2 * ks + 1][2], s[t][2 * ks + 1][3]);
        }
#pragma unroll
        for (int d = 0; d < DP / 8; d += 2) {
            if (d >= dtiles) break;
            uint32_t b[4];
            ldmatrix_x4_trans(b, vb + ks * 16 * LD + d * 8);
            mma_16bit_pair<kBf16>(o, d, a, b);
        }
    }
}

}  // namespace
#endif  // GQA_COMMON_MMA_CUH
