// The tiled kernel's configuration, one place: keys per tile, shared-memory pitch and size,
// warps and rows per CTA for every (dtype, head_dim width, key split, wgmma) variant.
#ifndef GQA_TILED_TRAITS_CUH
#define GQA_TILED_TRAITS_CUH

#include "common/tile_io.cuh"

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
// CTAs share an SM instead of two (faster: bench/NOTES.md).
constexpr int tile_block_n(int DP, int KW, bool half) {
    return half ? (DP <= 64 ? 64 : 32) : KW == 1 ? (DP <= 64 ? 64 : 32) : (DP <= 64 ? 16 : 8);
}


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

}  // namespace
#endif  // GQA_TILED_TRAITS_CUH
