// The backward's wgmma unit (sm_90a): fp16 and bf16 at head_dim 64, 128 and 256, a unit per dtype
// and width (GQA_DTYPE, GQA_WIDTH): the two kernels of bwdmma/kernels.cuh (dQ, then dK and dV) over
// this policy (its tile products on the warpgroup, the CTA's four warps, 64 rows, from
// 128-byte-swizzled tiles; at width 256 each CTA computes half of the output columns). Where
// GqaBwdParams::fused (width 128 on long sequences, 64 on large grids; gqa_backward_fused), the
// dQ kernel's statistics pass, then fused.cuh's kernel for dK, dV and dQ.

#include "bwdwg/fused.cuh"
#include "common/tma.cuh"

namespace {

template <bool kBf16_, int DP_> struct WgProducts : Bwd16BitIo<kBf16_>, BwdTmaLoads<kTile, DP_> {
    static constexpr bool kBf16 = kBf16_;
    static constexpr int DP = DP_, kTileHalves = kTile * DP, kAlign = 1024, kRowValues = DP;   // swizzled rows carry no padding
    // Output columns (of dQ, dK, dV) a CTA computes: all of them, or at width 256 one half, so that
    // the accumulators are those of width 128 (a grid of two halves; S and dP take all 256).
    static constexpr int kOut = DP == 256 ? 128 : DP;
    // Columns col0 .. of a tile: its 64-column blocks are kTile rows of 128 bytes each.
    static __device__ __forceinline__ const uint16_t* columns(const uint16_t* tile, int col0) {
        return tile + (col0 / 64) * kTile * 64;
    }
    // By an offset from the shared array itself, so that the tiles stay shared-memory pointers to
    // the compiler (LDS and STS, not generic loads and stores).
    static __device__ __forceinline__ uint16_t* aligned(uint16_t* smem) {
        const uint32_t misaligned = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) & (kAlign - 1);
        return smem + ((kAlign - misaligned) & (kAlign - 1)) / 2;
    }
    // Rows [row0, row0 + 64) of one head of a contiguous [B, T, H, DP] tensor into a swizzled tile
    // (sw128_offset) by the CTA's threads; rows at or past T are zeros.
    static __device__ __forceinline__ void load(uint16_t* tile, const uint16_t* base, int64_t b, int row0, int head,
                                                int heads, int T) {
        swizzled_load<DP, kTile, kThreads>(tile, base, b, row0, head, heads, T);
    }
    // This thread's copies, before the barrier after which the warpgroup's products read them.
    static __device__ __forceinline__ void landed() { fence_async_proxy(); }
    // The dK/dV kernel's steps (Q, dO, lse2 and delta) and the dQ kernel's K and V tiles by TMA
    // from one thread instead of cp.async from every thread (BwdTmaLoads): the copies' addresses
    // and bounds were about a third of a step's instructions (bench/NOTES.md v61, v62).
    static constexpr bool kTma = true;
    // The dK/dV kernel's warpgroups of 64 keys a CTA, sharing each step's copies: 2 halves the L2
    // traffic of Q and dO per product (one CTA of 8 warps an SM instead of two of 4; bench/NOTES.md
    // v64, variant bwd_keys_128).
    static constexpr int kKeyGroups = 1;
    // The dQ kernel's warpgroups of 64 query rows a CTA, sharing each key tile's copies (variant
    // bwd_rows_128; bench/NOTES.md v65).
    static constexpr int kRowGroups = 1;
    // The A operands that stay the same over a CTA's loop held in registers, read from their tiles
    // once: at width 64 a product of 64 x 64 from two shared tiles reads 4 KB of shared memory per
    // 32 cycles of the tensor pipe, the shared memory's whole 128 bytes a cycle, and from one tile
    // half that (bench/NOTES.md v100). 16 registers a tile a thread at width 64 (width 128 would
    // need 32). kFixedA: the dK/dV kernel's K and V (186 -> 218 registers, one CTA an SM either
    // way), the fused kernel's K and V (bwdwg/fused.cuh), and the dQ kernel's Q and dO, held to 168
    // registers for its three CTAs an SM (kDqCtas; 154 used, with dP issued after the last tile's
    // dQ product: kDpLate in bwdmma/kernels.cuh, bench/NOTES.md v102). With dP issued beside S the
    // dQ kernel needed 170: at two CTAs an SM, or held to 168 with the wgmmas serialized by ptxas
    // (C7512), 1.1-1.2x slower (v101).
    static constexpr bool kFixedA = DP == 64;
    static constexpr int kDqCtas = kFixedA ? 3 : 0;
    static __device__ __forceinline__ void load_a(uint32_t (&a)[DP / 16][4], const uint16_t* tile, int warp, int lane) {
        load_a_fragments<DP, kTile>(a, tile, warp, lane);
    }
    // A's registers, once the product that reads them has completed (the wait): each XORed with
    // `zero`, a value the compiler cannot know is 0 (from the parameters), so that the program
    // reads them after the product and writes them again for the next step's. Without that read
    // ptxas 13.0 (fixed in 13.3) ended their life at the product that reads them, inside the loop,
    // and gave them to P's fragments: every step after the first multiplied by the previous
    // step's P (bench/NOTES.md v100, v101).
    static __device__ __forceinline__ void settle_a(uint32_t (&a)[DP / 16][4], uint32_t zero) {
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
#pragma unroll
            for (int j = 0; j < 4; ++j) asm volatile("xor.b32 %0, %0, %1;\n" : "+r"(a[kk][j]) : "r"(zero));
    }
    // qk_issue with the warpgroup's rows of A from load_a.
    static __device__ __forceinline__ void qk_issue_rs(float (&s)[1][kTile / 8][4], const uint32_t (&a)[DP / 16][4], const uint16_t* b) {
        qk_wgmma_rs<kBf16, DP, kTile>(s[0], a, b);
        wg_commit();
    }
    static cudaError_t make_maps(const GqaBwdParams& p, typename BwdTmaLoads<kTile, DP_>::Maps* m) {
        return BwdTmaLoads<kTile, DP_>::make_maps_of(p, {p.q, p.dout, p.k, p.v}, kBf16, m);
    }
    // Issues s = A B^T for the warpgroup's 64 rows of tile A (each warp's 16 in its s) and tile
    // B's 64, as one commit group: s is valid after the matching wait and settle.
    static __device__ __forceinline__ void qk_issue(float (&s)[1][kTile / 8][4], const uint16_t* a, const uint16_t* b, int, int) {
        qk_wgmma<kBf16, DP, kTile, kTile>(s[0], a, 0, b);
        wg_commit();
    }
    // Issues o += P B, P the fp32 s rounded to 16 bits into pa (the A operand from registers), as
    // one commit group: neither o nor pa may be touched before the matching wait.
    static __device__ __forceinline__ void pv_issue(float (&o)[1][kOut / 8][4], uint32_t (&pa)[kTile / 16][4],
                                                    const float (&s)[1][kTile / 8][4], const uint16_t* b, int, float = 1.f) {
        pack_p<kBf16>(pa, s[0]);
        pv_wgmma<kBf16, kOut, kTile>(o[0], pa, b);
        wg_commit();
    }
    // Until at most N issued groups are still running.
    template <int N> static __device__ __forceinline__ void wait() { wg_wait<N>(); }
    // An accumulator, after the wait that completed it.
    template <int X> static __device__ __forceinline__ void settle(float (&r)[1][X][4]) {
        fence_regs(reinterpret_cast<float(&)[X * 4]>(r));
    }
};

static_assert(GQA_DTYPE != kGqaFloat32 && (GQA_WIDTH == 64 || GQA_WIDTH == 128 || GQA_WIDTH == 256),
              "a unit for fp16 or bf16 at width 64, 128 or 256");
using Products = WgProducts<GQA_DTYPE == kGqaBFloat16, GQA_WIDTH>;

}  // namespace

extern "C" int gqa_launch_bwdwg(const GqaBwdParams* p, void* stream) {
    int dev = 0;
    const cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return int(err);
    // The two kernels (at width 256 in column halves), or the fused one (GqaBwdParams::fused; its
    // kernels are compiled where it can be taken: widths 64 and 128).
    if constexpr (GQA_WIDTH == 64 || GQA_WIDTH == 128) {
        if (p->fused) return int(fused_launch<Products>(*p, static_cast<cudaStream_t>(stream), dev));
    }
    return int(bwd_launch<Products>(*p, static_cast<cudaStream_t>(stream), dev));
}
