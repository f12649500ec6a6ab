// The warp-specialised 16-bit forward (sm_90a): one producer warpgroup and two consumer
// warpgroups (three at width 64) per CTA, 64 packed rows each. The producer's first warp loads K
// and V tiles with TMA into a ring of shared-memory stages, K and V each with an mbarrier saying
// "landed" and another saying "free", in the order the consumers use them (K of tile n + 1 before
// V of tile n); its other three warps scan each landed V tile for Inf and NaN (zeroing them, as
// the tiled wgmma variant does) and then say "ready". Each consumer warpgroup owns 64 of the CTA's
// rows and runs the tiled wgmma variant's software pipeline over the shared stages: S of tile
// n + 1 and its softmax while P V of tile n is in flight. A K tile is free once its S product is
// done, a V tile once its P V product is.
#ifndef GQA_WS_KERNEL_CUH
#define GQA_WS_KERNEL_CUH

#include "common/tile_io.cuh"
#include "common/tma.cuh"
#include "ws/rules.cuh"

namespace {

// A barrier among the consumer warpgroups only (id 1; id 0 is __syncthreads).
template <int kConsumers> __device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;\n" ::"n"(128 * kConsumers) : "memory");
}
// Turns between the consumer warpgroups, in a ring: barrier 2 + w is warpgroup w's turn to issue
// its products. It waits there (128 threads) for the previous warpgroup's arrival (128 more),
// issues, then arrives at the next one's barrier: one warpgroup's softmax runs under the others'
// products.
__device__ __forceinline__ void turn_wait(int wg) { asm volatile("bar.sync %0, 256;\n" ::"r"(2 + wg) : "memory"); }
template <int kConsumers> __device__ __forceinline__ void turn_pass(int wg) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(2 + (wg + 1) % kConsumers) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Configuration. A stage holds a K and a V tile in 64-column blocks of [keys][128 bytes], the
// layout TMA's 128-byte swizzle writes and the wgmma descriptors read (sw128_offset).
template <int DP, int kC = ws_consumers(DP)> struct WsTraits {
    // Consumer warpgroups, 64 packed rows each: ws_consumers (ws/rules.cuh), or two where
    // ws_consumers_for picks them.
    static constexpr int kConsumers = kC;
    static_assert(kC == 2 || kC == ws_consumers(DP), "two consumers, or the width's own count");
    static constexpr int kBlockM = 64 * kConsumers;     // packed rows per CTA
    // setmaxnreg: the producer's registers and the consumers' (a multiple of 8; in all <= 64K).
    static constexpr int kProducerRegs = kConsumers == 2 ? 40 : 24;
    static constexpr int kConsumerRegs = kConsumers == 2 ? 232 : 160;
    // Keys per tile: 128 (S as one m64n128 product per k-step, so K is read from shared memory
    // half as often per score) where registers allow; at width 256, O's 128 take that room.
    static constexpr int kKeys = DP == 256 ? 64 : 128;
    static constexpr int kThreads = 128 * (1 + kConsumers);   // the producer warpgroup, then the consumers
    // Stages of the ring (K and V tiles each). At width 128, 3 stages (225 KB in all) measured
    // 1.35x of 2 when a stage's K and V were freed together; at 256, 2 fill the shared memory.
    static constexpr int kStages = DP == 64 ? 4 : DP == 128 ? 3 : 2;
    // The consumers take turns issuing products (the kernel's kTurns) while every CTA walks at most
    // kTurnsUpToRounds tiles: launch_ws picks one of the two compiled kernels. Without turns the
    // five benchmark shapes (about 8 rounds or more) measured 1.01-1.07x, and shapes of one round
    // 0.95x; the same choice made at run time inside one kernel cost 4-6% (NOTES v53, v54).
    static constexpr int kTurnsUpToRounds = 1;
    // n-tiles of each S row (of TK / 8) whose exponentials run on the FMA pipe (fma_exp2), the
    // rest on MUFU: at width 64 a tile's exponentials take the MUFU pipe as long as its products.
    static constexpr int kFmaExpTiles = 0;
    // The producer's waits for a free stage, and the V scan's for a landed V tile, may sleep this
    // long a try (mbar_wait_idle; 0: spin). In the ncu profile of (1, 8192, 32, 8, 128) each kind
    // spun about 10 million tries.
    static constexpr uint32_t kProducerSleepNs = 0, kScanSleepNs = 0;
    // A row's max moves only when a tile's exceeds it by more than this (log2 units; 0: always):
    // then O's rescale, 4 DP / 8 multiplies a thread, runs only on the tiles that move one of the
    // warp's rows (softmax_row's kSlack; P stays below 2^kRescaleSlack).
    static constexpr int kRescaleSlack = 0;
    // The epilogue's stores 16 bytes a thread (a quad's 8-column pieces of a row, gathered by a
    // transpose within the quad) instead of 4: a quarter of the store instructions, each writing
    // 64 contiguous bytes of a row where one wrote 16. At (4, 1024, 32, 8, 128) the 4-byte stores
    // filled the store queue for 17.5% of the consumers' time (NOTES v83).
    static constexpr bool kWideStores = true;
    // The softmax's row max and row sum as pairwise trees (softmax_row's kTree): at width 64 the
    // max and sum chains' FMNMX and FADD held 12% of the kernel's samples, half of them waiting on
    // the previous link (NOTES v84).
    static constexpr bool kTreeSums = true;
    // The exact step for V tiles with Inf or NaN with its n-tile loop rolled (add_nonfinite_pv's
    // kCompact): it sits inline in the step loop three times, and unrolled it made up most of
    // the kernel's 16,500 instructions; every step's issue jumped over it, and the instruction
    // fetch stalled after that jump (NOTES v85).
    static constexpr bool kCompactNonfinite = true;
    // S of tile n + 1 beside P V of tile n, up to width 128. At width 256 (O: 128 registers) the
    // overlap spills around the exact non-finite step and measured 2% slower (NOTES v46).
    static constexpr bool kOverlap = DP <= 128;
    // One CTA per SM walking tiles (false: a CTA per tile, the same kernel taking one tile each).
    static constexpr bool kPersistent = true;
    // The L2 share that one section's K and V may take (ws_tile, launch_ws; 0: one section of every
    // pair). 24 MB measured 1.07x at (16, 2048, 32, 8, 64) and 1.03x at (1, 32768, 32, 8, 128).
    static constexpr int64_t kL2SectionBytes = int64_t(24) << 20;
    static constexpr int kTileBytes = kKeys * DP * 2;   // one K or V tile
    static constexpr int kQBytes = kBlockM * DP * 2;
    static constexpr size_t kSmemBytes = 1024 + size_t(kQBytes) + size_t(2) * kStages * kTileBytes;
    static_assert(DP == 64 || DP == 128 || DP == 256, "head_dim widths 64, 128 and 256");
    static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536, "the register file holds every warpgroup");
    static_assert(kSmemBytes + 128 <= 227 * 1024, "the ring, Q and the barriers fit one CTA's shared memory");
};

// The tensor maps. K and V: dims (D, Hkv, T, B), boxes of 64 columns x 1 head x a tile's keys x 1
// batch. Q: dims (D, Hq, T, B), boxes of 64 columns x G heads x BM / G steps x 1 batch, which are
// a CTA tile's packed rows in order (only when G divides BM: q_tma). Past T and past D: zeros.
struct WsMaps {
    CUtensorMap k, v, q;
};

// A CTA tile: BM packed rows of one (batch, kv head). The (batch, kv head) pairs go in sections of
// `section` pairs (the last one may hold fewer), one section after another; within a section the
// tiles are numbered longest rows first (the last row tile of every pair of the section, then the
// one before, ...). A section's K and V fit in L2 beside the rest of the traffic (WsTraits::
// kL2SectionBytes), so the CTAs that run at once read K/V tiles that other CTAs have just brought in;
// launch_ws says when there is more than one section.
struct WsTile {
    int b, kvh, r0, t_lo, n_kv;   // batch, kv head, first packed row, its time step, K/V tiles
};
template <int BM, int TK>
__device__ __forceinline__ WsTile ws_tile(int tile, int section, const GqaParams& p, const TileDivs& dv) {
    const int bh_count = p.B * p.Hkv, n_qtiles = (p.T * p.group + BM - 1) / BM;
    const int sec = tile / (section * n_qtiles), first = sec * section;   // the section, its first pair
    const int pairs = min(section, bh_count - first), local = tile - first * n_qtiles;
    const int bh_tile = local / pairs, bh = first + (local - bh_tile * pairs);
    WsTile w;
    w.b = dv.hkv.div(bh);
    w.kvh = bh - w.b * p.Hkv;
    w.r0 = (n_qtiles - 1 - bh_tile) * BM;
    w.t_lo = dv.group.div(w.r0);
    w.n_kv = min(dv.group.div(w.r0 + BM - 1), p.T - 1) / TK + 1;
    return w;
}

// The CTA's k-th tile, or -1 past the last: round k holds tiles [k G, k G + G) (G = gridDim.x,
// tiles numbered longest first within a section), and CTA c takes the c-th of an even round and the (G - 1 - c)-th
// of an odd one, so the CTA that had a round's longest tile has the next round's shortest (a walk
// of c, c + G, ... left the first CTAs up to 11% more work; bench/NOTES.md v42). With a CTA per
// tile (G = tiles) it is tile c, then nothing.
__device__ __forceinline__ int ws_walk(int k, int tiles) {
    const int G = int(gridDim.x), c = int(blockIdx.x);
    const int64_t tile = int64_t(k) * G + ((k & 1) ? G - 1 - c : c);
    return tile < tiles ? int(tile) : -1;
}

// Persistent: CTA c takes the tiles of ws_walk, and every role walks the same sequence. The K/V
// ring runs on across tiles (step `it` counts the CTA's K/V tiles), and with
// q_tma the producer loads the next tile's Q as soon as every consumer has issued its last S
// product of this one, so the next tile's first products wait for nothing while this one's last
// P V, softmax and stores finish. Without q_tma the consumers copy Q themselves at each tile.
template <int kDtype, int DP, bool kTurns, int kConsumers>
__global__ void __launch_bounds__(WsTraits<DP, kConsumers>::kThreads, 1)
gqa_ws_kernel(const __grid_constant__ WsMaps maps, const GqaParams p, const TileDivs dv, int tiles, int section,
              int q_tma) {
    using Tr = WsTraits<DP, kConsumers>;
    using Elem = Half16;
    constexpr bool bf16 = kDtype == kGqaBFloat16;
    constexpr int BM = Tr::kBlockM, TK = Tr::kKeys, S = Tr::kStages, kC = Tr::kConsumers;
    constexpr int kNTiles = TK / 8;   // n-tiles of S per warp row
    constexpr int kDTiles = DP / 8;   // n-tiles of O

    extern __shared__ float4 smem_raw[];
    // 1024-aligned by an offset from the shared array itself, so that the tiles stay shared-memory
    // pointers to the compiler (the V scan's loads were generic ones).
    const uint32_t misaligned = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023u;
    unsigned char* base = reinterpret_cast<unsigned char*>(smem_raw) + ((1024u - misaligned) & 1023u);
    Elem* sQ = reinterpret_cast<Elem*>(base);                                   // [DP / 64][BM][64], swizzled
    auto sK = [&](int st) { return reinterpret_cast<Elem*>(base + Tr::kQBytes + st * 2 * Tr::kTileBytes); };
    auto sV = [&](int st) { return sK(st) + TK * DP; };
    __shared__ uint64_t full_k[S], full_v[S], ready[S];   // K landed, V landed, V scanned
    __shared__ uint64_t free_k[S], free_v[S];             // every consumer done with the K / V tile
    __shared__ uint64_t full_q, free_q;                   // Q landed; every consumer's last S issued
    __shared__ int bad_tile[S];                           // it + 1 when step it in the stage had Inf/NaN in V

    const int G = p.group, T = p.T, rows_total = T * G;
    if (threadIdx.x == 0) {
        for (int st = 0; st < S; ++st) {
            mbar_init(&full_k[st], 1);
            mbar_init(&full_v[st], 1);
            mbar_init(&ready[st], 96);
            mbar_init(&free_k[st], 128 * kC);
            mbar_init(&free_v[st], 128 * kC);
            bad_tile[st] = 0;
        }
        mbar_init(&full_q, 1);
        mbar_init(&free_q, 128 * kC);
        mbar_init_fence();
    }
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < 4) {
        // ----------------------------------------------------------------------------- producer
        regs_dec<Tr::kProducerRegs>();
        if (warp == 0) {
            if (lane == 0) {
                // Step `step` of K or V (key tile n of tile w) into stage step % S, once the step
                // S before it there is free.
                auto load = [&](const CUtensorMap* map, uint64_t* full, uint64_t* free_, bool v, int step, int n, const WsTile& w) {
                    const int st = step % S;
                    if (step >= S) mbar_wait_idle<Tr::kProducerSleepNs>(&free_[st], uint32_t((step / S - 1) & 1));
                    mbar_arrive_expect(&full[st], uint32_t(Tr::kTileBytes));
                    Elem* dst = v ? sV(st) : sK(st);
#pragma unroll
                    for (int blk = 0; blk < DP / 64; ++blk)
                        tma_load_4d(dst + blk * TK * 64, map, &full[st], blk * 64, w.kvh, n * TK, w.b);
                };
                int it = 0, tc = 0;
                for (int tile = ws_walk(0, tiles); tile >= 0; tile = ws_walk(++tc, tiles)) {
                    const WsTile w = ws_tile<BM, TK>(tile, section, p, dv);
                    load(&maps.k, full_k, free_k, false, it, 0, w);
                    if (q_tma) {
                        if (tc > 0) mbar_wait_idle<Tr::kProducerSleepNs>(&free_q, uint32_t((tc - 1) & 1));
                        mbar_arrive_expect(&full_q, uint32_t(Tr::kQBytes));
#pragma unroll
                        for (int blk = 0; blk < DP / 64; ++blk)
                            tma_load_4d(sQ + blk * BM * 64, &maps.q, &full_q, blk * 64, w.kvh * G, w.t_lo, w.b);
                    }
                    for (int n = 0; n < w.n_kv; ++n) {
                        if (n + 1 < w.n_kv) load(&maps.k, full_k, free_k, false, it + n + 1, n + 1, w);
                        load(&maps.v, full_v, free_v, true, it + n, n, w);
                    }
                    it += w.n_kv;
                }
            }
            return;
        }
        // Warps 1-3: Inf and NaN in V of a tile that some row of the CTA tile masks become zeros
        // in shared memory (the consumers add them exactly from global memory instead); elsewhere
        // the products already give the reference's values.
        const int tid = threadIdx.x - 32;
        const uint32_t field = bf16 ? 0x7f807f80u : 0x7c007c00u;
        const uint32_t unit = bf16 ? 0x00800080u : 0x04000400u;
        auto carries = [&](uint32_t x) { return ((x & field) + unit) & 0x80008000u; };
        int it = 0, tc = 0;
        for (int tile = ws_walk(0, tiles); tile >= 0; tile = ws_walk(++tc, tiles)) {
            const WsTile w = ws_tile<BM, TK>(tile, section, p, dv);
            for (int n = 0; n < w.n_kv; ++n, ++it) {
                const int st = it % S;
                mbar_wait_idle<Tr::kScanSleepNs>(&full_v[st], uint32_t((it / S) & 1));
                if (n * TK + TK - 1 > w.t_lo) {
                    uint4* chunks = reinterpret_cast<uint4*>(sV(st));
                    bool hit = false;
                    for (int i = tid; i < TK * DP / 8; i += 96) {
                        uint4 x = chunks[i];
                        const uint32_t c0 = carries(x.x), c1 = carries(x.y), c2 = carries(x.z), c3 = carries(x.w);
                        if ((c0 | c1 | c2 | c3) == 0) continue;
                        auto keep = [](uint32_t c) {
                            return (c & 0x8000u ? 0xffff0000u : 0xffffffffu) & (c & 0x80000000u ? 0x0000ffffu : 0xffffffffu);
                        };
                        x.x &= keep(c0), x.y &= keep(c1), x.z &= keep(c2), x.w &= keep(c3);
                        chunks[i] = x;
                        hit = true;
                    }
                    if (hit) atomicMax(&bad_tile[st], it + 1);   // larger than any earlier step's mark
                    fence_async_proxy();                           // the zeros, before the consumers' wgmma reads
                }
                mbar_arrive(&ready[st]);
            }
        }
        return;
    }

    // --------------------------------------------------------------------------------- consumers
    regs_inc<Tr::kConsumerRegs>();
    const int ct = threadIdx.x - 128;            // 0 .. 128 kC - 1
    // Consumer warpgroup (rows wg * 64 .. + 63), read back from lane 0 so that the compiler sees it
    // uniform in the warp: the Q descriptors built from it stay in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, ct / 128, 0);
    const int cw = (ct % 128) / 32;              // warp within the warpgroup
    const int gid = lane >> 2, tig = lane & 3;
    const float scale_log2 = p.scale_log2;
    // Turns: warpgroup 0 goes first (the last one's opening pass lets it); each issue of products
    // is one turn, the same number of turns in each warpgroup, and the last warpgroup gives up its
    // very last pass (nobody waits for it), so every barrier ends balanced.
    constexpr bool kPP = kTurns;
    const bool last_wg = wg == kC - 1;
    auto hand_on = [&]() { turn_pass<kC>(wg); };
    if (kPP && last_wg) hand_on();
    int it = 0, tc = 0;   // the CTA's K/V step at this tile's first K/V tile; tiles done
    for (int tile = ws_walk(0, tiles); tile >= 0; tile = ws_walk(++tc, tiles)) {
        const WsTile w = ws_tile<BM, TK>(tile, section, p, dv);
        const int n_kv = w.n_kv;
        const bool more = ws_walk(tc + 1, tiles) >= 0;
        const HeadRows<Elem> head(p, w.b, w.kvh);
        if (q_tma) {
            mbar_wait(&full_q, uint32_t(tc & 1));
        } else {   // Q: the tile's rows, zeros past the last row and past D
            consumers_sync<kC>();   // every S product of the last tile, which read sQ, has completed
            constexpr int kChunks = DP / 8;
            for (int i = ct; i < BM * kChunks; i += 128 * kC) {
                const int r = i / kChunks, c = (i % kChunks) * 8;
                const Elem* src = head.q_row(p, dv.group, w.r0 + r, rows_total);
                const bool ok = src != nullptr && c < p.D;
                cp_async16(reinterpret_cast<unsigned char*>(sQ) + sw128_offset(r, c, BM), ok ? src + c : head.q, ok ? 16 : 0);
            }
            cp_async_commit();
            cp_async_wait<0>();
            fence_async_proxy();
            consumers_sync<kC>();
        }

        const int row0 = w.r0 + wg * 64 + cw * 16;   // the warp's first packed row
        int row_t[2];                                // time steps of this thread's rows gid and gid + 8
        row_t[0] = dv.group.div(row0 + gid);
        row_t[1] = dv.group.div(row0 + gid + 8);
        const int warp_t_lo = dv.group.div(row0);
        float o[kDTiles][4];
#pragma unroll
        for (int d = 0; d < kDTiles; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
        float s[kNTiles][4];   // S, then P, of the K/V tile in hand
        float f[2];            // O's rescale factors from the last softmax

        auto mask_softmax = [&](int key0) {
            if (key0 + TK - 1 > warp_t_lo) {
#pragma unroll
                for (int j = 0; j < kNTiles; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (key0 + j * 8 + 2 * tig + (e & 1) > row_t[e >> 1]) s[j][e] = -INFINITY;
            }
#pragma unroll
            for (int r = 0; r < 2; ++r)
                f[r] = softmax_row<kNTiles, false, Tr::kFmaExpTiles, Tr::kRescaleSlack, Tr::kTreeSums>(
                    s, 2 * r, m[r], l[r], scale_log2);
        };
        auto scalar_pv_nonfinite = [&](int key0) {
            add_nonfinite_pv<kNTiles, kDTiles, Tr::kCompactNonfinite>(o, s, row_t, key0, head.v, p.v_stride_t, T, p.D, bf16);
        };
        auto issue_qk = [&](int n) { qk_wgmma<bf16, DP, BM, TK>(s, sQ, wg * 64, sK((it + n) % S)); };
        auto rescale_o = [&]() {
            // (kRescaleSlack: skipped by the whole warp when no row of it moved its max)
            if (Tr::kRescaleSlack > 0 && !__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f)) return;
#pragma unroll
            for (int d = 0; d < kDTiles; ++d) {
                o[d][0] *= f[0], o[d][1] *= f[0];
                o[d][2] *= f[1], o[d][3] *= f[1];
            }
        };
        // Key tile n's K and V: landed (K) or landed and scanned (V), and the stage's Inf/NaN mark.
        auto wait_k = [&](int n) { mbar_wait(&full_k[(it + n) % S], uint32_t(((it + n) / S) & 1)); };
        auto wait_v = [&](int n) {
            mbar_wait(&ready[(it + n) % S], uint32_t(((it + n) / S) & 1));
            return bad_tile[(it + n) % S] == it + n + 1;
        };
        // Key tile n's S product has completed: its K is free, and after the tile's last, Q too.
        auto s_done = [&](int n) {
            mbar_arrive(&free_k[(it + n) % S]);
            if (q_tma && n + 1 == n_kv) mbar_arrive(&free_q);
        };
        if constexpr (Tr::kOverlap) {
            // The pipeline of the tiled wgmma variant, with the stages' barriers in place of its
            // copies: n_kv + 1 turns.
            wait_k(0);
            if (kPP) turn_wait(wg);
            issue_qk(0);
            wg_commit();
            if (kPP) hand_on();
            wg_wait<0>();
            fence_regs(reinterpret_cast<float(&)[kNTiles * 4]>(s));
            s_done(0);
            mask_softmax(0);   // O is still zero: f needs no applying
            for (int n = 0; n + 1 < n_kv; ++n) {
                wait_k(n + 1);
                if (wait_v(n)) scalar_pv_nonfinite(n * TK);
                uint32_t pa[kNTiles / 2][4];   // P of tile n; read by the wgmma until it completes
                pack_p<bf16>(pa, s);
                if (kPP) turn_wait(wg);
                issue_qk(n + 1);
                wg_commit();
                pv_wgmma<bf16, DP, TK>(o, pa, sV((it + n) % S));
                wg_commit();
                if (kPP) hand_on();
                wg_wait<1>();
                fence_regs(reinterpret_cast<float(&)[kNTiles * 4]>(s));
                s_done(n + 1);
                mask_softmax((n + 1) * TK);
                wg_wait<0>();
                fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(o));
                mbar_arrive(&free_v[(it + n) % S]);
                rescale_o();
            }
            if (wait_v(n_kv - 1)) scalar_pv_nonfinite((n_kv - 1) * TK);
            {
                uint32_t pa[kNTiles / 2][4];
                pack_p<bf16>(pa, s);
                if (kPP) turn_wait(wg);
                pv_wgmma<bf16, DP, TK>(o, pa, sV((it + n_kv - 1) % S));
                wg_commit();
                if (kPP && (!last_wg || more)) hand_on();
                wg_wait<0>();
                fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(o));
                mbar_arrive(&free_v[(it + n_kv - 1) % S]);
            }
        } else {
            // One tile at a time (S, softmax, P V; 2 n_kv turns).
            for (int n = 0; n < n_kv; ++n) {
                wait_k(n);
                if (kPP) turn_wait(wg);
                issue_qk(n);
                wg_commit();
                if (kPP) hand_on();
                wg_wait<0>();
                fence_regs(reinterpret_cast<float(&)[kNTiles * 4]>(s));
                s_done(n);
                mask_softmax(n * TK);
                rescale_o();
                if (wait_v(n)) scalar_pv_nonfinite(n * TK);
                uint32_t pa[kNTiles / 2][4];
                pack_p<bf16>(pa, s);
                if (kPP) turn_wait(wg);
                pv_wgmma<bf16, DP, TK>(o, pa, sV((it + n) % S));
                wg_commit();
                if (kPP && (!last_wg || n + 1 < n_kv || more)) hand_on();
                wg_wait<0>();
                fence_regs(reinterpret_cast<float(&)[kDTiles * 4]>(o));
                mbar_arrive(&free_v[(it + n) % S]);
            }
        }

        // Epilogue: l across the quad that shares a row, then normalise and store column pairs.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        }
        Elem* o_base = static_cast<Elem*>(p.o) + w.b * p.o_stride_b + int64_t(w.kvh) * G * p.o_stride_h;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int R = row0 + gid + 8 * r;
            const bool row_ok = R < rows_total;   // the same in the four lanes of a quad
            // l >= 1, or 0 / NaN when every score is -inf / NaN (an Inf or NaN result either way, as
            // with IEEE division): the fast reciprocal is exact enough for a 16-bit output.
            const float inv = __fdividef(1.f, l[r]);
            if (row_ok && p.lse2 != nullptr && tig == 0)   // kept for a backward: m is in log2 units, l relative to it
                p.lse2[(int64_t(w.b) * T + row_t[r]) * p.Hq + int64_t(w.kvh) * G + (R - row_t[r] * G)] = m[r] + log2f(l[r]);
            const int64_t row_off = int64_t(row_t[r]) * p.o_stride_t + int64_t(R - row_t[r] * G) * p.o_stride_h;
            if constexpr (Tr::kWideStores) {
                // Every lane takes part in the transposes, so rows past the end only skip the
                // stores. D is a multiple of 8 here (16-byte rows), so a piece is all in or all out.
                uint4* dst = reinterpret_cast<uint4*>(o_base + (row_ok ? row_off : 0)) + tig;
#pragma unroll
                for (int g = 0; g < kDTiles / 4; ++g) {
                    uint32_t x[4];
#pragma unroll
                    for (int j = 0; j < 4; ++j) x[j] = pair_bits(o[4 * g + j][2 * r] * inv, o[4 * g + j][2 * r + 1] * inv, bf16);
                    quad_transpose(x, tig);
                    if (row_ok && (4 * g + tig) * 8 < p.D) dst[4 * g] = make_uint4(x[0], x[1], x[2], x[3]);
                }
            } else if (row_ok) {
                Elem* dst = o_base + row_off;
#pragma unroll
                for (int d = 0; d < kDTiles; ++d) {
                    const int c = d * 8 + 2 * tig;
                    if (c < p.D) store_pair(dst + c, o[d][2 * r] * inv, o[d][2 * r + 1] * inv, bf16);
                }
            }
        }
        it += n_kv;
    }
}

// A 4-D tensor map over q, k or v (dims D, heads, T, B; element strides of the last three), boxes
// of 64 x box_heads x box_steps x 1 in the 128-byte swizzle.
inline cudaError_t ws_tensor_map(CUtensorMap* map, const void* data, const GqaParams& p, int heads, int64_t stride_h,
                                 int64_t stride_t, int64_t stride_b, int box_heads, int box_steps, bool bf16) {
    return tensor_map_16bit(map, data, bf16, {cuuint64_t(p.D), cuuint64_t(heads), cuuint64_t(p.T), cuuint64_t(p.B)},
                            {cuuint64_t(stride_h) * 2, cuuint64_t(stride_t) * 2, cuuint64_t(stride_b) * 2},
                            {64, cuuint32_t(box_heads), cuuint32_t(box_steps), 1});
}

// Launches the warp-specialised kernel with kC consumers over every tile of kBlockM packed rows
// (16-byte-aligned rows only), one CTA per SM at most. Returns cudaErrorNotSupported, launching
// nothing, for K and V layouts no tensor map describes; Q goes through a tensor map when one
// describes its tiles.
template <int kDtype, int DP, int kC>
cudaError_t launch_ws_with(const GqaParams& p, cudaStream_t stream, int dev) {
    using Tr = WsTraits<DP, kC>;
    static bool raised[2][kMaxDevices] = {};
    cudaError_t err = raise_smem_limit(gqa_ws_kernel<kDtype, DP, true, kC>, Tr::kSmemBytes, dev, raised[1]);
    if (err == cudaSuccess) err = raise_smem_limit(gqa_ws_kernel<kDtype, DP, false, kC>, Tr::kSmemBytes, dev, raised[0]);
    if (err != cudaSuccess) return err;
    const bool bf16 = kDtype == kGqaBFloat16;
    WsMaps maps;
    err = ws_tensor_map(&maps.k, p.k, p, p.Hkv, p.k_stride_h, p.k_stride_t, p.k_stride_b, 1, Tr::kKeys, bf16);
    if (err == cudaSuccess) err = ws_tensor_map(&maps.v, p.v, p, p.Hkv, p.v_stride_h, p.v_stride_t, p.v_stride_b, 1, Tr::kKeys, bf16);
    if (err != cudaSuccess) return err;
    // A tile's packed rows are whole time steps (G heads each) when G divides kBlockM.
    const bool q_tma = Tr::kBlockM % p.group == 0 &&
                       ws_tensor_map(&maps.q, p.q, p, p.Hq, p.q_stride_h, p.q_stride_t, p.q_stride_b, p.group,
                                     Tr::kBlockM / p.group, bf16) == cudaSuccess;
    TileDivs dv;
    const int64_t tiles = packed_tile_grid(p, Tr::kBlockM, dv);
    if (tiles < 0) return cudaErrorInvalidConfiguration;
    const int64_t ctas = Tr::kPersistent && tiles > sm_count(dev) ? sm_count(dev) : tiles;
    // Sections only where every pair's K and V together exceed twice a section's share: where they
    // fit, the order longest first over all pairs balances the CTAs better (the walk is static, and a
    // section's first, longest tiles after the last one's shortest undo the snake; NOTES v47).
    const int64_t pairs = int64_t(p.B) * p.Hkv, pair_bytes = int64_t(p.T) * p.D * 2 * 2;   // K and V, 16-bit
    const bool sections = Tr::kL2SectionBytes > 0 && pairs * pair_bytes > 2 * Tr::kL2SectionBytes;
    const int64_t section = sections ? std::min(pairs, std::max<int64_t>(1, Tr::kL2SectionBytes / pair_bytes)) : pairs;
    const bool turns = tiles <= int64_t(Tr::kTurnsUpToRounds) * ctas;
    auto kernel = turns ? gqa_ws_kernel<kDtype, DP, true, kC> : gqa_ws_kernel<kDtype, DP, false, kC>;
    kernel<<<unsigned(ctas), Tr::kThreads, Tr::kSmemBytes, stream>>>(maps, p, dv, int(tiles), int(section), q_tma ? 1 : 0);
    return cudaGetLastError();
}

// The plan's consumers (plan.warps: 4 a warpgroup, the producer's included; ws_consumers_for).
template <int kDtype, int DP>
cudaError_t launch_ws(const GqaParams& p, const GqaPlan& plan, cudaStream_t stream, int dev) {
    constexpr int kMost = ws_consumers(DP);
    if (kMost != 2 && plan.warps == 4 * (1 + kMost)) return launch_ws_with<kDtype, DP, kMost>(p, stream, dev);
    if (plan.warps != 4 * 3) return cudaErrorInvalidConfiguration;
    return launch_ws_with<kDtype, DP, 2>(p, stream, dev);
}

}  // namespace
#endif  // GQA_WS_KERNEL_CUH
