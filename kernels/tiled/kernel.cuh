// The tiled attention kernel: 3xTF32 or 16-bit mma.sync, and on sm_90a the wgmma variants
// (16-bit, and fp32 as three fp16 products). Used by the tiled, wgmma and x3 families.
#ifndef GQA_TILED_KERNEL_CUH
#define GQA_TILED_KERNEL_CUH

#include "tiled/traits.cuh"
#include "common/tile_io.cuh"
#include "common/wgmma.cuh"

namespace {

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

    const HeadRows<Elem> head(p, b, kvh);
    const Elem *q_base = head.q, *k_base = head.k, *v_base = head.v;
    auto q_row = [&](int r) { return head.q_row(p, dv.group, r0 + r, rows_total); };
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
            f[r] = softmax_row<kNTiles, kX3>(s[r >> 1], 2 * (r & 1), m[r], l[r], scale_log2, kX3PShift);
            if constexpr (!kWg) rescale_o(r, f[r]);   // no P V in flight here
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

    // wgmma: O += P V of tile key0.. for V's non-finite values (add_nonfinite_pv).
    auto scalar_pv_nonfinite = [&](const float (&s)[MT][kNTiles][4], int key0) {
        if constexpr (kWg && kHalf) add_nonfinite_pv(o[0], s[0], row_t, key0, v_base, p.v_stride_t, T, p.D, bf16);
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
        // x3, kept for a backward (whose x3 unit then needs no pass of its own over the keys): m in
        // log2 units, l relative to it and carrying P's 2^kX3PShift.
        if constexpr (kX3) {
            if (p.lse2 != nullptr && tig == 0)
                p.lse2[(int64_t(b) * T + row_t[r]) * p.Hq + int64_t(kvh) * G + (R - row_t[r] * G)] = m[r] + log2f(l[r]) - kX3PShift;
        }
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

// Launches one instantiation over the whole grid of kBlockM-row tiles.
template <int kDtype, int DP, int KW, bool kWg = false>
cudaError_t launch_tiles(const GqaParams& p, cudaStream_t stream, int dev) {
    using Tr = TileTraits<DP, KW, ElemOf<kDtype>, kWg>;
    auto kernel = gqa_fwd_kernel<kDtype, DP, KW, kWg>;
    static bool raised[kMaxDevices] = {};
    const cudaError_t err = raise_smem_limit(kernel, Tr::kSmemBytes, dev, raised);
    if (err != cudaSuccess) return err;
    TileDivs dv;
    const int64_t blocks = packed_tile_grid(p, Tr::kBlockM, dv);
    if (blocks < 0) return cudaErrorInvalidConfiguration;
    kernel<<<unsigned(blocks), Tr::kThreads, Tr::kSmemBytes, stream>>>(p, dv);
    return cudaGetLastError();
}

}  // namespace
#endif  // GQA_TILED_KERNEL_CUH
