// The backward's mma.sync unit (any GPU the build targets): fp16 and bf16 at head_dim 64 and 128,
// a unit per dtype and width (GQA_DTYPE, GQA_WIDTH); the kernels are bwdmma/kernels.cuh.

#include "bwdmma/kernels.cuh"

namespace {

// mma.sync products from padded tiles (rows DP + 8 values apart: an ldmatrix's 8 rows hit distinct
// banks), each warp on its 16 rows.
template <bool kBf16_, int DP_> struct MmaProducts : Bwd16BitIo<kBf16_> {
    static constexpr bool kBf16 = kBf16_;
    static constexpr int DP = DP_, LD = DP + 8, kTileHalves = kTile * LD, kAlign = 16, kRowValues = DP;
    static constexpr int kOut = DP;   // every output column in one CTA
    static __device__ __forceinline__ uint16_t* aligned(uint16_t* smem) { return smem; }
    static __device__ __forceinline__ const uint16_t* columns(const uint16_t* tile, int col0) { return tile + col0; }
    // Rows [row0, row0 + 64) of one head of a contiguous [B, T, H, DP] tensor into a tile, 16 bytes
    // a copy; rows at or past T are zeros.
    static __device__ __forceinline__ void load(uint16_t* tile, const uint16_t* base, int64_t b, int row0, int head,
                                                int heads, int T) {
        constexpr int kChunks = DP / 8;   // 16-byte pieces per row
        for (int i = threadIdx.x; i < kTile * kChunks; i += kThreads) {
            const int r = i / kChunks, c = i % kChunks;
            const int t = row0 + r;
            const bool valid = t < T;
            const uint16_t* src = base + ((b * T + (valid ? t : 0)) * heads + head) * int64_t(DP) + 8 * c;
            cp_async16(tile + r * LD + 8 * c, src, valid ? 16 : 0);
        }
    }
    static __device__ __forceinline__ void landed() {}
    // Every copy by the CTA's threads (cp.async): no tensor maps.
    static constexpr bool kTma = false;
    static constexpr int kKeyGroups = 1, kRowGroups = 1;   // 64 keys a dK/dV CTA, 64 rows a dQ CTA
    struct Maps {};
    static cudaError_t make_maps(const GqaBwdParams&, Maps*) { return cudaSuccess; }
    // s = A B^T for the warp's 16 rows of tile A and the 64 rows of tile B (synchronous: the
    // wgmma policy's issue, wait and settle are one step here).
    static __device__ __forceinline__ void qk_issue(float (&s)[1][kTile / 8][4], const uint16_t* a, const uint16_t* b,
                                                    int warp, int lane) {
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n) s[0][n][0] = s[0][n][1] = s[0][n][2] = s[0][n][3] = 0.f;
        qk_16bit<kBf16, kTile, DP, LD, 1>(s, a + 16 * warp * LD, b, DP / 16, lane);
    }
    // o += P B for the warp's 16 rows, P the fp32 s rounded to 16 bits, B a tile read N-major.
    static __device__ __forceinline__ void pv_issue(float (&o)[1][DP / 8][4], uint32_t (&)[kTile / 16][4],
                                                    const float (&s)[1][kTile / 8][4], const uint16_t* b, int lane, float = 1.f) {
        pv_16bit<kBf16, kTile, DP, LD, 1>(o, s, b, DP / 8, lane);
    }
    template <int N> static __device__ __forceinline__ void wait() {}
    template <int X> static __device__ __forceinline__ void settle(float (&)[1][X][4]) {}
};

static_assert(GQA_DTYPE != kGqaFloat32 && (GQA_WIDTH == 64 || GQA_WIDTH == 128), "a unit for fp16 or bf16 at width 64 or 128");
using Products = MmaProducts<GQA_DTYPE == kGqaBFloat16, GQA_WIDTH>;

}  // namespace

GQA_BWD_ENTRY(bwdmma, Products)
