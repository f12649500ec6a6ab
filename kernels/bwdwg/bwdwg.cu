// The backward's wgmma unit (sm_90a): fp16 and bf16 at head_dim 64 and 128, a unit per dtype and
// width (GQA_DTYPE, GQA_WIDTH). The kernels of bwdmma/kernels.cuh with every tile product on the
// warpgroup (the CTA's four warps, 64 rows) from 128-byte-swizzled tiles: the forward's qk_wgmma
// for A B^T, and pack_p with pv_wgmma for P B (B read N-major, as V in the forward).

#include "bwdmma/kernels.cuh"

namespace {

template <bool kBf16_, int DP_> struct WgProducts {
    static constexpr bool kBf16 = kBf16_;
    static constexpr int DP = DP_, kTileHalves = kTile * DP, kAlign = 1024;   // swizzled rows carry no padding
    static __device__ __forceinline__ uint16_t* aligned(uint16_t* smem) {
        return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(smem) + kAlign - 1) / kAlign * kAlign);
    }
    // Rows [row0, row0 + 64) of one head of a contiguous [B, T, H, DP] tensor into a swizzled tile
    // (sw128_offset), 16 bytes a copy; rows at or past T are zeros.
    static __device__ __forceinline__ void load(uint16_t* tile, const uint16_t* base, int64_t b, int row0, int head,
                                                int heads, int T) {
        constexpr int kChunks = DP / 8;   // 16-byte pieces per row
        unsigned char* dst = reinterpret_cast<unsigned char*>(tile);
        for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads) {
            const int r = i / kChunks, c = 8 * (i % kChunks);
            const int t = row0 + r;
            const bool valid = t < T;
            const uint16_t* src = base + ((b * T + (valid ? t : 0)) * heads + head) * int64_t(DP) + c;
            cp_async16(dst + sw128_offset(r, c, kTile), src, valid ? 16 : 0);
        }
    }
    // This thread's copies, before the barrier after which the warpgroup's products read them.
    static __device__ __forceinline__ void landed() { fence_async_proxy(); }
    // s = A B^T for the warpgroup's 64 rows of tile A (each warp's 16 in its s) and tile B's 64.
    static __device__ __forceinline__ void qk(float (&s)[1][kTile / 8][4], const uint16_t* a, const uint16_t* b, int, int) {
        qk_wgmma<kBf16, DP, kTile, kTile>(s[0], a, 0, b);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[kTile / 2]>(s));
    }
    static __device__ __forceinline__ void qk2(float (&s)[1][kTile / 8][4], const uint16_t* a, const uint16_t* b,
                                               float (&s2)[1][kTile / 8][4], const uint16_t* a2, const uint16_t* b2, int,
                                               int) {
        qk_wgmma<kBf16, DP, kTile, kTile>(s[0], a, 0, b);
        qk_wgmma<kBf16, DP, kTile, kTile>(s2[0], a2, 0, b2);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[kTile / 2]>(s));
        fence_regs(reinterpret_cast<float(&)[kTile / 2]>(s2));
    }
    // o += P B, P the fp32 s rounded to 16 bits (the A operand from registers).
    static __device__ __forceinline__ void pv(float (&o)[1][DP / 8][4], const float (&s)[1][kTile / 8][4], const uint16_t* b,
                                              int) {
        uint32_t pa[kTile / 16][4];
        pack_p<kBf16>(pa, s[0]);
        pv_wgmma<kBf16, DP, kTile>(o[0], pa, b);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[DP / 2]>(o));
    }
    static __device__ __forceinline__ void pv2(float (&o)[1][DP / 8][4], const float (&s)[1][kTile / 8][4], const uint16_t* b,
                                               float (&o2)[1][DP / 8][4], const float (&s2)[1][kTile / 8][4],
                                               const uint16_t* b2, int) {
        uint32_t pa[kTile / 16][4], pa2[kTile / 16][4];
        pack_p<kBf16>(pa, s[0]);
        pack_p<kBf16>(pa2, s2[0]);
        pv_wgmma<kBf16, DP, kTile>(o[0], pa, b);
        pv_wgmma<kBf16, DP, kTile>(o2[0], pa2, b2);
        wg_commit();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[DP / 2]>(o));
        fence_regs(reinterpret_cast<float(&)[DP / 2]>(o2));
    }
};

static_assert(GQA_DTYPE != kGqaFloat32 && (GQA_WIDTH == 64 || GQA_WIDTH == 128), "a unit for fp16 or bf16 at width 64 or 128");
using Products = WgProducts<GQA_DTYPE == kGqaBFloat16, GQA_WIDTH>;

}  // namespace

GQA_BWD_ENTRY(bwdwg, Products)
