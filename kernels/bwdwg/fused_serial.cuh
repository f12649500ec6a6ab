// gqa_bwd_fused_kernel: the fused backward's serial step (bwdwg/fused.cuh describes the kernel and
// FusedTraits its forms), which FusedTraits::kPipelined replaces; kept for measurement
// (bench/variants.py). Included by fused.cuh.

namespace {

template <class Pol>
__global__ void __launch_bounds__(FusedTraits<Pol::DP>::kThreads, 1)
    gqa_bwd_fused_kernel(const GqaBwdParams p, const __grid_constant__ typename Pol::Maps maps) {
    constexpr bool kBf16 = Pol::kBf16;
    constexpr int DP = Pol::DP;
    using Tr = FusedTraits<DP>;
    if (*p.nonfinite) return;   // the row-wise kernels take this call
    extern __shared__ __align__(16) unsigned char fused_smem[];
    // 1024-aligned by an offset from the shared array itself, so that every pointer below stays a
    // shared-memory pointer to the compiler (LDS and STS, not generic loads and stores).
    const uint32_t misaligned = static_cast<uint32_t>(__cvta_generic_to_shared(fused_smem)) & 1023u;
    uint16_t* sK = reinterpret_cast<uint16_t*>(fused_smem + ((1024u - misaligned) & 1023u));
    uint16_t* sV = sK + Tr::kKvHalves;
    auto sQ = [&](int st) { return sV + Tr::kKvHalves + st * 2 * Tr::kRowHalves; };
    auto sdO = [&](int st) { return sQ(st) + Tr::kRowHalves; };
    uint16_t* sdS = sQ(2);   // dS^T: [128 keys][64 query rows], swizzled
    auto lse2_s = [&](int st) { return reinterpret_cast<float*>(sdS + Tr::kDsHalves) + st * 2 * Tr::kRows; };
    auto delta_s = [&](int st) { return lse2_s(st) + Tr::kRows; };
    float* held = delta_s(1) + Tr::kRows;   // kWriter: [kAdders][2][4096]

    // Key tile kt of (b, kv head), key tiles ascending with blockIdx.
    const int64_t bh_count = int64_t(p.B) * p.Hkv;
    const int kt = int(blockIdx.x / bh_count), bh = int(blockIdx.x % bh_count);
    const int64_t b = bh / p.Hkv;
    const int kvh = bh % p.Hkv, k0 = kt * Tr::kKeys, G = p.group, T = p.T;
    const int n_q = (T + Tr::kRows - 1) / Tr::kRows;
    const int steps = (n_q - 2 * kt) * G;   // query tiles 2 kt .. n_q - 1 see a key of this CTA
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4, cw = warp % 4;
    // Pol::kTma: a step's Q, dO, lse2 and delta by TMA from thread 0, landing on its stage's barrier.
    __shared__ uint64_t landed_bar[2];
    if constexpr (Pol::kTma) {
        if (threadIdx.x == 0) Pol::init_landed(landed_bar);
        __syncthreads();
    }
    if constexpr (Tr::kWriter) {
        if (wg == 2) {   // the writer warpgroup: its first warp adds the shares, the others leave
            regs_dec<Tr::kWriterRegs>();
            if (warp != 8) return;
            for (int i = 0; i < steps; ++i) {
                const int qi = n_q - 1 - i / G, h = kvh * G + i % G, j = i & 1;
                int* order = p.dq_order + (b * p.Hq + h) * n_q + qi;
                float* block = p.dq_accum + ((b * p.Hq + h) * n_q + qi) * int64_t(64 * DP);
                if (lane == 0) {
                    while (load_acquire(order) < Tr::kAdders * kt) {
                    }
                    fence_async_global();
                }
                __syncwarp();
                for (int c = 0; c < Tr::kAdders; ++c) {
                    named_sync(dq_full_id(c, j), kHandOver);
                    if (lane == 0) {
                        bulk_reduce_add(block + c * Tr::kPieceFloats, held + (2 * c + j) * Tr::kPieceFloats, Tr::kPieceFloats * 4);
                        bulk_commit();
                    }
                }
                if (lane == 0) {
                    bulk_wait<0>();
                    fence_async_global();
                    add_release(order, Tr::kAdders);
                }
                __syncwarp();
                if (i + 2 < steps)   // (the warpgroups wait on buffer j again at step i + 2)
                    for (int c = 0; c < Tr::kAdders; ++c) named_arrive(dq_empty_id(c, j), kHandOver);
            }
            return;
        }
        regs_inc<Tr::kMmaRegs>();
    }
    // The two warpgroups' barrier: __syncthreads, or with a writer warpgroup named barrier 1.
    auto mma_sync = [&]() {
        if constexpr (Tr::kWriter) {
            named_sync(1, Tr::kMmaThreads);
        } else {
            __syncthreads();
        }
    };
    const int kw0 = k0 + 64 * wg;           // this warpgroup's first key
    const int cb = DP == 128 ? wg : 0;      // the 64 columns of dQ this warpgroup computes and adds
    const bool bf16 = kBf16;

    swizzled_load<DP, 128, 256>(sK, static_cast<const uint16_t*>(p.k), b, k0, kvh, p.Hkv, T);
    swizzled_load<DP, 128, 256>(sV, static_cast<const uint16_t*>(p.v), b, k0, kvh, p.Hkv, T);
    cp_async_commit();
    // Step i: query tile n_q - 1 - i / G of head kvh * G + i % G, into stage i % 2.
    auto step_tile = [&](int i) { return n_q - 1 - i / G; };
    auto step_head = [&](int i) { return kvh * G + i % G; };
    auto load_step = [&](int i, int st) {
        const int q0 = step_tile(i) * Tr::kRows, h = step_head(i);
        if constexpr (Pol::kTma) {
            const int64_t stat = bwd_stat_row(b, h, q0, p);
            if (threadIdx.x == 0)
                Pol::load_step(maps, sQ(st), sdO(st), lse2_s(st), delta_s(st), p.lse2 + stat, p.delta + stat, &landed_bar[st],
                               b, q0, h);
            return;
        }
        swizzled_load<DP, 64, 256>(sQ(st), static_cast<const uint16_t*>(p.q), b, q0, h, p.Hq, T);
        swizzled_load<DP, 64, 256>(sdO(st), static_cast<const uint16_t*>(p.dout), b, q0, h, p.Hq, T);
        if (threadIdx.x < Tr::kRows / 4) {   // 64 values each, zeros past T
            const int64_t stat = bwd_stat_row(b, h, q0, p) + 4 * threadIdx.x;
            cp_async16(lse2_s(st) + 4 * threadIdx.x, p.lse2 + stat, 16);
            cp_async16(delta_s(st) + 4 * threadIdx.x, p.delta + stat, 16);
        }
    };
    // This warpgroup's piece of the sum for step `step`: 64 query rows x its 64 columns.
    const int wt = threadIdx.x % 128;
    auto order_of = [&](int step) { return p.dq_order + (b * p.Hq + step_head(step)) * n_q + step_tile(step); };
    auto piece_of = [&](int step) {
        return p.dq_accum + ((b * p.Hq + step_head(step)) * n_q + step_tile(step)) * int64_t(64 * DP) + Tr::kPieceFloats * cb;
    };
    // kTurn: adds step `step`'s share (the thread's dq, float4 n at 128 n + wt) to the sum once
    // the key tiles before this one have (L2 reads and writes, so no stale L1 line of another CTA's
    // sum is read). Every read first, then every write: one L2 round trip, not one a cell. The last
    // barrier orders every thread's writes before thread 0's release (cumulative at gpu scope),
    // which the next key tile's acquire reads.
    auto add_dq = [&](int step, const float (&dq)[8][4]) {
        int* order = order_of(step);
        if (threadIdx.x == 0)
            while (load_acquire(order) < Tr::kAdders * kt) {
            }
        __syncthreads();
        if (cb == wg) {
            float4* piece = reinterpret_cast<float4*>(piece_of(step)) + wt;
            float4 sum[8];
#pragma unroll
            for (int n = 0; n < 8; ++n) sum[n] = __ldcg(piece + 128 * n);
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                __stcg(piece + 128 * n,
                       make_float4(sum[n].x + dq[n][0], sum[n].y + dq[n][1], sum[n].z + dq[n][2], sum[n].w + dq[n][3]));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) add_release(order, Tr::kAdders);
    };
    // kRed: this warpgroup's share added in place, in no fixed order.
    auto red_dq = [&](int step, const float (&dq)[8][4]) {
        float4* piece = reinterpret_cast<float4*>(piece_of(step)) + wt;
#pragma unroll
        for (int n = 0; n < 8; ++n) atomicAdd(piece + 128 * n, make_float4(dq[n][0], dq[n][1], dq[n][2], dq[n][3]));
    };
    // kWriter: the share into buffer step % 2 of this warpgroup, once the writer has freed it.
    auto hand_dq = [&](int step, const float (&dq)[8][4]) {
        const int j = step & 1;
        float* buffer = held + (cb * 2 + j) * Tr::kPieceFloats;
        if (step >= 2) named_sync(dq_empty_id(cb, j), kHandOver);
#pragma unroll
        for (int n = 0; n < 8; ++n)
            reinterpret_cast<float4*>(buffer)[128 * n + wt] = make_float4(dq[n][0], dq[n][1], dq[n][2], dq[n][3]);
        fence_async_proxy();
        named_arrive(dq_full_id(cb, j), kHandOver);
    };

    load_step(0, 0);
    cp_async_commit();

    float dk[DP / 8][4] = {}, dv[DP / 8][4] = {};
    for (int i = 0; i < steps; ++i) {
        const int st = i & 1, qi = step_tile(i), h = step_head(i), q0 = qi * Tr::kRows;
        if (!Pol::kTma) {
            if (i + 1 < steps) load_step(i + 1, st ^ 1);
            cp_async_commit();    // (empty on the last step)
        }
        cp_async_wait<Pol::kTma ? 0 : 1>();   // everything but the step just issued has landed (kTma: K and V)
        fence_async_proxy();
        mma_sync();
        if constexpr (Pol::kTma) Pol::await_step(&landed_bar[st], uint32_t((i >> 1) & 1));
        const float* lse2_t = lse2_s(st);
        const float* delta_t = delta_s(st);
        float s[8][4], dp[8][4];
        qk_wgmma<kBf16, DP, 128, 64>(s, sK, 64 * wg, sQ(st));    // S^T of this warpgroup's keys
        wg_commit();
        qk_wgmma<kBf16, DP, 128, 64>(dp, sV, 64 * wg, sdO(st));  // dP^T
        wg_commit();
        // kTma: step i + 1 goes out under the products (its stage was freed by the barrier above).
        if constexpr (Pol::kTma) {
            if (i + 1 < steps) load_step(i + 1, st ^ 1);
        }
        // Masks only where a query can precede one of these keys or a row or key is past T.
        const bool edge = q0 < kw0 + 64 || q0 + Tr::kRows > T || kw0 + 64 > T;
        const int j_base = kw0 + 16 * cw;
        // This thread's query columns' lse2 and delta, read before the waits (kBwdStatsInRegs).
        float column[kTile / 8][2] = {};
        auto stat_of = [&](const float* stat, int n, int e) { return kBwdStatsInRegs ? column[n][e & 1] : stat[frag_col(lane, n, e)]; };
        if (kBwdStatsInRegs) read_columns<Pol::kPairedStats>(column, lse2_t, lane);
        wg_wait<1>();
        fence_regs(reinterpret_cast<float(&)[32]>(s));
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = j_base + frag_row(lane, e), t = q0 + frag_col(lane, n, e);
                const bool masked = edge && (t < j || t >= T || j >= T);
                const float p_t = fast_exp2(s[n][e] * p.scale_log2 - stat_of(lse2_t, n, e));   // columns < 64: in the tile
                s[n][e] = masked ? 0.f : p_t;   // P^T
            }
        uint32_t pa[4][4], pa2[4][4];
        pack_p<kBf16>(pa, s);
        pv_wgmma<kBf16, DP, 64>(dv, pa, sdO(st));   // dV += P^T dO
        wg_commit();
        if (kBwdStatsInRegs) read_columns<Pol::kPairedStats>(column, delta_t, lane);
        wg_wait<1>();
        fence_regs(reinterpret_cast<float(&)[32]>(dp));
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - stat_of(delta_t, n, e));   // dS^T
        pack_p<kBf16>(pa2, dp);
        pv_wgmma<kBf16, DP, 64>(dk, pa2, sQ(st));   // dK += dS^T Q
        wg_commit();
        store_ds_t(sdS, pa2, wg, cw, lane);
        fence_async_proxy();
        wg_wait<0>();
        fence_regs(reinterpret_cast<float(&)[DP / 2]>(dv));
        fence_regs(reinterpret_cast<float(&)[DP / 2]>(dk));
        mma_sync();   // both warpgroups' dS^T
        // dQ's share: 64 query rows x columns 64 cb .. + 63, summed over the 128 keys. A = dS, the
        // stored dS^T read M-major; B = K read N-major (as V in P V).
        float dq[8][4];
        if (cb == wg) {   // at width 64 the second warpgroup has no columns of its own
            const unsigned char* a = reinterpret_cast<const unsigned char*>(sdS);
            const unsigned char* kb = reinterpret_cast<const unsigned char*>(sK) + cb * 128 * 128;
            const uint64_t ad = wg_desc(a, 128 * 128, 1024), kd = wg_desc(kb, 128 * 128, 1024);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 8; ++ks)
                wgmma_ss_n64<kBf16, 1, 1>(reinterpret_cast<float(&)[32]>(dq), wg_desc_at(ad, ks * 16 * 128),
                                          wg_desc_at(kd, ks * 16 * 128), ks > 0);
            wg_commit();
            wg_wait<0>();
            fence_regs(reinterpret_cast<float(&)[32]>(dq));
        }
        if constexpr (Tr::kDqAdd == Tr::DqAdd::kRed) {
            if (cb == wg) red_dq(i, dq);
        } else if constexpr (Tr::kWriter) {
            if (cb == wg) hand_dq(i, dq);
        } else {
            add_dq(i, dq);
        }
    }

    store_key_rows<DP>(dk, dv, p, b, kvh, kw0 + 16 * cw, lane, bf16);
}

}  // namespace
