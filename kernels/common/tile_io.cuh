// Tiles between global and shared memory (padded and swizzled), the x3 Q tile, the non-finite
// checks on a thread's own copies, and the fp32 tile products with their exact fallback.
#ifndef GQA_COMMON_TILE_IO_CUH
#define GQA_COMMON_TILE_IO_CUH

#include "common/wgmma.cuh"
#include "x3/rules.cuh"

namespace {

// Shared-memory row pitch in elements; shared memory holds the input dtype. fp32: DP + 4 floats is
// 4 (mod 32 banks), so a warp's fragment loads touch 32 distinct banks. 16-bit: DP + 8 moves each
// row by an odd number of 16-byte units, so the 8 rows an ldmatrix reads hit distinct banks.
template <typename Elem, int DP> __host__ __device__ constexpr int tile_ld() { return std::is_same<Elem, float>::value ? DP + 4 : DP + 8; }

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

// Folds t[0..2W) into t[0] as a pairwise tree: t[j] = op(t[j], t[j + W]), then half as many.
template <int W, int N, typename Op> __device__ __forceinline__ float fold_tree(float (&t)[N], Op op) {
#pragma unroll
    for (int j = 0; j < W; ++j) t[j] = op(t[j], t[j + W]);
    if constexpr (W > 1) {
        return fold_tree<W / 2>(t, op);
    } else {
        return t[0];
    }
}

// The online-softmax step of one row of an S tile held as accumulators h and h + 1 of each n-tile
// by the quad of lanes that shares the row: the row max m (of the scaled log2 scores) and the
// running sum l move on, S becomes P = exp2(S * scale_log2 - m + shift), and the factor that
// brings O (and l) to the new max is returned. kShift: P carries 2^shift (x3's headroom).
// kFmaTiles: the last kFmaTiles n-tiles take fma_exp2 instead of MUFU's (x <= 0 only).
// kSlack > 0: the row keeps its max while the new one exceeds it by at most kSlack (log2 units),
// so P stays below 2^kSlack and O needs no rescale (factor 1) on most tiles; m and l stay
// consistent, so the result is the same up to rounding. Not with kShift (x3's P has no headroom).
// kTree: the row's max and sum as pairwise trees (depth log2 of the row's values) instead of one
// chain through every value; the same operations, the sum's rounding in another order.
template <int kNTiles, bool kShift = false, int kFmaTiles = 0, int kSlack = 0, bool kTree = false>
__device__ __forceinline__ float softmax_row(float (&st)[kNTiles][4], int h, float& m, float& l, float scale_log2,
                                             float shift = 0.f) {
    static_assert(kSlack == 0 || !kShift, "a stale max needs P's headroom");
    static_assert(!kTree || (kNTiles & (kNTiles - 1)) == 0, "a tree over a power of two of n-tiles");
    float mx = -INFINITY;
    if constexpr (kTree) {
        float t[kNTiles];
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) t[j] = fmaxf(st[j][h], st[j][h + 1]);
        mx = fold_tree<kNTiles / 2>(t, [](float x, float y) { return fmaxf(x, y); });
    } else {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) mx = fmaxf(mx, fmaxf(st[j][h], st[j][h + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    float m_new = fmaxf(m, mx * scale_log2);
    if constexpr (kSlack > 0) m_new = m_new - m <= float(kSlack) ? m : m_new;   // (false for m = -inf, or NaN)
    // -inf only while every key seen for the row is masked (key-split warps past the row's time
    // step) or when the scores are not finite.
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;
    const float m_exp = kShift ? m_ref - shift : m_ref;
    const float f = fast_exp2(m - m_ref);
    l *= f;
    m = m_new;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
        if (j >= kNTiles - kFmaTiles) {
            st[j][h] = fma_exp2(fmaf(st[j][h], scale_log2, -m_exp));
            st[j][h + 1] = fma_exp2(fmaf(st[j][h + 1], scale_log2, -m_exp));
        } else {
            st[j][h] = fast_exp2(fmaf(st[j][h], scale_log2, -m_exp));
            st[j][h + 1] = fast_exp2(fmaf(st[j][h + 1], scale_log2, -m_exp));
        }
        if constexpr (!kTree) l += st[j][h] + st[j][h + 1];
    }
    if constexpr (kTree) {
        float t[kNTiles];
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) t[j] = st[j][h] + st[j][h + 1];
        l += fold_tree<kNTiles / 2>(t, [](float x, float y) { return x + y; });
    }
    return f;
}

// The wgmma variants' exact step for a tile of 16-bit V with Inf or NaN, which the tile's shared
// copy holds as zeros (so the product adds every finite value): O += P V over the attended keys
// key0.. and V's non-finite values only, read from global memory (`v` is the head's key 0, rows
// `v_stride_t` apart). s: P of a warp's 16 rows (this thread's rows at time steps row_t), o: O.
// The key loops stay rolled except over the n-tiles: s must stay in registers. kCompact: the
// n-tiles' loop rolled too, over a copy of s in local memory, so the step is a few hundred
// instructions instead of thousands (it sits inline in the callers' step loops).
template <int kNTiles, int kDTiles, bool kCompact = false>
__device__ __forceinline__ void add_nonfinite_pv(float (&o)[kDTiles][4], const float (&s)[kNTiles][4], const int (&row_t)[2],
                                                 int key0, const Half16* v, int64_t v_stride_t, int T, int D, bool bf16) {
    const int lane = int(threadIdx.x) % 32, tig = lane & 3;
    float copy[kCompact ? kNTiles : 1][4];
    if constexpr (kCompact) {
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) copy[j][e] = s[j][e];
    }
    auto tile_p = [&](int j) -> const float(&)[4] {
        if constexpr (kCompact) {
            return copy[j];
        } else {
            return s[j];
        }
    };
#pragma unroll(kCompact ? 1 : kNTiles)
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll 1
        for (int kk8 = 0; kk8 < 8; ++kk8) {
            const int key = key0 + j * 8 + kk8;
            const float(&sj)[4] = tile_p(j);
            const float own0 = (kk8 & 1) ? sj[1] : sj[0];
            const float own1 = (kk8 & 1) ? sj[3] : sj[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const float pk = __shfl_sync(0xffffffffu, i ? own1 : own0, (lane & ~3) | (kk8 >> 1));
                // Padding rows past the last time step would reach keys past T: none exist.
                if (key > row_t[i] || key >= T) continue;
                // This thread's columns 2 tig + 8 d + e at constant offsets from one pointer, and
                // volatile, one value at a time: per-column addresses or loads batched ahead would
                // hold as many registers as O at head_dim 256 (this path runs only on tiles with
                // Inf or NaN).
                const volatile Half16* vr = v + int64_t(key) * v_stride_t + 2 * tig;
                const int cols = D - 2 * tig;
#pragma unroll
                for (int d = 0; d < kDTiles; ++d)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float x = d * 8 + e < cols ? to_float(vr[d * 8 + e], bf16) : 0.f;
                        if (!isfinite(x)) o[d][2 * i + e] = fmaf(pk, x, o[d][2 * i + e]);
                    }
            }
        }
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

}  // namespace
#endif  // GQA_COMMON_TILE_IO_CUH
