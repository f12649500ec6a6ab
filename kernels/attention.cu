// Causal grouped-query attention, forward, on tensor cores: fp32 inputs at fp32 accuracy (three
// fp16 products on sm_90a, 3xTF32 elsewhere), fp16 and bf16 inputs on 16-bit products.
//
//   q: (B, T, Hq, D)   k, v: (B, T, Hkv, D)   o: (B, T, Hq, D)
//   o[b, t, h] = softmax_j<=t(q[b, t, h] . k[b, j, h / G] / sqrt(D)) . v[b, j, h / G],  G = Hq / Hkv
//
// Work split. One CTA owns kBlockM query rows of one (batch, kv head). The rows are the packed
// (t, g) pairs of that kv head's group, row = t * G + g, so the G query heads that read the same
// K/V share every K/V tile the CTA loads, and a short sequence still fills the M tile. Each warp
// owns 16 of those rows. K/V tiles of kBlockN keys stream through shared memory with cp.async,
// double buffered (three stages on the wgmma path), while the online-softmax state (m, l) and the
// output accumulator stay in registers. Tiles past the CTA's last time step are never visited;
// only tiles that reach past its first time step are masked.
//
// Products. The input dtype is the kernel's template parameter; it picks the shared-memory element
// and the two tile products, and everything else (tiling, masking, online softmax, merges,
// epilogue) is shared.
//  - fp32: mma.sync m16n8k8 TF32. Each fp32 operand x is split into big = tf32(x) and
//    small = tf32(x - big); big*big + big*small + small*big recovers about 21 of fp32's 24 mantissa
//    bits per product, with fp32 accumulation (3xTF32). When the caller allows TF32
//    (torch.backends.cuda.matmul.allow_tf32), only big*big is issued.
//  - fp16 and bf16: shared memory keeps the 16-bit inputs, fragments come from ldmatrix, and both
//    products are mma.sync m16n8k16 with fp32 accumulation; P is rounded to the input dtype for
//    P V, as FlashAttention does.
//  - fp16 and bf16 on sm_90a (kWg, head_dim 64 and 128, 16-byte-aligned rows): one warpgroup of
//    64 rows per CTA, Q, K and V in 128-byte-swizzled shared memory, both products on wgmma, and a
//    software pipeline that computes S of the next tile and its softmax while P V of this one runs.
//  - fp32 on sm_90a (kX3, the same pipeline, head_dim 33..128): each operand scaled by a power of
//    two and split into fp16 hi and lo, three wgmma products per product (see "fp32 on sm_90a as
//    three fp16 products" below); K and V are split once per call into a workspace.
//
// Short sequences (T <= kRowwiseMaxT) and head dims too small for a tensor-core tile go to a
// row-wise fp32 FMA kernel instead (gqa_rowwise_kernel, below): there the cost is latency, not
// arithmetic. dispatch() is the one place that chooses.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gqa_params.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Tile configuration, one place. DP is the compiled head_dim width (D is zero-padded up to it).
// KW is the number of warps that split one K/V tile between them (in-CTA split of the key range).
//  - KW = 1, "long": 4 warps own 64 query rows and walk the keys together. 16-bit inputs with
//    DP <= 128 give each warp two m-tiles (32 rows, 128 per CTA), so every K and V fragment read
//    from shared memory feeds twice the products.
//  - KW = 8, "short" (fp32 only): 8 warps own the same 16 rows, each takes an eighth of every K/V
//    tile, and the partial softmax states are merged at the end. A short sequence then has a much
//    shorter critical path per CTA and 4x more CTAs to spread over the SMs.
// Keys per warp per K/V tile. 16-bit at DP = 128 takes 32 keys, not 64: the smaller stages let three
// CTAs share an SM instead of two, which measured 15-19% faster.
constexpr int tile_block_n(int DP, int KW, bool half) {
    return half ? (DP <= 64 ? 64 : 32) : KW == 1 ? (DP <= 64 ? 64 : 32) : (DP <= 64 ? 16 : 8);
}

// Input element type per dtype code: fp32, or raw 16-bit storage for fp16 and bf16.
using Half16 = uint16_t;
template <int kDtype> using ElemOf = typename std::conditional<kDtype == kGqaFloat32, float, Half16>::type;

// Shared-memory row pitch in elements; shared memory holds the input dtype. fp32: DP + 4 floats is
// 4 (mod 32 banks), so a warp's fragment loads touch 32 distinct banks. 16-bit: DP + 8 moves each
// row by an odd number of 16-byte units, so the 8 rows an ldmatrix reads hit distinct banks.
template <typename Elem, int DP> __host__ __device__ constexpr int tile_ld() { return std::is_same<Elem, float>::value ? DP + 4 : DP + 8; }

// kWg: the sm_90a variant (head_dim 64 and 128): one warpgroup of 64 rows (16-bit: two CTAs per
// SM run independently, so one's softmax overlaps the other's products), both products on wgmma,
// Q, K and V in 128-byte-swizzled shared memory (no padding), three K/V stages. With fp32 (x3)
// the room of each fp32 tile holds the tile's fp16 hi values, then its fp16 lo values.
template <int DP, int KW, typename Elem, bool kWg = false> struct TileTraits {
    static constexpr bool kHalf = !std::is_same<Elem, float>::value;
    static constexpr int kWarps = KW == 1 ? 4 : KW;
    static constexpr int kRowWarps = kWarps / KW;        // warps stacked along the query rows
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kMTiles = !kWg && kHalf && DP <= 128 ? 2 : 1;   // 16-row mma m-tiles per warp
    static constexpr int kBlockM = 16 * kMTiles * kRowWarps;     // query rows per CTA
    static constexpr int kBlockN = kWg ? 64 : tile_block_n(DP, KW, kHalf);   // keys per warp per tile
    static constexpr int kTileKeys = kBlockN * KW;       // keys per shared-memory stage
    // wgmma: three stages, so a tile's copies have a whole iteration to land while the next S and
    // this P V are in flight.
    static constexpr int kStages = kWg ? 3 : 2;
    static constexpr int kLd = kWg ? DP : tile_ld<Elem, DP>();   // swizzled rows carry no padding
    static constexpr size_t kKvElems = size_t(2) * kStages * kTileKeys * kLd;
    // wgmma: 1024 bytes of slack to align the swizzled tiles.
    static constexpr size_t kSmemBytes = sizeof(Elem) * (size_t(kLd) * kBlockM + kKvElems) + (kWg ? 1024 : 0);
    // The key-split merge reuses the K/V buffers: per warp, each lane's O fragment plus (m, l).
    static constexpr size_t kMergeFloats = size_t(kWarps) * 32 * (DP / 2 + 4);
    static_assert(DP % 32 == 0, "compiled head_dim widths are multiples of 32");
    static_assert(kBlockN % (kHalf ? 16 : 8) == 0, "kBlockN is a whole number of mma k-steps and n-tiles");
    static_assert(kWarps % KW == 0, "the split warps must divide the CTA");
    static_assert(!kHalf || KW == 1, "16-bit inputs use the long variant only");
    static_assert(kHalf || kMTiles == 1, "the TF32 products take one m-tile per warp");
    static_assert(!kWg || (KW == 1 && (DP == 64 || DP == 128)), "wgmma: head_dim 64 or 128");
    static_assert(KW == 1 || sizeof(float) * kMergeFloats <= sizeof(Elem) * kKvElems,
                  "merge scratch must fit in the K/V buffers");
};

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

__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// x = big + small, both rounded to TF32; the remainder dropped is about 2^-22 |x|. (Leaving small
// to the tensor core's truncation instead doubles that, and measured 1.03e-5 norm-relative error
// at T=4097, D=1, against 1e-5 allowed.)
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
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                mma_16bit<kBf16>(s[t][j], a[t], b[0], b[1]);
                mma_16bit<kBf16>(s[t][j + 1], a[t], b[2], b[3]);
            }
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
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                mma_16bit<kBf16>(o[t][d], a[t], b[0], b[1]);
                mma_16bit<kBf16>(o[t][d + 1], a[t], b[2], b[3]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// sm_90a: wgmma, the warpgroup (4 warps, 64 rows) MMA. Its shared-memory operands use the 128-byte
// swizzle: a tile of `rows` rows of 16-bit values is stored as 64-column blocks of [rows][128 bytes],
// and 16-byte chunk c of row r sits at chunk c ^ (r % 8). A descriptor gives a block's start (the
// block is 1024-byte aligned), the step between 8-row groups (1024 bytes) and the swizzle mode.
// The accumulator layout per warp is the mma.sync m16n8 layout repeated over the n-tiles, and a
// register A operand is the m16n8k16 A fragment, so the softmax and P packing are shared.
__host__ __device__ constexpr uint32_t sw128_offset(int r, int c, int rows) {   // bytes, element (r, c)
    return uint32_t((c / 64) * rows * 128 + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) + (c % 8) * 2);
}
[[maybe_unused]] __device__ __forceinline__ uint64_t wg_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) | (uint64_t((sbo & 0x3FFFF) >> 4) << 32) |
           (uint64_t(1) << 62);
}
[[maybe_unused]] __device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
[[maybe_unused]] __device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are still running.
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Pins every register of an accumulator array at this point of the program: the compiler sees
// a write of each, so no access to it moves across a wgmma wait next to it.
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Makes this thread's ordinary shared-memory writes (cp.async included) visible to wgmma's reads.
[[maybe_unused]] __device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Each wgmma wrapper below is one asm statement; the input type (bf16 or f16) is spliced into
// the instruction name, so both types share one operand list.
#define GQA_ASM_WGMMA_SS_N64(TY) \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                     : "l"(da), "l"(db), "r"(accumulate))
template <bool kBf16>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kBf16) GQA_ASM_WGMMA_SS_N64("bf16");
    else GQA_ASM_WGMMA_SS_N64("f16");
#else
    __trap();
#endif
}
#undef GQA_ASM_WGMMA_SS_N64
#define GQA_ASM_WGMMA_RS_TB_N64(TY) \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate))
template <bool kBf16>
__device__ __forceinline__ void wgmma_rs_tb_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kBf16) GQA_ASM_WGMMA_RS_TB_N64("bf16");
    else GQA_ASM_WGMMA_RS_TB_N64("f16");
#else
    __trap();
#endif
}
#undef GQA_ASM_WGMMA_RS_TB_N64
#define GQA_ASM_WGMMA_RS_TB_N128(TY) \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate))
template <bool kBf16>
__device__ __forceinline__ void wgmma_rs_tb_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kBf16) GQA_ASM_WGMMA_RS_TB_N128("bf16");
    else GQA_ASM_WGMMA_RS_TB_N128("f16");
#else
    __trap();
#endif
}
#undef GQA_ASM_WGMMA_RS_TB_N128

// S (the warpgroup's 64 rows x 64 keys; each warp holds its 16 rows as s[8][4]) = Q K^T. Q is a
// swizzled tile of QR rows whose warpgroup rows start at `q_row0`, K a swizzled tile of KR rows.
// Issued without a commit: the caller commits, and s is not valid before the matching wg_wait.
// `accumulate`: add to s instead of starting from zero.
template <bool kBf16, int DP, int QR, int KR>
__device__ __forceinline__ void qk_wgmma(float (&s)[8][4], const uint16_t* q_tile, int q_row0, const uint16_t* k_tile,
                                         bool accumulate = false) {
    const unsigned char* qb = reinterpret_cast<const unsigned char*>(q_tile) + q_row0 * 128;
    const unsigned char* kb = reinterpret_cast<const unsigned char*>(k_tile);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        const int blk = kk / 4, col = (kk % 4) * 32;   // 64-column block, byte offset of the k-step
        wgmma_ss_n64<kBf16>(reinterpret_cast<float(&)[32]>(s), wg_desc(qb + blk * QR * 128 + col, 16, 1024),
                            wg_desc(kb + blk * KR * 128 + col, 16, 1024), kk > 0 || accumulate);
    }
}

// P, the probabilities of a 64-key S tile, as the four k16 A fragments of P V (16-bit).
template <bool kBf16> __device__ __forceinline__ void pack_p(uint32_t (&a)[4][4], const float (&s)[8][4]) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        a[ks][0] = pack_16bit<kBf16>(s[2 * ks][0], s[2 * ks][1]);
        a[ks][1] = pack_16bit<kBf16>(s[2 * ks][2], s[2 * ks][3]);
        a[ks][2] = pack_16bit<kBf16>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        a[ks][3] = pack_16bit<kBf16>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
    }
}

// O (the warpgroup's 64 rows x DP) += P V, P packed by pack_p. Issued without a commit: neither
// o nor a may be touched before the caller's matching wg_wait.
// V is a swizzled tile of KR rows (keys) read N-major (transposed) by the instruction: 8-key
// groups 1024 bytes apart (the stride byte offset), 64-column blocks KR * 128 bytes apart (the
// leading byte offset).
// `accumulate` false: o starts from zero.
template <bool kBf16, int DP, int KR>
__device__ __forceinline__ void pv_wgmma(float (&o)[DP / 8][4], const uint32_t (&a)[4][4], const uint16_t* v_tile,
                                         bool accumulate = true) {
    const unsigned char* vb = reinterpret_cast<const unsigned char*>(v_tile);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const uint64_t db = wg_desc(vb + ks * 16 * 128, KR * 128, 1024);
        if constexpr (DP == 64) wgmma_rs_tb_n64<kBf16>(reinterpret_cast<float(&)[32]>(o), a[ks], db, ks > 0 || accumulate);
        else wgmma_rs_tb_n128<kBf16>(reinterpret_cast<float(&)[64]>(o), a[ks], db, ks > 0 || accumulate);
    }
}

// ---------------------------------------------------------------------------------------------
// fp32 on sm_90a as three fp16 products ("x3": head_dim 33..128, 16-byte-aligned rows, a grid
// that fills the GPU). Each fp32 operand x, times a power of two 2^e, is split into
// hi = fp16(x 2^e) and lo = fp16(x 2^e - hi); a product is summed as hi*lo + lo*hi + hi*hi
// (lo*lo, about 2^-22 of it, is dropped). e puts the largest finite |x| of its group in
// [2^14, 2^15): inside fp16's range, with lo far above fp16's subnormals. Groups: K per (batch,
// kv head); V per (batch, kv head, channel), so a channel far smaller than the head's largest
// keeps its bits (its scale is undone per output column in the epilogue); both scanned and split
// into the workspace by x3_absmax_kernel and x3_split_kernel before the attention kernel; Q per
// CTA tile, split by the attention kernel as it loads the tile (each Q tile is read once); P,
// times 2^kX3PShift. The small terms go first in each product, and
// P V starts from zero in every tile and is added to O in fp32: the tensor core does not round
// its additions to nearest, so only the few additions of the hi*hi terms carry that error.
// Inf or NaN in a CTA's Q tile, or in its head's K or V, leaves the CTA to the 3xTF32 kernel,
// launched next with `redo` naming those CTAs.
constexpr int kX3Top = 14;          // the scaled group maximum lies in [2^kX3Top, 2^(kX3Top + 1))
constexpr float kX3PShift = 12.f;   // P = exp2(s - m + kX3PShift) <= 2^12 before its split
constexpr int kX3Rows = 64;         // rows per CTA of the K/V scan and split
constexpr int kX3Threads = 256;

struct X3Work {         // the workspace, carved up
    Half16* kv;         // [2 (K, V)][B * Hkv][T][2 (hi, lo)][DP]
    uint32_t* absmax_k; // [B * Hkv]: largest finite |x| of the head's K, as float bits
    uint32_t* absmax_v; // [B * Hkv][DP]: largest finite |x| of each channel of the head's V
    uint32_t* bad;      // [B * Hkv]: Inf or NaN in the head's K or V
    uint8_t* redo;      // [CTAs of the attention kernel]: 1 = left to the 3xTF32 kernel
};
__host__ __device__ inline int64_t x3_kv_elems(const GqaParams& p, int DP) { return int64_t(4) * p.B * p.Hkv * p.T * DP; }
// Bytes of absmax_k, absmax_v and bad, which lie together and start at zero on every call.
__host__ __device__ inline int64_t x3_stats_bytes(const GqaParams& p, int DP) {
    return int64_t(sizeof(uint32_t)) * p.B * p.Hkv * (DP + 2);
}
__host__ __device__ inline X3Work x3_work(const GqaParams& p, int DP) {
    char* base = static_cast<char*>(p.workspace);
    X3Work w;
    w.kv = reinterpret_cast<Half16*>(base);
    w.absmax_k = reinterpret_cast<uint32_t*>(base + x3_kv_elems(p, DP) * int64_t(sizeof(Half16)));
    w.absmax_v = w.absmax_k + p.B * p.Hkv;
    w.bad = w.absmax_v + int64_t(p.B) * p.Hkv * DP;
    w.redo = reinterpret_cast<uint8_t*>(w.bad + p.B * p.Hkv);
    return w;
}
// The group's e from its largest finite |x| (0 for an all-zero group), branch-free (ilogbf's
// branches kept the epilogue's 32 reads of channel maxima from being issued together): the
// exponent field of a normal value, the top set bit of a subnormal one (value = bits * 2^-149).
__device__ __forceinline__ int x3_exponent(uint32_t absmax_bits) {
    const int biased = int(absmax_bits >> 23);
    const int ilogb = biased > 0 ? biased - 127 : -118 - __clz(int(absmax_bits));
    return absmax_bits != 0u ? kX3Top - ilogb : 0;
}
__device__ __forceinline__ float pow2_exact(int e) { return __int_as_float((e + 127) << 23); }   // e in -126..127
// x * 2^e for |e| <= 252, as two exact power-of-two factors.
__device__ __forceinline__ float x3_scale(float x, int e) { return x * pow2_exact(e / 2) * pow2_exact(e - e / 2); }
__device__ __forceinline__ uint32_t half2_bits(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
// Two scaled values as packed fp16 hi and lo pairs, `a` in the low half.
__device__ __forceinline__ void x3_split2(float a, float b, uint32_t& hi, uint32_t& lo) {
    const __half2 h = __floats2half2_rn(a, b);
    const float2 back = __half22float2(h);
    hi = half2_bits(h);
    lo = half2_bits(__floats2half2_rn(a - back.x, b - back.y));
}
// P of a 64-key tile (already times 2^kX3PShift) as hi and lo k16 A fragments, as pack_p lays them.
__device__ __forceinline__ void x3_split_p(uint32_t (&hi)[4][4], uint32_t (&lo)[4][4], const float (&s)[8][4]) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        x3_split2(s[2 * ks][0], s[2 * ks][1], hi[ks][0], lo[ks][0]);
        x3_split2(s[2 * ks][2], s[2 * ks][3], hi[ks][1], lo[ks][1]);
        x3_split2(s[2 * ks + 1][0], s[2 * ks + 1][1], hi[ks][2], lo[ks][2]);
        x3_split2(s[2 * ks + 1][2], s[2 * ks + 1][3], hi[ks][3], lo[ks][3]);
    }
}
__device__ __forceinline__ void abs_max_finite(float x, float& mx, bool& bad) {
    const float a = fabsf(x);
    if (a <= 3.402823466e38f) mx = fmaxf(mx, a);   // false for Inf and NaN
    else bad = true;
}

// Element I/O. fp16 and bf16 travel as raw 16-bit storage; the row-wise kernel takes their kind as
// a run-time flag (uniform across the grid), the tiled kernel as its template parameter.
__device__ __forceinline__ float to_float(float x, bool) { return x; }
__device__ __forceinline__ float to_float(Half16 x, bool bf16) {
    return bf16 ? __uint_as_float(uint32_t(x) << 16) : __half2float(__ushort_as_half(x));
}

template <typename Elem> __device__ __forceinline__ Elem from_float(float x, bool bf16);
template <> __device__ __forceinline__ float from_float<float>(float x, bool) { return x; }
template <> __device__ __forceinline__ Half16 from_float<Half16>(float x, bool bf16) {
    return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
// Two adjacent output values as one store; dst is aligned to twice the element size.
__device__ __forceinline__ void store_pair(float* dst, float a, float b, bool) { *reinterpret_cast<float2*>(dst) = make_float2(a, b); }
__device__ __forceinline__ void store_pair(Half16* dst, float a, float b, bool bf16) {
    *reinterpret_cast<uint32_t*>(dst) = uint32_t(from_float<Half16>(a, bf16)) | uint32_t(from_float<Half16>(b, bf16)) << 16;
}

// Copies the first `rows` (<= ROWS) rows of D elements into shared memory of the input dtype, row
// pitch tile_ld, zero-filling columns D..DP-1 and rows whose pointer is null (past the end of the
// sequence): zeros there keep the padded products exact and keep garbage out of P.V.
// With every row start 16-byte aligned, 16-byte cp.async copies; otherwise 4-byte cp.async for
// fp32 and synchronous element copies for 16-bit types.
// kSw: the 128-byte-swizzled layout of the wgmma variant (tile of ROWS rows) instead of the padded pitch.
template <typename Elem, int DP, int ROWS, int NTHREADS, bool kSw = false, typename RowPtr>
__device__ __forceinline__ void load_rows(Elem* dst, RowPtr row_ptr, const Elem* any_valid, int rows, int D, bool vec16) {
    constexpr int kLd = tile_ld<Elem, DP>();
    auto at = [](int r, int c) { return kSw ? int(sw128_offset(r, c, ROWS) / sizeof(Elem)) : r * kLd + c; };
    if (vec16) {
        constexpr int kWidth = 16 / int(sizeof(Elem));   // elements per 16-byte copy
        constexpr int kChunks = DP / kWidth;
#pragma unroll 4
        for (int i = threadIdx.x; i < rows * kChunks; i += NTHREADS) {
            const int r = i / kChunks, c = (i % kChunks) * kWidth;
            const Elem* src = row_ptr(r);
            const bool ok = src != nullptr && c < D;
            cp_async16(dst + at(r, c), ok ? src + c : any_valid, ok ? 16 : 0);
        }
    } else if constexpr (std::is_same<Elem, float>::value) {
#pragma unroll 4
        for (int i = threadIdx.x; i < rows * DP; i += NTHREADS) {
            const int r = i / DP, c = i % DP;
            const float* src = row_ptr(r);
            const bool ok = src != nullptr && c < D;
            cp_async4(dst + at(r, c), ok ? src + c : any_valid, ok ? 4 : 0);
        }
    } else {
        for (int i = threadIdx.x; i < rows * DP; i += NTHREADS) {
            const int r = i / DP, c = i % DP;
            const Elem* src = row_ptr(r);
            dst[at(r, c)] = (src != nullptr && c < D) ? src[c] : Elem(0);
        }
    }
}

__device__ __forceinline__ bool nonfinite_value(float x, bool) { return !isfinite(x); }
__device__ __forceinline__ bool nonfinite_value(Half16 x, bool bf16) {
    return bf16 ? (x & 0x7f80u) == 0x7f80u : (x & 0x7c00u) == 0x7c00u;   // exponent all ones
}

// The wgmma variant's K/V stage: ROWS rows from key n0 in 16-byte copies into the swizzled layout,
// rows past T zero-filled. Each thread keeps one 16-byte column chunk and walks rows kRowStep
// apart (a multiple of 8, so the swizzle phase stays put): its shared offset and global pointer
// advance by constants. `own_tile_sw_zero_nonfinite` reads back exactly these copies (and
// replaces Inf and NaN among them by zeros).
template <typename Elem, int DP, int ROWS, int NT> struct SwTileMap {
    static constexpr int kChunks = DP * int(sizeof(Elem)) / 16;   // 16-byte chunks per row
    static constexpr int kRowStep = NT / kChunks;
    static_assert(NT % kChunks == 0 && kRowStep % 8 == 0 && ROWS % kRowStep == 0, "swizzled tile copy mapping");
    static __device__ __forceinline__ int row() { return int(threadIdx.x) / kChunks; }
    static __device__ __forceinline__ int col() { return int(threadIdx.x) % kChunks * (16 / int(sizeof(Elem))); }
};
template <typename Elem, int DP, int ROWS, int NT>
__device__ __forceinline__ void load_tile_sw(Elem* dst, const Elem* base, int64_t stride, int n0, int T, int D) {
    using M = SwTileMap<Elem, DP, ROWS, NT>;
    const int r = M::row(), c = M::col();
    char* d = reinterpret_cast<char*>(dst) + sw128_offset(r, c, ROWS);
    const Elem* src = base + int64_t(n0 + r) * stride + c;
    const int64_t step = int64_t(M::kRowStep) * stride;
    const int rows_left = c < D ? T - n0 - r : 0;   // this thread's rows that exist
#pragma unroll
    for (int k = 0; k < ROWS / M::kRowStep; ++k) {
        const bool ok = k * M::kRowStep < rows_left;
        cp_async16(d + k * M::kRowStep * 128, ok ? src : base, ok ? 16 : 0);
        src += step;
    }
}
template <typename Elem, int DP, int ROWS, int NT>
__device__ __forceinline__ bool own_tile_sw_zero_nonfinite(Elem* dst, bool bf16) {
    static_assert(sizeof(Elem) == 2, "16-bit tiles only");
    using M = SwTileMap<Elem, DP, ROWS, NT>;
    constexpr int kCopies = ROWS / M::kRowStep;
    char* x = reinterpret_cast<char*>(dst) + sw128_offset(M::row(), M::col(), ROWS);
    // A value is Inf or NaN when its exponent field is all ones: adding one at the field's lowest
    // bit then carries into the value's sign bit, and only then. Fields are masked first, so no
    // carry crosses from one value of a word into the other.
    const uint32_t field = bf16 ? 0x7f807f80u : 0x7c007c00u;
    const uint32_t unit = bf16 ? 0x00800080u : 0x04000400u;
    auto carries = [&](uint32_t w) { return ((w & field) + unit) & 0x80008000u; };
    uint32_t hit = 0;
#pragma unroll
    for (int k = 0; k < kCopies; ++k) {
        const uint4 w = *reinterpret_cast<const uint4*>(x + k * M::kRowStep * 128);
        hit |= carries(w.x) | carries(w.y) | carries(w.z) | carries(w.w);
    }
    if (hit == 0) return false;
#pragma unroll 1
    for (int k = 0; k < kCopies; ++k) {
        uint32_t* w = reinterpret_cast<uint32_t*>(x + k * M::kRowStep * 128);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t c = carries(w[i]);
            w[i] &= (c & 0x8000u ? 0xffff0000u : 0xffffffffu) & (c & 0x80000000u ? 0x0000ffffu : 0xffffffffu);
        }
    }
    return true;
}

// x3: the CTA's Q tile (BM rows of D fp32 values from row_ptr, null rows and columns past D as
// zeros), times 2^e with e from its largest finite |x|, stored as fp16 hi and lo tiles in the
// swizzled layout. Returns whether the tile holds Inf or NaN (the same answer in every thread).
// `red` is NT / 32 words of shared memory that nothing else touches until the next barrier.
template <int DP, int BM, int NT, typename RowPtr>
__device__ __forceinline__ bool x3_load_q(Half16* hi, Half16* lo, RowPtr row_ptr, int D, int& e, uint32_t* red) {
    constexpr int kChunks = DP / 4;   // float4 per row
    constexpr int kPer = BM * kChunks / NT;
    static_assert(BM * kChunks % NT == 0, "Q tile copy mapping");
    float4 x[kPer];
    float mx = 0.f;
    bool bad = false;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
        const int i = int(threadIdx.x) + k * NT, r = i / kChunks, c = (i % kChunks) * 4;
        const float* src = row_ptr(r);
        x[k] = src != nullptr && c < D ? *reinterpret_cast<const float4*>(src + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        abs_max_finite(x[k].x, mx, bad);
        abs_max_finite(x[k].y, mx, bad);
        abs_max_finite(x[k].z, mx, bad);
        abs_max_finite(x[k].w, mx, bad);
    }
    const uint32_t warp_max = __reduce_max_sync(0xffffffffu, __float_as_uint(mx));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = warp_max;
    const bool any_bad = __syncthreads_or(bad);
    uint32_t all_max = 0;
#pragma unroll
    for (int w = 0; w < NT / 32; ++w) all_max = max(all_max, red[w]);
    e = x3_exponent(all_max);
    const float f1 = pow2_exact(e / 2), f2 = pow2_exact(e - e / 2);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
        const int i = int(threadIdx.x) + k * NT, r = i / kChunks, c = (i % kChunks) * 4;
        uint2 h, l;
        x3_split2(x[k].x * f1 * f2, x[k].y * f1 * f2, h.x, l.x);
        x3_split2(x[k].z * f1 * f2, x[k].w * f1 * f2, h.y, l.y);
        const uint32_t off = sw128_offset(r, c, BM);
        *reinterpret_cast<uint2*>(reinterpret_cast<char*>(hi) + off) = h;
        *reinterpret_cast<uint2*>(reinterpret_cast<char*>(lo) + off) = l;
    }
    return any_bad;
}

// True if any value this thread copied with load_rows (same arguments, same thread mapping) is
// not finite. Reading back only its own copies needs no barrier: cp.async.wait_group (or the
// plain stores of the synchronous path) already made them visible to this thread.
template <typename Elem, int DP, int NTHREADS>
__device__ __forceinline__ bool own_copies_nonfinite(const Elem* dst, int rows, bool vec16, bool bf16) {
    constexpr int kLd = tile_ld<Elem, DP>();
    constexpr int kWidth = 16 / int(sizeof(Elem));   // elements per 16-byte copy
    bool bad = false;
    if (vec16) {
        constexpr int kChunks = DP / kWidth;
        for (int i = threadIdx.x; i < rows * kChunks; i += NTHREADS) {
            const Elem* x = dst + (i / kChunks) * kLd + (i % kChunks) * kWidth;
#pragma unroll
            for (int e = 0; e < kWidth; ++e) bad |= nonfinite_value(x[e], bf16);
        }
    } else {
        for (int i = threadIdx.x; i < rows * DP; i += NTHREADS) bad |= nonfinite_value(dst[(i / DP) * kLd + i % DP], bf16);
    }
    return bad;
}

// S (16 rows x BN keys) = Q K^T for one warp from fp32 shared memory, `terms` TF32 products per
// product (mma_terms), k-steps of 8 columns. A tile holding Inf or NaN (`nonfinite`) takes plain
// fp32 dot products instead: an infinite k gives +-inf scores as in the reference rather than the
// NaN that inf - tf32(inf) would give. Its loops stay rolled: the path is rare, and unrolling it
// would multiply the code every instantiation compiles.
template <int BN, int DP, int LD>
__device__ __forceinline__ void qk_tf32(float (&s)[BN / 8][4], const float* q_rows, const float* Kt, int D, int terms,
                                        bool nonfinite, int lane) {
    constexpr int kNTiles = BN / 8;
    const int gid = lane >> 2, tig = lane & 3;
    if (nonfinite) {
#pragma unroll 1
        for (int je = 0; je < kNTiles * 4; ++je) {
            const float* qr = q_rows + (gid + 8 * ((je & 3) >> 1)) * LD;
            const float* kr = Kt + ((je >> 2) * 8 + 2 * tig + (je & 1)) * LD;
            float acc = 0.f;
#pragma unroll 1
            for (int c = 0; c < D; ++c) acc = fmaf(qr[c], kr[c], acc);
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (je == j * 4 + e) s[j][e] = acc;
        }
    }
    for (int kk = 0; kk < (nonfinite ? 0 : (D + 7) / 8); ++kk) {
        const float* qa = q_rows + gid * LD + kk * 8 + tig;
        uint32_t a_big[4], a_small[4];
        split_tf32(qa[0], a_big[0], a_small[0]);
        split_tf32(qa[8 * LD], a_big[1], a_small[1]);
        split_tf32(qa[4], a_big[2], a_small[2]);
        split_tf32(qa[8 * LD + 4], a_big[3], a_small[3]);
        float kb[kNTiles][2];
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
            const float* src = Kt + (j * 8 + gid) * LD + kk * 8 + tig;
            kb[j][0] = src[0];
            kb[j][1] = src[4];
        }
        mma_terms<kNTiles>([&](int n) -> float(&)[4] { return s[n]; }, a_big, a_small, kb, terms);
    }
}

// O (16 rows x DP) += P V for one warp from fp32 shared memory. The accumulator layout of S is
// reused as the A operand by reading the k index kappa of the product as key 2*kappa (kappa < 4)
// or 2*(kappa-4)+1, and V's rows likewise. Each tile's P V is summed from zero and then added to O
// in ordinary fp32: the tensor core's accumulation does not round to nearest, and feeding it O
// itself let that bias grow with the number of keys. O n-tiles from `dtiles` on (in groups) are
// wholly in the zero padding and skipped.
template <int BN, int DP, int LD>
__device__ __forceinline__ void pv_tf32(float (&o)[DP / 8][4], const float (&s)[BN / 8][4], const float* Vt, int dtiles,
                                        int terms, int lane) {
    constexpr int kNTiles = BN / 8;
    constexpr int kDTiles = DP / 8;
    constexpr int kDGroup = 4;   // O n-tiles issued together
    const int gid = lane >> 2, tig = lane & 3;
    uint32_t p_big[kNTiles][4], p_small[kNTiles][4];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
        split_tf32(s[j][0], p_big[j][0], p_small[j][0]);
        split_tf32(s[j][2], p_big[j][1], p_small[j][1]);
        split_tf32(s[j][1], p_big[j][2], p_small[j][2]);
        split_tf32(s[j][3], p_big[j][3], p_small[j][3]);
    }
#pragma unroll
    for (int d0 = 0; d0 < kDTiles; d0 += kDGroup) {
        if (d0 >= dtiles) break;
        float pv[kDGroup][4];
#pragma unroll
        for (int d = 0; d < kDGroup; ++d) pv[d][0] = pv[d][1] = pv[d][2] = pv[d][3] = 0.f;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
            const float* vsrc = Vt + (j * 8 + 2 * tig) * LD + gid;
            float vb[kDGroup][2];
#pragma unroll
            for (int d = 0; d < kDGroup; ++d) {
                vb[d][0] = vsrc[(d0 + d) * 8];
                vb[d][1] = vsrc[LD + (d0 + d) * 8];
            }
            mma_terms<kDGroup>([&](int n) -> float(&)[4] { return pv[n]; }, p_big[j], p_small[j], vb, terms);
        }
#pragma unroll
        for (int d = 0; d < kDGroup; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[d0 + d][e] += pv[d][e];
    }
}

// Division of a non-negative int below 2^31 by a divisor d fixed at launch: with l = ceil(log2 d)
// and m = ceil(2^(31+l) / d), floor(n / d) = floor(m n / 2^(31+l)), one multiply-high and a shift.
struct FastDiv {
    int d;
    uint32_t mul;
    int shift;
    FastDiv() = default;
    explicit FastDiv(int divisor) : d(divisor), mul(0), shift(0) {
        if (d > 1) {
            int l = 0;
            while ((int64_t(1) << l) < d) ++l;
            mul = uint32_t(((uint64_t(1) << (31 + l)) + uint64_t(d) - 1) / uint64_t(d));
            shift = l - 1;
        }
    }
    __device__ __forceinline__ int div(int n) const { return d == 1 ? n : int(__umulhi(uint32_t(n), mul) >> shift); }
};

// The tiled kernel's divisors: CTA index -> (row tile, batch and kv head), packed row -> time step.
struct TileDivs {
    FastDiv bh;      // B * Hkv
    FastDiv hkv;     // Hkv
    FastDiv group;   // G
};

// ---------------------------------------------------------------------------------------------
template <int kDtype, int DP, int KW, bool kWg>
__global__ void __launch_bounds__(TileTraits<DP, KW, ElemOf<kDtype>, kWg>::kThreads)
gqa_fwd_kernel(const GqaParams p, const TileDivs dv) {
    using Elem = ElemOf<kDtype>;
    using Tr = TileTraits<DP, KW, Elem, kWg>;
    constexpr bool kHalf = Tr::kHalf;
    constexpr bool kX3 = kWg && !kHalf;   // fp32 as three fp16 products: shared memory holds hi and lo
    constexpr bool bf16 = kDtype == kGqaBFloat16;
    constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, LD = Tr::kLd, NT = Tr::kThreads;
    constexpr int TK = Tr::kTileKeys;
    constexpr int kNTiles = BN / 8;   // mma n-tiles of S per K/V tile
    constexpr int kDTiles = DP / 8;   // mma n-tiles of O
    constexpr int MT = Tr::kMTiles;   // 16-row m-tiles per warp
    constexpr int kRows = 2 * MT;     // rows per thread: gid and gid + 8 of each m-tile

    extern __shared__ float4 smem_raw[];
    // [BM][LD]; wgmma: swizzled, from the first 1024-byte boundary
    Elem* sQ = reinterpret_cast<Elem*>(kWg ? (reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024
                                           : reinterpret_cast<uintptr_t>(smem_raw));
    Elem* sK = sQ + BM * LD;                          // [kStages][TK][LD]
    Elem* sV = sK + Tr::kStages * TK * LD;            // [kStages][TK][LD]

    const int G = p.group, T = p.T;
    const int bh_count = p.B * p.Hkv;
    const int rows_total = T * G;   // T * Hq < 2^31 is checked on the host
    const int n_qtiles = (rows_total + BM - 1) / BM;
    // Longest rows first: the first wave of CTAs takes the last query tile of every (b, kv head).
    const int bh_tile = dv.bh.div(int(blockIdx.x));
    const int qtile = n_qtiles - 1 - bh_tile;
    const int bh = int(blockIdx.x) - bh_tile * bh_count;
    if constexpr (!kWg && !kHalf) {
        if (p.redo != nullptr && p.redo[blockIdx.x] == 0) return;   // done by the x3 kernel
    }
    const int b = dv.hkv.div(bh), kvh = bh - b * p.Hkv;

    const int r0 = qtile * BM;
    const int t_lo = dv.group.div(r0);   // time step of the CTA's first row
    const int t_hi = min(dv.group.div(r0 + BM - 1), T - 1);
    const int n_kv = t_hi / TK + 1;            // K/V tiles this CTA visits

    const Elem* q_base = static_cast<const Elem*>(p.q) + b * p.q_stride_b + int64_t(kvh) * G * p.q_stride_h;
    const Elem* k_base = static_cast<const Elem*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
    const Elem* v_base = static_cast<const Elem*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;

    auto q_row = [&](int r) -> const Elem* {
        const int R = r0 + r;
        if (R >= rows_total) return nullptr;
        const int t = dv.group.div(R);
        return q_base + int64_t(t) * p.q_stride_t + int64_t(R - t * G) * p.q_stride_h;
    };
    // Keys past t_hi are read by no warp, except the zero-filled tail of the last warp slice.
    auto kv_rows = [&](int tile) { return min(TK, (t_hi + 1 - tile * TK + BN - 1) / BN * BN); };
    // x3: this head's split K and V rows in the workspace, [T][hi, lo][DP] each.
    const Half16* x3_k = nullptr;
    const Half16* x3_v = nullptr;
    if constexpr (kX3) {
        x3_k = x3_work(p, DP).kv + int64_t(bh) * T * 2 * DP;
        x3_v = x3_k + int64_t(bh_count) * T * 2 * DP;
    }
    auto load_kv = [&](int tile, int stage) {
        const int n0 = tile * TK;
        auto k_row = [&](int r) -> const Elem* { return n0 + r < T ? k_base + int64_t(n0 + r) * p.k_stride_t : nullptr; };
        auto v_row = [&](int r) -> const Elem* { return n0 + r < T ? v_base + int64_t(n0 + r) * p.v_stride_t : nullptr; };
        if constexpr (kX3) {   // a stage of TK * LD floats holds the hi tile, then the lo tile
            Half16* kd = reinterpret_cast<Half16*>(sK + stage * TK * LD);
            Half16* vd = reinterpret_cast<Half16*>(sV + stage * TK * LD);
            load_tile_sw<Half16, DP, TK, NT>(kd, x3_k, 2 * DP, n0, T, DP);
            load_tile_sw<Half16, DP, TK, NT>(kd + TK * LD, x3_k + DP, 2 * DP, n0, T, DP);
            load_tile_sw<Half16, DP, TK, NT>(vd, x3_v, 2 * DP, n0, T, DP);
            load_tile_sw<Half16, DP, TK, NT>(vd + TK * LD, x3_v + DP, 2 * DP, n0, T, DP);
        } else if constexpr (kWg) {   // launched only with 16-byte-aligned rows
            load_tile_sw<Elem, DP, TK, NT>(sK + stage * TK * LD, k_base, p.k_stride_t, n0, T, p.D);
            load_tile_sw<Elem, DP, TK, NT>(sV + stage * TK * LD, v_base, p.v_stride_t, n0, T, p.D);
        } else {
            const int rows = kv_rows(tile);
            load_rows<Elem, DP, TK, NT, kWg>(sK + stage * TK * LD, k_row, k_base, rows, p.D, p.vec16);
            load_rows<Elem, DP, TK, NT, kWg>(sV + stage * TK * LD, v_row, v_base, rows, p.D, p.vec16);
        }
    };

    if constexpr (!kX3) load_rows<Elem, DP, BM, NT, kWg>(sQ, q_row, q_base, BM, p.D, p.vec16);
    load_kv(0, 0);
    cp_async_commit();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane >> 2, tig = lane & 3;   // mma group id (row) and thread in group (column)
    const int wrow = (warp % Tr::kRowWarps) * 16 * MT;   // the warp's first row in the tile
    const int wkey = (warp / Tr::kRowWarps) * BN;   // the warp's first key in each K/V tile
    const int ksteps = (p.D + 7) / 8;            // 8-column steps that touch real columns
    const int terms = p.tf32_single ? 1 : 3;     // TF32 products per fp32 product
    float scale_log2 = p.scale_log2;   // x3: also undoes the scales of Q and K
    const uint32_t* x3_vmax = nullptr; // x3: V's channel maxima, whose scales the epilogue undoes
    if constexpr (kX3) {
        const X3Work w = x3_work(p, DP);
        int eq = 0;
        uint32_t* red = reinterpret_cast<uint32_t*>(sV + (Tr::kStages - 1) * TK * LD);   // first filled in the loop
        const bool q_bad = x3_load_q<DP, BM, NT>(reinterpret_cast<Half16*>(sQ), reinterpret_cast<Half16*>(sQ) + BM * LD,
                                                 q_row, p.D, eq, red);
        const bool bail = q_bad || w.bad[bh] != 0;
        if (threadIdx.x == 0) w.redo[blockIdx.x] = bail;
        if (bail) {   // the whole CTA: its 3xTF32 twin takes these rows
            cp_async_wait<0>();
            return;
        }
        scale_log2 = x3_scale(x3_scale(scale_log2, -eq), -x3_exponent(w.absmax_k[bh]));
        x3_vmax = w.absmax_v + int64_t(bh) * DP;
    }

    // This thread's rows: row r is gid + 8 * (r % 2) of m-tile r / 2, i.e. fragment half r % 2 of
    // the m-tile's accumulators.
    auto row_of = [&](int r) { return r0 + wrow + 16 * (r >> 1) + gid + 8 * (r & 1); };
    int row_t[kRows];   // time step of each row
#pragma unroll
    for (int r = 0; r < kRows; ++r) row_t[r] = dv.group.div(row_of(r));
    const int warp_t_lo = dv.group.div(r0 + wrow);
    const int warp_t_hi = min(dv.group.div(r0 + wrow + 16 * MT - 1), T - 1);   // rows past T are padding

    float o[MT][kDTiles][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) o[t][d][0] = o[t][d][1] = o[t][d][2] = o[t][d][3] = 0.f;
    float m[kRows], l[kRows];   // running max of the scaled (log2) scores; running sum of exp2,
#pragma unroll                  // this thread's columns only
    for (int r = 0; r < kRows; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    // O of row r times f: online-softmax rescale and key-split merge.
    auto rescale_o = [&](int r, float f) {
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            o[r >> 1][d][2 * (r & 1)] *= f;
            o[r >> 1][d][2 * (r & 1) + 1] *= f;
        }
    };
    // Inf or NaN in K/V tile n (stage `stage`) sends the whole CTA down the exact scalar path below
    // for it, so that a non-finite value reaches exactly the rows that attend to it (wgmma: for
    // the non-finite values only, which the check replaces by zeros in shared memory). fp32: anywhere
    // in K or V (the TF32 split of an infinity is NaN). 16-bit: only in V of a tile that some row
    // masks (a masked key's 0 * inf in the mma); elsewhere the mma already gives the reference's
    // values, and masked scores are overwritten. Only this thread's copies: the caller reduces.
    auto own_tile_bad = [&](int n, int stage) -> bool {
        if constexpr (kWg && kHalf) {
            return n * TK + TK - 1 > t_lo && own_tile_sw_zero_nonfinite<Elem, DP, TK, NT>(sV + stage * TK * LD, bf16);
        } else if constexpr (kHalf) {
            return n * TK + TK - 1 > t_lo &&
                   own_copies_nonfinite<Elem, DP, NT>(sV + stage * TK * LD, kv_rows(n), p.vec16, bf16);
        } else {
            return own_copies_nonfinite<Elem, DP, NT>(sK + stage * TK * LD, kv_rows(n), p.vec16, bf16) ||
                   own_copies_nonfinite<Elem, DP, NT>(sV + stage * TK * LD, kv_rows(n), p.vec16, bf16);
        }
    };
    // The causal mask on S (slices that reach past the warp's first time step), then the online
    // softmax: l rescaled to the new row max, S replaced by P = exp2(S' - m). O is rescaled too,
    // except on the wgmma path, which may still have a P V in flight: there the factors are left
    // in f for the caller.
    auto mask_softmax = [&](float (&s)[MT][kNTiles][4], int key0, float (&f)[kRows]) {
        if (key0 + BN - 1 > warp_t_lo) {
#pragma unroll
            for (int t = 0; t < MT; ++t)
#pragma unroll
                for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + j * 8 + 2 * tig + (e & 1);
                        if (key > row_t[2 * t + (e >> 1)]) s[t][j][e] = -INFINITY;
                    }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            float(&st)[kNTiles][4] = s[r >> 1];
            const int h = 2 * (r & 1);   // the row's first accumulator in each n-tile
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) mx = fmaxf(mx, fmaxf(st[j][h], st[j][h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[r], mx * scale_log2);
            // -inf only while every key this warp has seen for the row is masked (key-split
            // warps past the row's time step) or when the scores are not finite.
            const float m_ref = m_new == -INFINITY ? 0.f : m_new;
            const float m_exp = kX3 ? m_ref - kX3PShift : m_ref;   // x3: P times 2^kX3PShift
            f[r] = fast_exp2(m[r] - m_ref);
            l[r] *= f[r];
            if constexpr (!kWg) rescale_o(r, f[r]);   // no P V in flight here
            m[r] = m_new;
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) {
                st[j][h] = fast_exp2(fmaf(st[j][h], scale_log2, -m_exp));
                st[j][h + 1] = fast_exp2(fmaf(st[j][h + 1], scale_log2, -m_exp));
                l[r] += st[j][h] + st[j][h + 1];
            }
        }
    };
    // O += P V in exact fp32 over the attended keys only, for a tile with Inf or NaN: a masked
    // key's 0 * inf or 0 * NaN never happens. p for (row, key) lives in the quad lane that holds
    // the key's column of S. The loop over the 8 keys of an n-tile stays rolled (code size) and
    // picks its S register by a select.
    auto scalar_pv = [&](const float (&s)[MT][kNTiles][4], const Elem* Vt, int key0) {
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int j = 0; j < kNTiles; ++j)
#pragma unroll 1
                for (int kk8 = 0; kk8 < 8; ++kk8) {
                    const int key = key0 + j * 8 + kk8;
                    const int vkey = j * 8 + kk8;
                    const float own0 = (kk8 & 1) ? s[t][j][1] : s[t][j][0];
                    const float own1 = (kk8 & 1) ? s[t][j][3] : s[t][j][2];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const float pk = __shfl_sync(0xffffffffu, i ? own1 : own0, (lane & ~3) | (kk8 >> 1));
                        if (key > row_t[2 * t + i]) continue;
#pragma unroll
                        for (int d = 0; d < kDTiles; ++d) {
                            if (d >= ksteps) break;
                            const int c = d * 8 + 2 * tig;
                            o[t][d][2 * i] = fmaf(pk, to_float(Vt[vkey * LD + c], bf16), o[t][d][2 * i]);
                            o[t][d][2 * i + 1] = fmaf(pk, to_float(Vt[vkey * LD + c + 1], bf16), o[t][d][2 * i + 1]);
                        }
                    }
                }
    };

    // wgmma: O += P V over the attended keys of tile key0.. for V's non-finite values only, read
    // from global memory (the shared copy holds zeros there, and the mma adds the rest).
    // Its key loops stay rolled except over the n-tiles: S must stay in registers.
    auto scalar_pv_nonfinite = [&](const float (&s)[MT][kNTiles][4], int key0) {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll 1
            for (int kk8 = 0; kk8 < 8; ++kk8) {
                const int key = key0 + j * 8 + kk8;
                const float own0 = (kk8 & 1) ? s[0][j][1] : s[0][j][0];
                const float own1 = (kk8 & 1) ? s[0][j][3] : s[0][j][2];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const float pk = __shfl_sync(0xffffffffu, i ? own1 : own0, (lane & ~3) | (kk8 >> 1));
                    // Padding rows past the last time step would reach keys past T: none exist.
                    if (key > row_t[i] || key >= T) continue;
                    const Elem* vr = v_base + int64_t(key) * p.v_stride_t;
#pragma unroll
                    for (int d = 0; d < kDTiles; ++d)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int c = d * 8 + 2 * tig + e;
                            const float x = c < p.D ? to_float(vr[c], bf16) : 0.f;
                            if (!isfinite(x)) o[0][d][2 * i + e] = fmaf(pk, x, o[0][d][2 * i + e]);
                        }
                }
            }
    };

    if constexpr (kX3) {
        // The wgmma pipeline below, with three products each: S of tile n + 1 and its softmax
        // while P V of tile n runs. P V lands in pv, from zero, and is added to O when it is done.
        float s[MT][kNTiles][4];
        float f[kRows];
        float pv[kDTiles][4];
        auto stage_of = [](int n) { return n % Tr::kStages; };
        const Half16* q_hi = reinterpret_cast<const Half16*>(sQ);
        const Half16* q_lo = q_hi + BM * LD;
        auto issue_qk = [&](int n) {
            const Half16* k_hi = reinterpret_cast<const Half16*>(sK + stage_of(n) * TK * LD);
            qk_wgmma<false, DP, BM, TK>(s[0], q_hi, 0, k_hi + TK * LD);   // hi * lo, from zero
            qk_wgmma<false, DP, BM, TK>(s[0], q_lo, 0, k_hi, true);       // lo * hi
            qk_wgmma<false, DP, BM, TK>(s[0], q_hi, 0, k_hi, true);       // hi * hi
        };
        auto issue_pv = [&](const uint32_t (&p_hi)[4][4], const uint32_t (&p_lo)[4][4], int n) {
            const Half16* v_hi = reinterpret_cast<const Half16*>(sV + stage_of(n) * TK * LD);
            pv_wgmma<false, DP, TK>(pv, p_hi, v_hi + TK * LD, false);   // hi * lo, from zero
            pv_wgmma<false, DP, TK>(pv, p_lo, v_hi);                    // lo * hi
            pv_wgmma<false, DP, TK>(pv, p_hi, v_hi);                    // hi * hi
        };
        if (n_kv > 1) load_kv(1, 1);
        cp_async_commit();
        cp_async_wait<1>();
        fence_async_proxy();   // this thread's Q stores and copies, before wgmma reads them
        __syncthreads();
        issue_qk(0);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[MT * kNTiles * 4]>(s));
        mask_softmax(s, 0, f);
        for (int n = 0; n + 1 < n_kv; ++n) {
            cp_async_wait<0>();
            fence_async_proxy();
            __syncthreads();   // tile n + 1 landed; every warp is past P V of tile n - 1
            if (n + 2 < n_kv) load_kv(n + 2, stage_of(n + 2));
            cp_async_commit();
            uint32_t p_hi[4][4], p_lo[4][4];   // P of tile n; read by the wgmma until it completes
            x3_split_p(p_hi, p_lo, s[0]);
            issue_qk(n + 1);
            wg_commit();
            issue_pv(p_hi, p_lo, n);
            wg_commit();
            wg_wait<1>();
            fence_regs(reinterpret_cast<float(&)[MT * kNTiles * 4]>(s));
            mask_softmax(s, (n + 1) * TK, f);
            wg_wait<0>();
            fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(pv));
#pragma unroll
            for (int d = 0; d < kDTiles; ++d)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[0][d][e] = (o[0][d][e] + pv[d][e]) * f[e >> 1];
        }
        uint32_t p_hi[4][4], p_lo[4][4];
        x3_split_p(p_hi, p_lo, s[0]);
        issue_pv(p_hi, p_lo, n_kv - 1);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(pv));
#pragma unroll
        for (int d = 0; d < kDTiles; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][d][e] += pv[d][e];
    } else if constexpr (kWg) {
        float s[MT][kNTiles][4];   // S, then P, of the tile in hand
        float f[kRows];            // O's rescale factors from the last softmax
        // Software pipeline over the warpgroup's async products: while P V of tile n runs, S of
        // tile n + 1 is computed and its softmax done, and the copies of tile n + 2 are landing.
        // One warpgroup owns the CTA's rows, so it visits every tile up to n_kv. Both products
        // are issued on every path (a wgmma or a wait under a data-dependent branch makes the
        // compiler serialise every wgmma of the kernel): a tile with Inf or NaN in V has them
        // replaced by zeros in shared memory when it lands, and they reach O through the exact
        // scalar step below instead.
        auto stage_of = [](int n) { return n % Tr::kStages; };
        auto issue_qk = [&](int n) { qk_wgmma<bf16, DP, BM, TK>(s[0], sQ, 0, sK + stage_of(n) * TK * LD); };
        if (n_kv > 1) load_kv(1, 1);
        cp_async_commit();
        cp_async_wait<1>();
        const bool bad0 = own_tile_bad(0, 0);
        fence_async_proxy();   // this thread's copies and zeroings, before wgmma reads them
        bool nonfinite = __syncthreads_or(bad0);
        issue_qk(0);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[MT * kNTiles * 4]>(s));
        mask_softmax(s, 0, f);   // O is still zero: f needs no applying
        // The last tile is peeled off: inside the loop every step runs unconditionally.
        for (int n = 0; n + 1 < n_kv; ++n) {
            cp_async_wait<0>();
            const bool next_bad = own_tile_bad(n + 1, stage_of(n + 1));
            fence_async_proxy();
            // Tile n + 1 is in shared memory, and every warp is past P V of tile n - 1, so its
            // stage takes the copies of tile n + 2 (issued once both products are under way).
            const bool next_nonfinite = __syncthreads_or(next_bad);
            if (nonfinite) scalar_pv_nonfinite(s, n * TK);
            uint32_t pa[4][4];   // P of tile n; read by the wgmma until it completes
            pack_p<bf16>(pa, s[0]);
            issue_qk(n + 1);
            wg_commit();
            pv_wgmma<bf16, DP, TK>(o[0], pa, sV + stage_of(n) * TK * LD);
            wg_commit();
            if (n + 2 < n_kv) load_kv(n + 2, stage_of(n + 2));
            cp_async_commit();
            wg_wait<1>();
            fence_regs(reinterpret_cast<float(&)[MT * kNTiles * 4]>(s));
            mask_softmax(s, (n + 1) * TK, f);
            wg_wait<0>();
            fence_regs(reinterpret_cast<float(&)[MT * kDTiles * 4]>(o));
#pragma unroll
            for (int r = 0; r < kRows; ++r) rescale_o(r, f[r]);
            nonfinite = next_nonfinite;
        }
        if (nonfinite) scalar_pv_nonfinite(s, (n_kv - 1) * TK);
        uint32_t pa[4][4];
        pack_p<bf16>(pa, s[0]);
        pv_wgmma<bf16, DP, TK>(o[0], pa, sV + stage_of(n_kv - 1) * TK * LD);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[MT * kDTiles * 4]>(o));
    } else {
        for (int n = 0; n < n_kv; ++n) {
            if (n + 1 < n_kv) {
                load_kv(n + 1, (n + 1) & 1);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            const bool nonfinite = __syncthreads_or(own_tile_bad(n, n & 1));
            const int key0 = n * TK + wkey;   // first key of this warp's slice of the tile
            // A slice whose every key is in the future of every row of the warp is skipped; the
            // warp still meets the one barrier below, which every thread of the CTA reaches.
            if (key0 <= warp_t_hi) {
                const Elem* Kt = sK + (n & 1) * TK * LD + wkey * LD;
                const Elem* Vt = sV + (n & 1) * TK * LD + wkey * LD;

                // S = Q K^T for the warp's rows and BN keys.
                float s[MT][kNTiles][4];
                float f[kRows];
#pragma unroll
                for (int t = 0; t < MT; ++t)
#pragma unroll
                    for (int j = 0; j < kNTiles; ++j) s[t][j][0] = s[t][j][1] = s[t][j][2] = s[t][j][3] = 0.f;
                if constexpr (kHalf) qk_16bit<bf16, BN, DP, LD, MT>(s, sQ + wrow * LD, Kt, (p.D + 15) / 16, lane);
                else qk_tf32<BN, DP, LD>(s[0], sQ + wrow * LD, Kt, p.D, terms, nonfinite, lane);
                mask_softmax(s, key0, f);
                if (nonfinite) scalar_pv(s, Vt, key0);
                else if constexpr (kHalf) pv_16bit<bf16, BN, DP, LD, MT>(o, s, Vt, ksteps, lane);
                else pv_tf32<BN, DP, LD>(o[0], s[0], Vt, ksteps, terms, lane);
            }
            __syncthreads();   // the stage is refilled by the next iteration's prefetch
        }
    }

    // Epilogue: finish l across the quad that shares a row.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if constexpr (KW > 1) {
        // Merge the key-split warps' states: O = sum_w 2^(m_w - M) O_w, l likewise, M = max_w m_w.
        // Lanes of the warps that share rows hold the same (row, column) fragments, so each lane
        // parks its registers at [warp][slot][lane] and the row's first warp reads them back.
        // (One m-tile per warp here: the key split is fp32 only.)
        static_assert(MT == 1, "the key split merges one m-tile per warp");
        constexpr int kSlots = kDTiles * 4 + 4;
        float* scratch = reinterpret_cast<float*>(sK);   // the K/V buffers are free: the loop ended on a barrier
#pragma unroll
        for (int d = 0; d < kDTiles; ++d)
#pragma unroll
            for (int e = 0; e < 4; ++e) scratch[(warp * kSlots + d * 4 + e) * 32 + lane] = o[0][d][e];
        scratch[(warp * kSlots + kDTiles * 4 + 0) * 32 + lane] = m[0];
        scratch[(warp * kSlots + kDTiles * 4 + 1) * 32 + lane] = m[1];
        scratch[(warp * kSlots + kDTiles * 4 + 2) * 32 + lane] = l[0];
        scratch[(warp * kSlots + kDTiles * 4 + 3) * 32 + lane] = l[1];
        __syncthreads();
        if (warp >= Tr::kRowWarps) return;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float m_all = m[i];
#pragma unroll
            for (int w = 1; w < KW; ++w)
                m_all = fmaxf(m_all, scratch[((warp + w * Tr::kRowWarps) * kSlots + kDTiles * 4 + i) * 32 + lane]);
            const float m_ref = m_all == -INFINITY ? 0.f : m_all;
            const float fi = fast_exp2(m[i] - m_ref);
            l[i] *= fi;
            rescale_o(i, fi);
#pragma unroll
            for (int w = 1; w < KW; ++w) {
                const int src = (warp + w * Tr::kRowWarps) * kSlots;
                const float c = fast_exp2(scratch[(src + kDTiles * 4 + i) * 32 + lane] - m_ref);
                l[i] += c * scratch[(src + kDTiles * 4 + 2 + i) * 32 + lane];
#pragma unroll
                for (int d = 0; d < kDTiles; ++d) {
                    o[0][d][2 * i] += c * scratch[(src + d * 4 + 2 * i) * 32 + lane];
                    o[0][d][2 * i + 1] += c * scratch[(src + d * 4 + 2 * i + 1) * 32 + lane];
                }
            }
        }
    }

    // Normalise and store. Each thread holds column pairs (c, c + 1), c even: with D even (the
    // output is contiguous, so every row start is then even too) a pair is one aligned store.
    Elem* o_base = static_cast<Elem*>(p.o) + b * p.o_stride_b + int64_t(kvh) * G * p.o_stride_h;
    const bool pairs = (p.D & 1) == 0;
    // x3: the exponents of this thread's V channels, read before any store (a store between two
    // reads would make each read wait for the one before it).
    int ev[kX3 ? kDTiles : 1][2];
    if constexpr (kX3) {
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            ev[d][0] = x3_exponent(x3_vmax[d * 8 + 2 * tig]);
            ev[d][1] = x3_exponent(x3_vmax[d * 8 + 2 * tig + 1]);
        }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const float inv = 1.f / l[r];
        const int R = row_of(r);
        if (R >= rows_total) continue;
        Elem* dst = o_base + int64_t(row_t[r]) * p.o_stride_t + int64_t(R - row_t[r] * G) * p.o_stride_h;
        const float(&ot)[kDTiles][4] = o[r >> 1];
        const int h = 2 * (r & 1);
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) {
            const int c = d * 8 + 2 * tig;
            float y0 = ot[d][h] * inv, y1 = ot[d][h + 1] * inv;
            if constexpr (kX3) {
                y0 = x3_scale(y0, -ev[d][0]);
                y1 = x3_scale(y1, -ev[d][1]);
            }
            if (pairs && c < p.D) {
                store_pair(dst + c, y0, y1, bf16);
            } else {
                if (c < p.D) dst[c] = from_float<Elem>(y0, bf16);
                if (c + 1 < p.D) dst[c + 1] = from_float<Elem>(y1, bf16);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Row-wise kernel for short sequences (and tiny head dims): plain fp32 FMA, no tensor cores.
// There the tiled kernel is bound by latency, not arithmetic: its splits, barriers and merges
// cost more than the few products a short row needs, so what counts is the number of dependent
// instructions on the longest warp. One warp owns RW consecutive packed (time step, head) rows,
// which share every key: at G = RW they are the G heads of one time step, so each key row read
// from shared memory feeds RW dot products. The CTA loads the keys its rows need into shared
// memory in one phase (in chunks of kc keys when they do not fit), every load in flight at once.
// Each warp then works a chunk in passes of up to 128 keys:
//   1. scores, lane j taking keys j, j + 32, j + 64, j + 96 of the pass for all RW rows, kept in
//      registers; one max per row, then exponentials, stored as RW-wide vectors per key;
//   2. P V with each lane owning a float4 of head-dim columns and every ks-th key (ks = 4 at
//      head_dim 32), RW rows at a time; keys that only some rows attend take a guarded tail
//      loop, so a row never multiplies a value row it does not attend (Inf and NaN follow the
//      reference); the lanes that share columns are summed at the end.
// Index arithmetic divides by divisors prepared on the host (FastDiv).
// Two shapes of CTA (warps NW x rows per warp RW), picked by the size of the grid: see
// launch_rowwise_best.
constexpr int kRowKeysPerPass = 128;          // keys scored per pass: four per lane
constexpr int kRowSmemBudget = 96 * 1024;     // bytes of shared memory per CTA, at most

struct RowwiseDivs {
    FastDiv bh;      // B * Hkv: CTA index -> (row tile, batch and kv head)
    FastDiv hkv;     // Hkv
    FastDiv group;   // G: packed row -> time step
    FastDiv width;   // copy items per row (D / 4 for 16-byte fp32 copies, else D4)
    int planned;     // 1: fp32, 16-byte rows, one chunk, at most rowwise_planned_copies(RW) copies per thread
};
// Copies per thread that the planned path addresses before the wait for the previous grid: the
// one-row-per-warp layout (small, latency-bound grids) only; 0 turns the path off.
__host__ __device__ constexpr int rowwise_planned_copies(int rw) { return rw == 1 ? 16 : 0; }

// Shared-memory layout, in floats. D4 is D rounded up to 4 (rows are read as float4; columns
// D..D4-1 hold zeros). The q/K pitch is 4 (mod 8), so each 8-lane phase of a float4 read of 8
// different keys covers all 32 banks once.
__host__ __device__ constexpr int rowwise_d4(int D) { return (D + 3) & ~3; }
__host__ __device__ constexpr int rowwise_k_pitch(int D) { return ((D + 7) & ~7) + 4; }
// Fixed part: the CTA's q rows and each warp's probabilities for one pass; then per key: K and V.
__host__ __device__ constexpr int rowwise_fixed_floats(int D, int nw, int rw) {
    return nw * rw * rowwise_k_pitch(D) + nw * kRowKeysPerPass * rw;
}
__host__ __device__ constexpr int rowwise_key_floats(int D) { return rowwise_k_pitch(D) + rowwise_d4(D); }

// Programmatic dependent launch (sm_90+): a kernel launched with it may start while the previous
// kernel on the stream finishes; it must not touch global memory before grid_dependency_wait().
// Elsewhere, or when launched without it, both are no-ops.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Walks the (row, column) items of a rows x width grid, NT items apart, from this thread's first.
template <int NT>
struct GridCursor {
    int r, c, dr, dc, width;
    __device__ __forceinline__ explicit GridCursor(const FastDiv& w) : width(w.d) {
        r = w.div(int(threadIdx.x));
        c = int(threadIdx.x) - r * width;
        dr = w.div(NT);
        dc = NT - dr * width;
    }
    __device__ __forceinline__ void next() {
        r += dr;
        c += dc;
        if (c >= width) {
            c -= width;
            ++r;
        }
    }
};

// Copies `rows` rows (pointer per row; null = past the end, zero-filled) of D elements into fp32
// shared memory with pitch ld, zero-filling columns D..D4-1. Every copy is issued before any is
// waited on: fp32 through cp.async (16 bytes when rows are 16-byte aligned), 16-bit types through
// registers, four loads per thread in flight. `width` divides by the items per row: D / 4 for
// 16-byte fp32 copies, else D4.
template <typename Elem, int NT, typename RowPtr>
__device__ __forceinline__ void rowwise_load(float* dst, int ld, RowPtr row_ptr, int rows, int D, bool vec16,
                                             bool bf16, const Elem* any_valid, const FastDiv& width) {
    const int D4 = rowwise_d4(D);
    if constexpr (std::is_same<Elem, float>::value) {
        if (vec16) {   // D is a multiple of 4 here
            for (GridCursor<NT> g(width); g.r < rows; g.next()) {
                const float* src = row_ptr(g.r);
                cp_async16(dst + g.r * ld + 4 * g.c, src != nullptr ? src + 4 * g.c : any_valid, src != nullptr ? 16 : 0);
            }
        } else {
            for (GridCursor<NT> g(width); g.r < rows; g.next()) {
                const float* src = row_ptr(g.r);
                const bool ok = src != nullptr && g.c < D;
                cp_async4(dst + g.r * ld + g.c, ok ? src + g.c : any_valid, ok ? 4 : 0);
            }
        }
    } else {
        for (GridCursor<NT> g(width); g.r < rows;) {
            Elem x[4];
            int off[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const Elem* src = g.r < rows ? row_ptr(g.r) : nullptr;
                x[u] = (src != nullptr && g.c < D) ? src[g.c] : Elem(0);
                off[u] = g.r < rows ? g.r * ld + g.c : -1;
                g.next();
            }
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (off[u] >= 0) dst[off[u]] = to_float(x[u], bf16);
        }
    }
}

// RW dot products of q rows with each of N key rows (float4 pitch): s[n][r] = q_r . k_n. The
// columns go in blocks of kCB float4s whose shared-memory reads are all issued before the block's
// multiply-adds: a warp's chain here is latency-bound, and each block then costs one round trip.
template <int N, int RW>
__device__ __forceinline__ void rowwise_dots(const float4* const (&q4)[RW], const float4* const (&k4)[N], int n4,
                                             float (&s)[N][RW]) {
    constexpr int kCB = N * RW <= 4 ? 4 : 2;
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int r = 0; r < RW; ++r) s[n][r] = 0.f;
    for (int c0 = 0; c0 < n4; c0 += kCB) {
        float4 x[kCB][RW], y[kCB][N];
#pragma unroll
        for (int i = 0; i < kCB; ++i) {
            const int c = min(c0 + i, n4 - 1);   // past the row: read again, not used
#pragma unroll
            for (int r = 0; r < RW; ++r) x[i][r] = q4[r][c];
#pragma unroll
            for (int n = 0; n < N; ++n) y[i][n] = k4[n][c];
        }
#pragma unroll
        for (int i = 0; i < kCB; ++i) {
            if (c0 + i >= n4) break;
#pragma unroll
            for (int n = 0; n < N; ++n)
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    s[n][r] = fmaf(x[i][r].x, y[i][n].x, s[n][r]);
                    s[n][r] = fmaf(x[i][r].y, y[i][n].y, s[n][r]);
                    s[n][r] = fmaf(x[i][r].z, y[i][n].z, s[n][r]);
                    s[n][r] = fmaf(x[i][r].w, y[i][n].w, s[n][r]);
                }
        }
    }
}

__device__ __forceinline__ void fma4(float4& acc, float s, const float4& v) {
    acc.x = fmaf(s, v.x, acc.x);
    acc.y = fmaf(s, v.y, acc.y);
    acc.z = fmaf(s, v.z, acc.z);
    acc.w = fmaf(s, v.w, acc.w);
}

__device__ __forceinline__ void scale4(float4& acc, float s) {
    acc.x *= s;
    acc.y *= s;
    acc.z *= s;
    acc.w *= s;
}

// RW consecutive floats of shared memory, one vector load (the buffer is 4 * RW-byte aligned).
template <int RW>
__device__ __forceinline__ void load_rw(const float* src, float (&x)[RW]) {
    if constexpr (RW == 4) {
        const float4 v = *reinterpret_cast<const float4*>(src);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
    } else if constexpr (RW == 2) {
        const float2 v = *reinterpret_cast<const float2*>(src);
        x[0] = v.x, x[1] = v.y;
    } else {
#pragma unroll
        for (int r = 0; r < RW; ++r) x[r] = src[r];
    }
}
template <int RW>
__device__ __forceinline__ void store_rw(float* dst, const float (&x)[RW]) {
    if constexpr (RW == 4) {
        *reinterpret_cast<float4*>(dst) = make_float4(x[0], x[1], x[2], x[3]);
    } else if constexpr (RW == 2) {
        *reinterpret_cast<float2*>(dst) = make_float2(x[0], x[1]);
    } else {
#pragma unroll
        for (int r = 0; r < RW; ++r) dst[r] = x[r];
    }
}

// Four output columns c..c+3 of one row, scaled by inv; `vec` when D is a multiple of 4 (the
// output is contiguous, so every row starts 4-element aligned).
template <typename Elem>
__device__ __forceinline__ void rowwise_store4(Elem* dst, int c, int D, const float4& x, float inv, bool vec, bool bf16) {
    const float y0 = x.x * inv, y1 = x.y * inv, y2 = x.z * inv, y3 = x.w * inv;
    if constexpr (std::is_same<Elem, float>::value) {
        if (vec) {
            *reinterpret_cast<float4*>(dst + c) = make_float4(y0, y1, y2, y3);
            return;
        }
    } else {
        if (vec) {
            store_pair(dst + c, y0, y1, bf16);
            store_pair(dst + c + 2, y2, y3, bf16);
            return;
        }
    }
    if (c < D) dst[c] = from_float<Elem>(y0, bf16);
    if (c + 1 < D) dst[c + 1] = from_float<Elem>(y1, bf16);
    if (c + 2 < D) dst[c + 2] = from_float<Elem>(y2, bf16);
    if (c + 3 < D) dst[c + 3] = from_float<Elem>(y3, bf16);
}

template <typename Elem, int NW, int RW>
__global__ void __launch_bounds__(32 * NW)
gqa_rowwise_kernel(const GqaParams p, int kc, const RowwiseDivs dv) {
    constexpr int NT = 32 * NW, kRows = NW * RW;
    extern __shared__ float4 smem_raw[];
    const int D = p.D, G = p.group, T = p.T;
    const int D4 = rowwise_d4(D), kld = rowwise_k_pitch(D);
    float* sQ = reinterpret_cast<float*>(smem_raw);   // [kRows][kld]
    float* sK = sQ + kRows * kld;                     // [kc][kld]
    float* sV = sK + kc * kld;                        // [kc][D4]
    float* sP = sV + kc * D4;                         // [NW][kKeysPerPass][RW]: each warp's probabilities

    const bool bf16 = p.dtype == kGqaBFloat16;
    const int rows_total = T * G;
    const int n_qtiles = (rows_total + kRows - 1) / kRows;
    const int tile = dv.bh.div(int(blockIdx.x));
    const int bh = int(blockIdx.x) - tile * dv.bh.d;
    const int qtile = n_qtiles - 1 - tile;   // longest rows first
    const int b = dv.hkv.div(bh), kvh = bh - b * p.Hkv;
    const int r0 = qtile * kRows;
    const int t_hi = min(dv.group.div(r0 + kRows - 1), T - 1);

    const Elem* q_base = static_cast<const Elem*>(p.q) + b * p.q_stride_b + int64_t(kvh) * G * p.q_stride_h;
    const Elem* k_base = static_cast<const Elem*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
    const Elem* v_base = static_cast<const Elem*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;
    auto q_row = [&](int r) -> const Elem* {
        const int R = r0 + r;
        if (R >= rows_total) return nullptr;
        const int t = dv.group.div(R);
        return q_base + int64_t(t) * p.q_stride_t + int64_t(R - t * G) * p.q_stride_h;
    };
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int Rw = r0 + warp * RW;   // the warp's first packed row
    int tr[RW];                      // each row's time step; -1: a padding row, attends to nothing
    const float4* q4[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        tr[r] = Rw + r < rows_total ? dv.group.div(Rw + r) : -1;
        q4[r] = reinterpret_cast<const float4*>(sQ + (warp * RW + r) * kld);
    }
    // Rows are in time order and padding rows come last: the first row attends the fewest keys.
    int t_top = tr[0];
#pragma unroll
    for (int r = 1; r < RW; ++r) t_top = max(t_top, tr[r]);
    float* pw = sP + warp * (kRowKeysPerPass * RW);

    // P V layout: lane = kq * cgp + cg. The lane owns columns 4cg..4cg+3 (and 128 further on when
    // D4 > 128) and keys j = kq (mod ks); cgp is the column-group count rounded up to a power of two.
    const int n4 = D4 / 4;
    const int lg = n4 >= 32 ? 5 : 32 - __clz(n4 - 1);   // log2(cgp)
    const int cgp = 1 << lg;
    const int ks = 32 >> lg;
    int kq = lane >> lg, cg = lane & (cgp - 1);
    const bool has0 = cg < n4, has1 = cg + 32 < n4;
    // The warp's rows and lane layout, like the copy plan below, are computed before the wait
    // (asm barriers keep the compiler from moving them after it).
#pragma unroll
    for (int r = 0; r < RW; ++r) asm volatile("" : "+r"(tr[r]));
    asm volatile("" : "+r"(t_top), "+r"(kq), "+r"(cg));
    // Planned path: every 16-byte copy of this thread (q rows, then K rows, then V rows of the
    // one chunk) is addressed before the wait for the previous grid, so after it only the copy
    // instructions remain (measured: the address arithmetic of the copy loops was most of the
    // load phase).
    const bool planned = std::is_same<Elem, float>::value && dv.planned;   // uniform; host-checked
    constexpr int kPlan = rowwise_planned_copies(RW) > 0 ? rowwise_planned_copies(RW) : 1;
    const float* plan_src[kPlan];
    uint32_t plan_dst[kPlan];
    int plan_bytes[kPlan];
    if (planned) {
        const int w = dv.width.d, nk0 = t_hi + 1, n_q = kRows * w, n_k = nk0 * w;
        const uint32_t s_q = static_cast<uint32_t>(__cvta_generic_to_shared(sQ));
#pragma unroll
        for (int u = 0; u < kPlan; ++u) {
            int i = int(threadIdx.x) + u * NT;
            const Elem* s = nullptr;
            int off = -1;
            if (i < n_q) {
                const int r = dv.width.div(i), c = i - r * w;
                s = q_row(r);
                s = s != nullptr ? s + 4 * c : nullptr;
                off = r * kld + 4 * c;
            } else if ((i -= n_q) < n_k) {
                const int r = dv.width.div(i), c = i - r * w;
                s = k_base + int64_t(r) * p.k_stride_t + 4 * c, off = int(sK - sQ) + r * kld + 4 * c;
            } else if ((i -= n_k) < n_k) {
                const int r = dv.width.div(i), c = i - r * w;
                s = v_base + int64_t(r) * p.v_stride_t + 4 * c, off = int(sV - sQ) + r * D4 + 4 * c;
            }
            plan_bytes[u] = off < 0 ? -1 : s != nullptr ? 16 : 0;   // -1: no copy; 0: zero-fill
            plan_src[u] = reinterpret_cast<const float*>(s != nullptr ? s : q_base);
            plan_dst[u] = s_q + 4u * uint32_t(max(off, 0));
            asm volatile("" : "+l"(plan_src[u]), "+r"(plan_dst[u]), "+r"(plan_bytes[u]));   // here, before the wait
        }
    }
    grid_dependency_wait();   // q, k and v may come from the kernel before this one
    allow_dependent_launch();
    if (planned) {
#pragma unroll
        for (int u = 0; u < kPlan; ++u) {
            if (plan_bytes[u] >= 0) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(plan_dst[u]), "l"(plan_src[u]), "r"(plan_bytes[u]));
            }
        }
    } else {
        rowwise_load<Elem, NT>(sQ, kld, q_row, kRows, D, p.vec16, bf16, q_base, dv.width);   // waited on with chunk 0
    }

    float4 acc0[RW], acc1[RW];
    float m[RW], l[RW];   // running max (log2 units, warp-uniform); this lane's share of the sum
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        acc0[r] = acc1[r] = make_float4(0.f, 0.f, 0.f, 0.f);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }

    for (int c0 = 0; c0 <= t_hi; c0 += kc) {
        const int nk = min(kc, t_hi + 1 - c0);
        if (c0 > 0) __syncthreads();   // every warp is done with the previous chunk
        auto k_row = [&](int r) -> const Elem* { return k_base + int64_t(c0 + r) * p.k_stride_t; };
        auto v_row = [&](int r) -> const Elem* { return v_base + int64_t(c0 + r) * p.v_stride_t; };
        if (!planned) {   // the planned path's one chunk is already in flight
            rowwise_load<Elem, NT>(sK, kld, k_row, nk, D, p.vec16, bf16, k_base, dv.width);
            rowwise_load<Elem, NT>(sV, D4, v_row, nk, D, p.vec16, bf16, v_base, dv.width);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        const int n_hi = min(nk, t_top + 1 - c0);     // keys of this chunk some row attends
        const int n_lo = max(min(nk, tr[0] + 1 - c0), 0);   // ... and every row attends
        for (int kb = 0; kb < n_hi; kb += kRowKeysPerPass) {
            const int nb = min(n_hi - kb, kRowKeysPerPass), nb_lo = min(max(n_lo - kb, 0), nb);
            // 1. Scores of this pass's keys for every row, one max per row, probabilities.
            auto softmax_pass = [&](auto n_const) {
                constexpr int N = decltype(n_const)::value;
                const float4* k4[N];
#pragma unroll
                for (int n = 0; n < N; ++n) k4[n] = reinterpret_cast<const float4*>(sK + (kb + min(lane + 32 * n, nb - 1)) * kld);
                float s[N][RW], mx[RW];
                rowwise_dots<N, RW>(q4, k4, n4, s);
#pragma unroll
                for (int r = 0; r < RW; ++r) {
                    mx[r] = -INFINITY;
#pragma unroll
                    for (int n = 0; n < N; ++n) {
                        const int j = c0 + kb + lane + 32 * n;   // absolute key index
                        s[n][r] = j <= tr[r] ? s[n][r] * p.scale_log2 : -INFINITY;
                        mx[r] = fmaxf(mx[r], s[n][r]);
                    }
                }
#pragma unroll
                for (int r = 0; r < RW; ++r) {
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], o));
                    const float m_new = fmaxf(m[r], mx[r]);
                    const float m_ref = m_new == -INFINITY ? 0.f : m_new;   // nothing attended yet
                    const float alpha = fast_exp2(m[r] - m_ref);
                    m[r] = m_new;
                    l[r] *= alpha;
                    scale4(acc0[r], alpha);
                    if (n4 > 32) scale4(acc1[r], alpha);   // a second column group only past head_dim 128
#pragma unroll
                    for (int n = 0; n < N; ++n) {
                        s[n][r] = fast_exp2(s[n][r] - m_ref);
                        l[r] += s[n][r];
                    }
                }
#pragma unroll
                for (int n = 0; n < N; ++n)
                    if (lane + 32 * n < nb) store_rw<RW>(pw + (lane + 32 * n) * RW, s[n]);
            };
            if (nb > 96) softmax_pass(std::integral_constant<int, 4>());
            else if (nb > 64) softmax_pass(std::integral_constant<int, 3>());
            else if (nb > 32) softmax_pass(std::integral_constant<int, 2>());
            else softmax_pass(std::integral_constant<int, 1>());
            __syncwarp();
            // 2. P V: this lane's keys into this lane's columns, every row at once for the keys
            // every row attends, then row by row for the rest.
            const float* vc = sV + kb * D4 + 4 * cg;
            auto attends = [&](int j, int r) { return c0 + kb + j <= tr[r]; };
            if (n4 <= 32) {
                if (has0) {
                    // Keys in blocks of kKB, all of a block's reads first (one round trip each).
                    constexpr int kKB = RW <= 2 ? 8 : 4;
                    int j = kq;
                    for (; j + (kKB - 1) * ks < nb_lo; j += kKB * ks) {
                        float pr[kKB][RW];
                        float4 v[kKB];
#pragma unroll
                        for (int u = 0; u < kKB; ++u) {
                            load_rw<RW>(pw + (j + u * ks) * RW, pr[u]);
                            v[u] = *reinterpret_cast<const float4*>(vc + (j + u * ks) * D4);
                        }
#pragma unroll
                        for (int u = 0; u < kKB; ++u)
#pragma unroll
                            for (int r = 0; r < RW; ++r) fma4(acc0[r], pr[u][r], v[u]);
                    }
                    for (; j < nb_lo; j += ks) {
                        float pr[RW];
                        load_rw<RW>(pw + j * RW, pr);
                        const float4 v = *reinterpret_cast<const float4*>(vc + j * D4);
#pragma unroll
                        for (int r = 0; r < RW; ++r) fma4(acc0[r], pr[r], v);
                    }
                    for (; j < nb; j += ks) {
                        float pr[RW];
                        load_rw<RW>(pw + j * RW, pr);
                        const float4 v = *reinterpret_cast<const float4*>(vc + j * D4);
#pragma unroll
                        for (int r = 0; r < RW; ++r)
                            if (attends(j, r)) fma4(acc0[r], pr[r], v);
                    }
                }
            } else {   // D4 > 128: every lane has a first column group, some a second; ks = 1
                for (int j = 0; j < nb; ++j) {
                    float pr[RW];
                    load_rw<RW>(pw + j * RW, pr);
                    const float4 v0 = *reinterpret_cast<const float4*>(vc + j * D4);
                    const float4 v1 = has1 ? *reinterpret_cast<const float4*>(vc + j * D4 + 128) : v0;
                    const bool all = j < nb_lo;
#pragma unroll
                    for (int r = 0; r < RW; ++r) {
                        if (all || attends(j, r)) {
                            fma4(acc0[r], pr[r], v0);
                            fma4(acc1[r], pr[r], v1);
                        }
                    }
                }
            }
            __syncwarp();   // pw is rewritten by the next pass
        }
    }

    // Lanes that share columns hold sums over disjoint keys.
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        for (int o = cgp; o < 32; o <<= 1) {
            acc0[r].x += __shfl_xor_sync(0xffffffffu, acc0[r].x, o);
            acc0[r].y += __shfl_xor_sync(0xffffffffu, acc0[r].y, o);
            acc0[r].z += __shfl_xor_sync(0xffffffffu, acc0[r].z, o);
            acc0[r].w += __shfl_xor_sync(0xffffffffu, acc0[r].w, o);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
    }
    if (!has0) return;
    const bool vec = (D & 3) == 0;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        // Row r is stored by the lanes whose key slice is r (mod ks): RW / ks rows per lane at most.
        if (tr[r] < 0 || (r & (ks - 1)) != kq) continue;
        const int t = tr[r], R = Rw + r;
        const float inv = 1.f / l[r];
        Elem* dst = static_cast<Elem*>(p.o) + b * p.o_stride_b + int64_t(t) * p.o_stride_t +
                    int64_t(kvh * G + (R - t * G)) * p.o_stride_h;
        rowwise_store4(dst, 4 * cg, D, acc0[r], inv, vec, bf16);
        if (has1) rowwise_store4(dst, 4 * cg + 128, D, acc1[r], inv, vec, bf16);
    }
}

// ---------------------------------------------------------------------------------------------
// Short fp32 sequences on tensor cores: T <= kShortMaxT, head_dim <= 32 in 16-byte rows, grids
// too small to fill the GPU with the row-wise kernel's warps. A CTA owns 16 packed rows; warp w
// takes keys 16w..16w+15 of them, computes S and P V as 3xTF32 mma.sync (short_qk, short_pv) and
// parks its partial softmax state for a merge at the end. Each warp copies its own q rows (through
// L1: the CTA's warps ask for the same lines) and K/V slice, every copy addressed before the wait
// for the previous grid; q lands in a copy group of its own and is split while K and V land. No
// CTA barrier until the merge. The products run every k-step and column tile of DP (columns past
// D are zero-filled and add zeros) with three TF32 terms, all fixed at compile time: loops that
// depend on D or on allow_tf32 break the mma chains into branches (NOTES v23), so allow_tf32 does
// not change this kernel. A warp whose S or P V comes out NaN (Inf or NaN among its inputs: the
// TF32 split of an infinity is NaN) redoes that product in plain fp32 over the keys each row
// attends, so a non-finite value reaches exactly the rows the reference gives it.
constexpr int kShortWarps = 8;
constexpr int kShortKeys = 16;                            // keys per warp
constexpr int kShortRows = 16;                            // packed rows per CTA: one mma m-tile
constexpr int kShortMaxT = kShortWarps * kShortKeys;      // every key a row attends has a warp
static_assert(kShortKeys == kShortRows, "the q, K and V slices of a warp have the same shape");
template <int DP> constexpr int short_smem_bytes() { return int(sizeof(float)) * kShortWarps * 3 * kShortRows * (DP + 4); }

// split_tf32 in integer arithmetic, for the short kernel, which is bound by its splits (cvt.rna
// compiles to about five instructions): big adds half a TF32 unit to the magnitude bits and clears
// the 13 low bits (round half away from zero); small = x - big is exact and goes to the tensor
// core as it is, which reads its top 19 bits (about 2^-21 |x| dropped instead of 2^-23; measured
// error unchanged, NOTES v22). An x that rounds past the largest finite value gives big = inf and
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

// S (16 rows x kShortKeys keys) = Q K^T for one warp, three TF32 products per product. A short
// warp is one dependent chain, so every K fragment read is issued first and each (k-step parity,
// term) pair gets its own accumulator: twelve independent mma chains instead of two.
template <int DP, int LD>
__device__ __forceinline__ void short_qk(float (&s)[kShortKeys / 8][4], const uint32_t (&a_big)[DP / 8][4],
                                         const uint32_t (&a_small)[DP / 8][4], const float* sK, int lane) {
    constexpr int KS = DP / 8, NT = kShortKeys / 8;
    const int gid = lane >> 2, tig = lane & 3;
    float b[KS][NT][2];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const float* kb = sK + (j * 8 + gid) * LD + kk * 8 + tig;
            b[kk][j][0] = kb[0];
            b[kk][j][1] = kb[4];
        }
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
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int d = 0; d < KD; ++d) {
            const float* vsrc = sV + (j * 8 + 2 * tig) * LD + d * 8 + gid;
            vb[j][d][0] = vsrc[0];
            vb[j][d][1] = vsrc[LD];
        }
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
    const float* q_base = static_cast<const float*>(p.q) + b * p.q_stride_b + int64_t(kvh) * G * p.q_stride_h;
    const float* k_base = static_cast<const float*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h;
    const float* v_base = static_cast<const float*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h;
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
        src[0][u] = q_ok ? q_base + int64_t(t) * p.q_stride_t + int64_t(R - t * G) * p.q_stride_h + c : q_base;
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

__global__ void gqa_empty_kernel() {}

// x3, before the attention kernel: the largest finite |x| of each head's K and of each channel of
// its V, and whether the head holds Inf or NaN (all start at zero). Grid: (ceil(T / kX3Rows),
// B * Hkv, 2 for K and V); rows of D fp32 values, 16-byte aligned.
__device__ __forceinline__ const float* x3_head_rows(const GqaParams& p, int z, int bh, int64_t& stride_t) {
    const int b = bh / p.Hkv, h = bh % p.Hkv;
    stride_t = z ? p.v_stride_t : p.k_stride_t;
    return static_cast<const float*>(z ? p.v : p.k) + b * (z ? p.v_stride_b : p.k_stride_b) +
           h * (z ? p.v_stride_h : p.k_stride_h);
}
template <int DP>
__global__ void __launch_bounds__(kX3Threads) x3_absmax_kernel(const GqaParams p) {
    const X3Work w = x3_work(p, DP);
    const int z = int(blockIdx.z), bh = int(blockIdx.y), t0 = int(blockIdx.x) * kX3Rows;
    int64_t stride_t = 0;
    const float* rows = x3_head_rows(p, z, bh, stride_t);
    // Thread i reads float4 chunk i % chunks of rows t0 + i / chunks, stepping `per` rows.
    const int chunks = p.D / 4, per = kX3Threads / chunks;
    const int c = (int(threadIdx.x) % chunks) * 4, r0 = int(threadIdx.x) / chunks;
    const int t_end = min(t0 + kX3Rows, p.T);
    float4 mx = make_float4(0.f, 0.f, 0.f, 0.f);
    bool bad = false;
    if (r0 < per) {
        for (int t = t0 + r0; t < t_end; t += per) {
            const float4 x = *reinterpret_cast<const float4*>(rows + t * stride_t + c);
            abs_max_finite(x.x, mx.x, bad);
            abs_max_finite(x.y, mx.y, bad);
            abs_max_finite(x.z, mx.z, bad);
            abs_max_finite(x.w, mx.w, bad);
        }
    }
    if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) atomicOr(&w.bad[bh], 1u);
    if (z == 0) {   // K: one maximum for the head
        const float m = fmaxf(fmaxf(mx.x, mx.y), fmaxf(mx.z, mx.w));
        const uint32_t warp_max = __reduce_max_sync(0xffffffffu, __float_as_uint(m));
        if (threadIdx.x % 32 == 0) atomicMax(&w.absmax_k[bh], warp_max);
    } else {        // V: one maximum per channel, gathered in shared memory first
        __shared__ uint32_t col_max[DP];
        for (int i = threadIdx.x; i < DP; i += kX3Threads) col_max[i] = 0u;
        __syncthreads();
        if (r0 < per) {
            atomicMax(&col_max[c], __float_as_uint(mx.x));
            atomicMax(&col_max[c + 1], __float_as_uint(mx.y));
            atomicMax(&col_max[c + 2], __float_as_uint(mx.z));
            atomicMax(&col_max[c + 3], __float_as_uint(mx.w));
        }
        __syncthreads();
        for (int i = threadIdx.x; i < p.D; i += kX3Threads) {
            if (col_max[i] != 0u) atomicMax(&w.absmax_v[int64_t(bh) * DP + i], col_max[i]);
        }
    }
}
// x3: K and V rows times 2^e of their group (K: the head; V: the channel), as fp16 hi and lo rows
// in the workspace, zero past D.
template <int DP>
__global__ void __launch_bounds__(kX3Threads) x3_split_kernel(const GqaParams p) {
    const X3Work w = x3_work(p, DP);
    const int z = int(blockIdx.z), bh = int(blockIdx.y), t0 = int(blockIdx.x) * kX3Rows;
    const int bh_count = p.B * p.Hkv;
    int64_t stride_t = 0;
    const float* rows = x3_head_rows(p, z, bh, stride_t);
    Half16* dst = w.kv + (int64_t(z) * bh_count + bh) * p.T * 2 * DP;
    constexpr int kChunks = DP / 4;
    static_assert(kX3Threads % kChunks == 0, "each thread keeps one float4 column chunk");
    // This thread's four columns and their exponents, the same on every row it splits.
    const int c = (int(threadIdx.x) % kChunks) * 4;
    float f1[4], f2[4];   // 2^e as two exact factors
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int e = x3_exponent(z == 0 ? w.absmax_k[bh] : w.absmax_v[int64_t(bh) * DP + c + j]);
        f1[j] = pow2_exact(e / 2);
        f2[j] = pow2_exact(e - e / 2);
    }
    for (int t = t0 + int(threadIdx.x) / kChunks; t < min(t0 + kX3Rows, p.T); t += kX3Threads / kChunks) {
        const float4 x = c < p.D ? *reinterpret_cast<const float4*>(rows + t * stride_t + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        uint2 h, l;
        x3_split2(x.x * f1[0] * f2[0], x.y * f1[1] * f2[1], h.x, l.x);
        x3_split2(x.z * f1[2] * f2[2], x.w * f1[3] * f2[3], h.y, l.y);
        Half16* row = dst + int64_t(t) * 2 * DP;
        *reinterpret_cast<uint2*>(row + c) = h;
        *reinterpret_cast<uint2*>(row + DP + c) = l;
    }
}

// The read floor, for benchmarks: read q, k and v once (16 bytes per thread per step where the
// rows allow) and write o = q; nothing else. Contiguous tensors only (the binding makes them so).
template <typename Elem>
__global__ void __launch_bounds__(256) gqa_read_floor_kernel(const GqaParams p) {
    grid_dependency_wait();
    const int64_t nq = int64_t(p.B) * p.T * p.Hq * p.D, nkv = int64_t(p.B) * p.T * p.Hkv * p.D;
    constexpr int kVec = 16 / int(sizeof(Elem));
    const Elem* q = static_cast<const Elem*>(p.q);
    Elem* o = static_cast<Elem*>(p.o);
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    float sink = 0.f;
    if (p.vec16) {
        for (int64_t i = first; i < nq / kVec; i += stride)
            reinterpret_cast<float4*>(o)[i] = reinterpret_cast<const float4*>(q)[i];
        for (int64_t i = first; i < nkv / kVec; i += stride) {
            const float4 a = reinterpret_cast<const float4*>(p.k)[i], b = reinterpret_cast<const float4*>(p.v)[i];
            sink += a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
        }
    }
    const int64_t q_done = p.vec16 ? nq / kVec * kVec : 0, kv_done = p.vec16 ? nkv / kVec * kVec : 0;
    for (int64_t i = q_done + first; i < nq; i += stride) o[i] = q[i];
    for (int64_t i = kv_done + first; i < nkv; i += stride)
        sink += float(static_cast<const Elem*>(p.k)[i]) + float(static_cast<const Elem*>(p.v)[i]);
    if (sink == 1.2345678e-30f) o[0] = q[0];   // keeps the K and V reads; never true for real data
}

// ---------------------------------------------------------------------------------------------
// Per-device facts, read once.
constexpr int kMaxDevices = 64;

int sm_count(int dev) {
    static int count[kMaxDevices] = {};
    if (dev >= kMaxDevices) return 132;
    if (count[dev] == 0) cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev);
    return count[dev] > 0 ? count[dev] : 132;
}

// Raise a kernel's dynamic shared-memory limit to `bytes`, once per (kernel, device).
template <typename Kernel>
cudaError_t raise_smem_limit(Kernel kernel, size_t bytes, int dev, bool (&raised)[kMaxDevices]) {
    if (bytes <= 48 * 1024 || (dev < kMaxDevices && raised[dev])) return cudaSuccess;
    int optin = 0;
    cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return err;
    if (bytes > size_t(optin)) return cudaErrorInvalidConfiguration;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (err != cudaSuccess) return err;
    if (dev < kMaxDevices) raised[dev] = true;
    return cudaSuccess;
}

int cc_major(int dev) {
    static int major[kMaxDevices] = {};
    if (dev >= kMaxDevices) return 0;
    if (major[dev] == 0) cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev);
    return major[dev];
}

// CTAs of the row-wise kernel with rows_per_cta packed rows each.
int64_t rowwise_ctas(const GqaParams& p, int rows_per_cta) {
    return (int64_t(p.T) * p.group + rows_per_cta - 1) / rows_per_cta * p.B * p.Hkv;
}
// Keys per shared-memory chunk of the row-wise kernel: the whole sequence when it fits the
// budget, else the most whole warps of keys that do (below 32: none fits).
int rowwise_chunk_keys(const GqaParams& p, int nw, int rw) {
    const int fixed = rowwise_fixed_floats(p.D, nw, rw), per_key = rowwise_key_floats(p.D);
    const int cap = (kRowSmemBudget / int(sizeof(float)) - fixed) / per_key / 32 * 32;
    return std::min((p.T + 31) / 32 * 32, cap);
}

// A launch that on sm_90+ overlaps the tail of the previous kernel on the stream (programmatic
// dependent launch: the kernel waits for it before its first global read).
template <typename Kernel, typename... Args>
cudaError_t launch_overlapped(Kernel kernel, int64_t blocks, int threads, size_t smem, cudaStream_t stream, int dev,
                              const Args&... args) {
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    cudaLaunchAttribute overlap[1];
    overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(blocks));
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = overlap;
    cfg.numAttrs = cc_major(dev) >= 9 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// Built for sm_90a alone (the build then defines GQA_SM90A): the wgmma families exist.
#ifdef GQA_SM90A
constexpr bool kHaveWgmma = true;
#else
constexpr bool kHaveWgmma = false;
#endif

// CTAs of 64 packed rows (every tiled variant but the 16-bit mma.sync one): the grid of the long
// variants, of the x3 kernel and of its redo flags.
int64_t tiles_of_64_rows(const GqaParams& p) { return (int64_t(p.T) * p.group + 63) / 64 * p.B * p.Hkv; }

// Short sequences, and head dims too small to feed a tensor-core tile, take the row-wise kernel.
constexpr int kRowwiseMaxT = 128;
constexpr int kRowwiseMaxD = 8;

// ---------------------------------------------------------------------------------------------
// The plan: one decision per call, from the shapes, dtype, row alignment and device. The
// workspace size, the launch and plan() all read the same GqaPlan.
//  - row-wise: T <= kRowwiseMaxT or head_dim <= kRowwiseMaxD. Small grids (one-row-per-warp CTAs
//    at most two per SM) are latency-bound: 8 warps x 1 row; larger grids 4 warps x 4 rows, which
//    share every key read. fp32 in 16-byte rows that fit one chunk addresses every copy before
//    the wait for the previous grid ("planned").
//  - short: fp32, 16-byte rows, head_dim 9..32, where the row-wise grid would be 8 x 1.
//  - x3: fp32 on an sm_90a build, head_dim 33..128, 16-byte rows, allow_tf32 off, a grid of 64-row
//    CTAs that fills the GPU.
//  - wgmma: fp16 and bf16 on an sm_90a build, head_dim 33..128 (widths 64, 128), 16-byte rows.
//  - tiled (mma.sync): everything else; fp32 at widths up to 128 splits each K/V tile over 8
//    warps when 64-row CTAs would not give every SM one.
GqaPlan make_plan(const GqaParams& p, const GqaDevice& dev) {
    GqaPlan plan{};
    plan.dtype = p.dtype;
    plan.warps = 4;
    plan.split = 1;
    const bool fp32 = p.dtype == kGqaFloat32;
    const int64_t sms = dev.sm_count > 0 ? dev.sm_count : 1;
    if (p.T <= kRowwiseMaxT || p.D <= kRowwiseMaxD) {
        const bool small_grid = rowwise_ctas(p, 8) <= 2 * sms;
        if (fp32 && p.vec16 && p.T <= kShortMaxT && p.D > kRowwiseMaxD && p.D <= 32 && small_grid) {
            plan.family = kGqaShort;
            plan.width = 32;
            plan.warps = kShortWarps;
            return plan;
        }
        plan.family = kGqaRowwise;
        plan.warps = small_grid ? 8 : 4;
        plan.split = small_grid ? 1 : 4;
        const int copies = rowwise_planned_copies(plan.split);
        plan.planned = fp32 && p.vec16 && p.T <= rowwise_chunk_keys(p, plan.warps, plan.split) &&
                       int64_t(plan.warps * plan.split + 2 * p.T) * (p.D / 4) <= int64_t(copies) * 32 * plan.warps;
        return plan;
    }
    plan.width = p.D <= 32 ? 32 : p.D <= 64 ? 64 : p.D <= 128 ? 128 : 256;
    if (kHaveWgmma && p.vec16 && p.D > 32 && p.D <= 128) {
        if (!fp32) {
            plan.family = kGqaWgmma;
            return plan;
        }
        if (!p.tf32_single && int64_t(p.B) * p.Hkv <= 65535 && tiles_of_64_rows(p) >= sms) {
            plan.family = kGqaX3;
            return plan;
        }
    }
    plan.family = kGqaTiled;
    if (fp32 && plan.width <= 128 && tiles_of_64_rows(p) < sms) {
        plan.warps = 8;
        plan.split = 8;
    }
    return plan;
}

// ---------------------------------------------------------------------------------------------
// Launches, one per family.
template <typename Elem, int NW, int RW>
cudaError_t launch_rowwise(const GqaParams& p, const GqaPlan& plan, cudaStream_t stream, int dev) {
    static bool raised[kMaxDevices] = {};
    const int kc = rowwise_chunk_keys(p, NW, RW);
    if (kc < 32) return cudaErrorInvalidConfiguration;   // not one warp of keys fits
    const size_t smem = sizeof(float) * (size_t(rowwise_fixed_floats(p.D, NW, RW)) + size_t(kc) * rowwise_key_floats(p.D));
    auto kernel = gqa_rowwise_kernel<Elem, NW, RW>;
    cudaError_t err = raise_smem_limit(kernel, kRowSmemBudget, dev, raised);
    if (err != cudaSuccess) return err;
    RowwiseDivs dv;
    dv.bh = FastDiv(p.B * p.Hkv);
    dv.hkv = FastDiv(p.Hkv);
    dv.group = FastDiv(p.group);
    dv.width = FastDiv(std::is_same<Elem, float>::value && p.vec16 ? p.D / 4 : rowwise_d4(p.D));
    dv.planned = plan.planned;
    return launch_overlapped(kernel, rowwise_ctas(p, NW * RW), 32 * NW, smem, stream, dev, p, kc, dv);
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
    return launch_overlapped(kernel, rowwise_ctas(p, kShortRows), 32 * kShortWarps, short_smem_bytes<DP>(), stream, dev, p, dv);
}

template <int kDtype, int DP, int KW, bool kWg = false>
cudaError_t launch(const GqaParams& p, cudaStream_t stream, int dev) {
    using Tr = TileTraits<DP, KW, ElemOf<kDtype>, kWg>;
    auto kernel = gqa_fwd_kernel<kDtype, DP, KW, kWg>;
    static bool raised[kMaxDevices] = {};
    const cudaError_t err = raise_smem_limit(kernel, Tr::kSmemBytes, dev, raised);
    if (err != cudaSuccess) return err;
    const int64_t n_qtiles = (int64_t(p.T) * p.group + Tr::kBlockM - 1) / Tr::kBlockM;
    const int64_t blocks = n_qtiles * p.B * p.Hkv;
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    TileDivs dv;
    dv.bh = FastDiv(p.B * p.Hkv);
    dv.hkv = FastDiv(p.Hkv);
    dv.group = FastDiv(p.group);
    kernel<<<unsigned(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, dv);
    return cudaGetLastError();
}

// The tiled mma.sync kernel, whole CTAs (split 1) or key-split (split 8, fp32 up to width 128).
template <int kDtype, int DP>
cudaError_t launch_tiled(const GqaParams& p, int split, cudaStream_t stream, int dev) {
    if constexpr (DP <= 128 && kDtype == kGqaFloat32) {
        if (split == 8) return launch<kDtype, DP, 8>(p, stream, dev);
    }
    return launch<kDtype, DP, 1>(p, stream, dev);
}

// Scan and split K and V, run the x3 attention kernel, then the 3xTF32 kernel for the CTAs that
// met Inf or NaN (the others return at once).
template <int DP>
cudaError_t launch_x3(const GqaParams& p, cudaStream_t stream, int dev) {
    const X3Work w = x3_work(p, DP);
    cudaError_t err = cudaMemsetAsync(w.absmax_k, 0, x3_stats_bytes(p, DP), stream);
    if (err != cudaSuccess) return err;
    const dim3 grid(unsigned((p.T + kX3Rows - 1) / kX3Rows), unsigned(p.B * p.Hkv), 2);
    x3_absmax_kernel<DP><<<grid, kX3Threads, 0, stream>>>(p);
    x3_split_kernel<DP><<<grid, kX3Threads, 0, stream>>>(p);
    err = launch<kGqaFloat32, DP, 1, true>(p, stream, dev);
    if (err != cudaSuccess) return err;
    GqaParams redo = p;
    redo.redo = w.redo;
    return launch<kGqaFloat32, DP, 1>(redo, stream, dev);
}

// The single dispatch: the plan's family and width become template parameters here.
template <int kDtype>
cudaError_t launch_plan(const GqaParams& p, const GqaPlan& plan, cudaStream_t stream, int dev) {
    using Elem = ElemOf<kDtype>;
    switch (plan.family) {
        case kGqaRowwise:
            return plan.warps == 8 ? launch_rowwise<Elem, 8, 1>(p, plan, stream, dev)
                                   : launch_rowwise<Elem, 4, 4>(p, plan, stream, dev);
        case kGqaShort:
            if constexpr (kDtype == kGqaFloat32) return launch_short<32>(p, stream, dev);
            break;
        case kGqaX3:
            if constexpr (kHaveWgmma && kDtype == kGqaFloat32) {
                if (p.workspace == nullptr) return cudaErrorInvalidValue;
                return plan.width == 64 ? launch_x3<64>(p, stream, dev) : launch_x3<128>(p, stream, dev);
            }
            break;
        case kGqaWgmma:
            if constexpr (kHaveWgmma && kDtype != kGqaFloat32) {
                return plan.width == 64 ? launch<kDtype, 64, 1, true>(p, stream, dev)
                                        : launch<kDtype, 128, 1, true>(p, stream, dev);
            }
            break;
        case kGqaTiled:
            switch (plan.width) {
                case 32: return launch_tiled<kDtype, 32>(p, plan.split, stream, dev);
                case 64: return launch_tiled<kDtype, 64>(p, plan.split, stream, dev);
                case 128: return launch_tiled<kDtype, 128>(p, plan.split, stream, dev);
                case 256: return launch_tiled<kDtype, 256>(p, plan.split, stream, dev);
                default: break;
            }
            break;
        default: break;
    }
    return cudaErrorInvalidValue;
}

// Every plan make_plan can return on this build, for coverage checks.
std::vector<GqaPlan> every_plan() {
    std::vector<GqaPlan> plans;
    auto add = [&](int family, int dtype, int width, int warps, int split, bool planned) {
        GqaPlan plan{};
        plan.family = family, plan.dtype = dtype, plan.width = width, plan.warps = warps, plan.split = split;
        plan.planned = planned;
        plans.push_back(plan);
    };
    for (int dtype : {kGqaFloat32, kGqaFloat16, kGqaBFloat16}) {
        const bool fp32 = dtype == kGqaFloat32;
        add(kGqaRowwise, dtype, 0, 8, 1, false);
        if (fp32) add(kGqaRowwise, dtype, 0, 8, 1, true);
        add(kGqaRowwise, dtype, 0, 4, 4, false);
        if (fp32) add(kGqaShort, dtype, 32, kShortWarps, 1, false);
        for (int width : {32, 64, 128, 256}) {
            add(kGqaTiled, dtype, width, 4, 1, false);
            if (fp32 && width <= 128) add(kGqaTiled, dtype, width, 8, 8, false);
        }
        if (kHaveWgmma) {
            for (int width : {64, 128}) add(fp32 ? kGqaX3 : kGqaWgmma, dtype, width, 4, 1, false);
        }
    }
    return plans;
}

}  // namespace

int gqa_device_facts(GqaDevice* out) {
    int dev = 0;
    const cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return int(err);
    out->sm_count = sm_count(dev);
    out->cc_major = cc_major(dev);
    return 0;
}

GqaPlan gqa_make_plan(const GqaParams& p, const GqaDevice& dev) { return make_plan(p, dev); }

int gqa_plan_count() { return int(every_plan().size()); }
GqaPlan gqa_plan_at(int i) { return every_plan().at(size_t(i)); }

int gqa_forward(const GqaParams& p, const GqaPlan& plan, void* stream) {
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    int dev = 0;
    const cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return int(err);
    switch (plan.dtype) {
        case kGqaFloat32: return int(launch_plan<kGqaFloat32>(p, plan, s, dev));
        case kGqaFloat16: return int(launch_plan<kGqaFloat16>(p, plan, s, dev));
        case kGqaBFloat16: return int(launch_plan<kGqaBFloat16>(p, plan, s, dev));
        default: return int(cudaErrorInvalidValue);
    }
}

int64_t gqa_workspace_bytes(const GqaParams& p, const GqaPlan& plan) {
    if (plan.family != kGqaX3) return 0;
    return x3_kv_elems(p, plan.width) * int64_t(sizeof(Half16)) + x3_stats_bytes(p, plan.width) + tiles_of_64_rows(p);
}

int gqa_empty_launch(void* /*out*/, void* stream) {
    gqa_empty_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>();
    return int(cudaGetLastError());
}

int gqa_read_floor(const GqaParams& p, void* stream) {
    const int64_t items = p.B * int64_t(p.T) * (int64_t(p.Hq) + 2 * p.Hkv) * p.D;
    const int64_t blocks = std::min<int64_t>((items + 4 * 256 - 1) / (4 * 256), 1 << 20);
    int dev = 0;
    const cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return int(err);
    if (p.dtype == kGqaFloat32)
        return int(launch_overlapped(gqa_read_floor_kernel<float>, blocks, 256, 0, static_cast<cudaStream_t>(stream), dev, p));
    return int(launch_overlapped(gqa_read_floor_kernel<Half16>, blocks, 256, 0, static_cast<cudaStream_t>(stream), dev, p));
}
