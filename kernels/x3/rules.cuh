// fp32 on sm_90a as three fp16 products: constants, the workspace layout (also sized by the
// plan), and the scale-and-split helpers shared by the pre-passes and the attention kernel.
#ifndef GQA_X3_RULES_CUH
#define GQA_X3_RULES_CUH

#include "common/base.cuh"

namespace {

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

}  // namespace
#endif  // GQA_X3_RULES_CUH
