// Warpgroup primitives (sm_90a): wgmma wrappers and the warpgroup S and P V products.
#ifndef GQA_COMMON_WGMMA_CUH
#define GQA_COMMON_WGMMA_CUH

#include "common/mma.cuh"

namespace {

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
// The descriptor `bytes` past desc's start (a constant offset inside the same shared tile). The
// start field is the low 14 bits of the low word (address / 16), which no shared-memory address
// overflows, so one 32-bit add does it: built afresh from the address, each k-step's descriptor
// took about 12 uniform instructions between two wgmma issues (bench/NOTES.md v60).
__device__ __forceinline__ uint64_t wg_desc_at(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = uint32_t(desc) + (bytes >> 4), hi = uint32_t(desc >> 32);
    return (uint64_t(hi) << 32) | lo;
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
template <int N> __device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// Register reallocation between warpgroups (every thread of the warpgroup executes it).
template <int N> __device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
// Makes this thread's ordinary shared-memory writes (cp.async included) visible to wgmma's reads.
[[maybe_unused]] __device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Each wgmma wrapper below is one asm statement; the input type (bf16 or f16) is spliced into
// the instruction name, so both types share one operand list.
// GQA_WGMMA_BODY(ASM) is a wrapper's body: ASM for its input type on sm_90a, a trap elsewhere.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GQA_WGMMA_BODY(ASM) \
    if constexpr (kBf16) ASM("bf16"); \
    else ASM("f16")
#else
#define GQA_WGMMA_BODY(ASM) __trap()
#endif
#define GQA_ASM_WGMMA_SS_N64(TY) \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                     : "l"(da), "l"(db), "r"(accumulate), "n"(kTransA), "n"(kTransB))
// kTransA / kTransB: the operand is stored M- / N-major (rows along K) instead of K-major.
template <bool kBf16, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int accumulate) { GQA_WGMMA_BODY(GQA_ASM_WGMMA_SS_N64); }
#undef GQA_ASM_WGMMA_SS_N64
#define GQA_ASM_WGMMA_SS_N128(TY) \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                     : "l"(da), "l"(db), "r"(accumulate))
template <bool kBf16>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t da, uint64_t db, int accumulate) { GQA_WGMMA_BODY(GQA_ASM_WGMMA_SS_N128); }
#undef GQA_ASM_WGMMA_SS_N128
#define GQA_ASM_WGMMA_RS_N64(TY) \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(kTransB))
// kTransB: B stored N-major (rows along K, as V in P V: the default) or K-major (0: keys along the
// rows, as K in Q K^T).
template <bool kBf16, int kTransB = 1>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int accumulate) { GQA_WGMMA_BODY(GQA_ASM_WGMMA_RS_N64); }
#undef GQA_ASM_WGMMA_RS_N64
#define GQA_ASM_WGMMA_RS_TB_N128(TY) \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate))
template <bool kBf16>
__device__ __forceinline__ void wgmma_rs_tb_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accumulate) { GQA_WGMMA_BODY(GQA_ASM_WGMMA_RS_TB_N128); }
#undef GQA_ASM_WGMMA_RS_TB_N128

// S (the warpgroup's 64 rows x 8 NT keys, NT 8 or 16; each warp holds its 16 rows as s[NT][4]) =
// Q K^T. Q is a swizzled tile of QR rows whose warpgroup rows start at `q_row0`, K a swizzled tile
// of KR rows. Issued without a commit: the caller commits, and s is not valid before the matching
// wg_wait. `accumulate`: add to s instead of starting from zero.
template <bool kBf16, int DP, int QR, int KR, int NT>
__device__ __forceinline__ void qk_wgmma(float (&s)[NT][4], const uint16_t* q_tile, int q_row0, const uint16_t* k_tile,
                                         bool accumulate = false) {
    static_assert(NT == 8 || NT == 16, "64 or 128 keys");
    const uint64_t qd = wg_desc(reinterpret_cast<const unsigned char*>(q_tile) + q_row0 * 128, 16, 1024);
    const uint64_t kd = wg_desc(k_tile, 16, 1024);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        const int blk = kk / 4, col = (kk % 4) * 32;   // 64-column block, byte offset of the k-step
        const uint64_t da = wg_desc_at(qd, blk * QR * 128 + col), db = wg_desc_at(kd, blk * KR * 128 + col);
        if constexpr (NT == 8) wgmma_ss_n64<kBf16>(reinterpret_cast<float(&)[32]>(s), da, db, kk > 0 || accumulate);
        else wgmma_ss_n128<kBf16>(reinterpret_cast<float(&)[64]>(s), da, db, kk > 0 || accumulate);
    }
}

// The warp's 16 rows of a swizzled tile of ROWS rows (sw128_offset) as the DP / 16 k16 A fragments
// of a register-A wgmma (rows 16 warp .. of the tile are the warp's rows of the product): one x4
// ldmatrix a k-step, lanes 0-15 naming the rows at its first 8 columns, 16-31 at the next 8.
template <int DP, int ROWS>
__device__ __forceinline__ void load_a_fragments(uint32_t (&a)[DP / 16][4], const uint16_t* tile, int warp, int lane) {
    const int r = 16 * warp + (lane & 15);
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) ldmatrix_x4(a[kk], tile + sw128_offset(r, 16 * kk + 8 * (lane >> 4), ROWS) / 2);
}

// qk_wgmma (64 keys) with Q's rows from registers (load_a_fragments) instead of shared memory:
// only K's tile is read a k-step. Issued without a commit; neither s nor a may be touched before
// the caller's matching wg_wait.
template <bool kBf16, int DP, int KR>
__device__ __forceinline__ void qk_wgmma_rs(float (&s)[8][4], const uint32_t (&a)[DP / 16][4], const uint16_t* k_tile) {
    const uint64_t kd = wg_desc(k_tile, 16, 1024);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk)
        wgmma_rs_n64<kBf16, 0>(reinterpret_cast<float(&)[32]>(s), a[kk], wg_desc_at(kd, (kk / 4) * KR * 128 + (kk % 4) * 32), kk > 0);
}

// P, the probabilities of an S tile of 8 NT keys, as the NT / 2 k16 A fragments of P V (16-bit).
template <bool kBf16, int NT>
__device__ __forceinline__ void pack_p(uint32_t (&a)[NT / 2][4], const float (&s)[NT][4]) {
#pragma unroll
    for (int ks = 0; ks < NT / 2; ++ks) {
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
template <bool kBf16, int DP, int KR, int KS>
__device__ __forceinline__ void pv_wgmma(float (&o)[DP / 8][4], const uint32_t (&a)[KS][4], const uint16_t* v_tile,
                                         bool accumulate = true) {
    const uint64_t vd = wg_desc(v_tile, KR * 128, 1024);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {   // 16 keys a step
        const uint64_t db = wg_desc_at(vd, ks * 16 * 128);
        if constexpr (DP == 64) {
            wgmma_rs_n64<kBf16>(reinterpret_cast<float(&)[32]>(o), a[ks], db, ks > 0 || accumulate);
        } else if constexpr (DP == 128) {
            wgmma_rs_tb_n128<kBf16>(reinterpret_cast<float(&)[64]>(o), a[ks], db, ks > 0 || accumulate);
        } else {   // 256: two n128 halves, the second from V's third 64-column block
            static_assert(DP == 256, "head_dim widths 64, 128 and 256");
            wgmma_rs_tb_n128<kBf16>(reinterpret_cast<float(&)[64]>(o[0]), a[ks], db, ks > 0 || accumulate);
            wgmma_rs_tb_n128<kBf16>(reinterpret_cast<float(&)[64]>(o[16]), a[ks], wg_desc_at(vd, ks * 16 * 128 + 2 * KR * 128),
                                    ks > 0 || accumulate);
        }
    }
}
#undef GQA_WGMMA_BODY

// D (fp16 pairs, N / 4 registers a thread: register 2 n + h holds the m16n8 accumulator's elements
// 2 h and 2 h + 1 of n-tile n) += A (fp16 A fragments in registers) B, B N-major from shared
// memory: a low-precision product for a correction term (bwdmma/kernels.cuh, Pol::kDeltaFix).
__device__ __forceinline__ void wgmma_rs_tb_n64_f16acc(uint32_t (&d)[16], const uint32_t (&a)[4], uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f16.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 1;\n}\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
#else
    __trap();
#endif
}
__device__ __forceinline__ void wgmma_rs_tb_n128_f16acc(uint32_t (&d)[32], const uint32_t (&a)[4], uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f16.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
                   "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
#else
    __trap();
#endif
}
// pv_wgmma with fp16 inputs and an fp16 accumulator (DP 64 or 128).
template <int DP, int KR, int KS>
__device__ __forceinline__ void pv_wgmma_f16acc(uint32_t (&o)[DP / 8][2], const uint32_t (&a)[KS][4], const uint16_t* v_tile) {
    static_assert(DP == 64 || DP == 128, "head_dim widths 64 and 128");
    const uint64_t vd = wg_desc(v_tile, KR * 128, 1024);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const uint64_t db = wg_desc_at(vd, ks * 16 * 128);
        if constexpr (DP == 64) wgmma_rs_tb_n64_f16acc(reinterpret_cast<uint32_t(&)[16]>(o), a[ks], db, 1);
        else wgmma_rs_tb_n128_f16acc(reinterpret_cast<uint32_t(&)[32]>(o), a[ks], db, 1);
    }
}

// Rows [row0, row0 + ROWS) of one head of a contiguous [B, T, H, DP] tensor into a swizzled tile
// of ROWS rows (sw128_offset), by THREADS threads, 16 bytes a copy; rows at or past T are zeros. A
// thread copies one 16-byte column of every kRowStep-th row: one address, then a constant step.
template <int DP, int ROWS, int THREADS>
__device__ __forceinline__ void swizzled_load(uint16_t* tile, const uint16_t* base, int64_t b, int row0, int head,
                                              int heads, int T) {
    constexpr int kChunks = DP / 8, kRowStep = THREADS / kChunks;
    static_assert(THREADS % kChunks == 0 && ROWS % kRowStep == 0, "whole rows each round");
    unsigned char* dst = reinterpret_cast<unsigned char*>(tile);
    const int c = 8 * (int(threadIdx.x) % kChunks), r0 = int(threadIdx.x) / kChunks;
    const int64_t step = int64_t(kRowStep) * heads * DP;
    const uint16_t* src = base + ((b * T + row0 + r0) * heads + head) * int64_t(DP) + c;
#pragma unroll
    for (int k = 0; k < ROWS / kRowStep; ++k) {
        const int r = r0 + k * kRowStep;
        const bool valid = row0 + r < T;
        cp_async16(dst + sw128_offset(r, c, ROWS), valid ? src + k * step : base, valid ? 16 : 0);
    }
}

}  // namespace
#endif  // GQA_COMMON_WGMMA_CUH
