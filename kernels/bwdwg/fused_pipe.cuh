// gqa_bwd_pipe_kernel: the fused backward's pipelined step (bwdwg/fused.cuh describes the kernel
// and FusedTraits its forms). Included by fused.cuh.

namespace {

// FusedTraits::kPipelined's kernel: the products of gqa_bwd_fused_kernel's step, reordered so
// that the tensor pipe holds issued work for longer. Warpgroups 0 and 1 take 64 keys each;
// warpgroup 2 gives its registers to them and keeps two warps: the writer (warp 8, as kWriter's)
// and the producer (warp 9), which loads step i's Q, dO, lse2 and delta into stage i % 2 once
// both warpgroups have finished step i - 2's reads of it (empty_bar). A warpgroup's step i:
//   wait for stage i % 2, issue S^T(i) and dP^T(i) | wait S^T(i); P^T; issue dV(i) | wait dP^T(i);
//   dS^T; issue dK(i) | dS^T(i) to buffer i % 2, barrier of the two warpgroups | issue dQ(i) |
//   wait dV(i), dK(i): stage free | wait dQ(i), hand it to the writer (kLastWrites: on the CTA's
//   last query tiles, add it to the sum and write dQ).
// The barrier of step i also tells each warpgroup that the other has finished dQ(i - 2), so dS^T
// buffer i % 2 is free when step i writes it. With kGqaFusedScanFree the kernel checks its own K
// and V tiles for Inf and NaN (bit 1 of the flag); the statistics pass has checked the rest (bit
// 0), and on bit 0 every CTA returns at once, so no key tile waits for a turn that never comes.
template <class Pol>
__global__ void __launch_bounds__(FusedTraits<Pol::DP>::kThreads, 1)
    gqa_bwd_pipe_kernel(const GqaBwdParams p, const __grid_constant__ typename Pol::Maps maps) {
    constexpr bool kBf16 = Pol::kBf16;
    constexpr int DP = Pol::DP;
    using Tr = FusedTraits<DP>;
    static_assert(Tr::kPipelined && Tr::kWriter && Pol::kTma, "the pipelined step's layout");
    if (*p.nonfinite & (kGqaFusedScanFree ? 1 : ~0)) return;   // the row-wise kernels take this call
    extern __shared__ __align__(16) unsigned char fused_smem[];
    const uint32_t misaligned = static_cast<uint32_t>(__cvta_generic_to_shared(fused_smem)) & 1023u;
    uint16_t* sK = reinterpret_cast<uint16_t*>(fused_smem + ((1024u - misaligned) & 1023u));
    uint16_t* sV = sK + Tr::kKvHalves;
    auto sQ = [&](int st) { return sV + Tr::kKvHalves + st * 2 * Tr::kRowHalves; };
    auto sdO = [&](int st) { return sQ(st) + Tr::kRowHalves; };
    auto sdS = [&](int j) { return sQ(2) + j * Tr::kDsHalves; };   // dS^T: [128 keys][64 query rows], swizzled
    auto lse2_s = [&](int st) { return reinterpret_cast<float*>(sdS(Tr::kDsBuffers)) + st * 2 * Tr::kRows; };
    auto delta_s = [&](int st) { return lse2_s(st) + Tr::kRows; };
    float* held = delta_s(1) + Tr::kRows;   // the writer's buffers: [kAdders][2][4096]

    const int64_t bh_count = int64_t(p.B) * p.Hkv;
    const int n_q = (p.T + Tr::kRows - 1) / Tr::kRows;
    int kt = int(blockIdx.x / bh_count), bh = int(blockIdx.x % bh_count);
    if (p.fused_chunk > 0) {   // chunks of `chunk` pairs, each key tile by key tile
        const int64_t chunk = p.fused_chunk, key_tiles = gridDim.x / bh_count, c0 = blockIdx.x / (chunk * key_tiles) * chunk;
        const int64_t in_chunk = min(chunk, bh_count - c0), r = blockIdx.x - c0 * key_tiles;
        kt = int(r / in_chunk), bh = int(c0 + r % in_chunk);
    }
    const int64_t b = bh / p.Hkv;
    const int kvh = bh % p.Hkv, k0 = kt * Tr::kKeys, G = p.group, T = p.T;
    const int steps = (n_q - 2 * kt) * G;   // query tiles 2 kt .. n_q - 1 see a key of this CTA
    // Steps whose dQ share goes to the writer: all, or with kLastWrites all but those of query
    // tiles 2 kt and 2 kt + 1, whose blocks no later key tile adds to.
    const int handed = Tr::kLastWrites ? G * max(n_q - 2 * kt - 2, 0) : steps;
    // The warp's index from lane 0, so that the compiler knows it to be the same across the warp
    // (and branches on it not divergent around the products).
    const int warp = __shfl_sync(0xffffffffu, int(threadIdx.x) / 32, 0), lane = threadIdx.x % 32, wg = warp / 4, cw = warp % 4;
    auto step_tile = [&](int i) { return n_q - 1 - i / G; };
    auto step_head = [&](int i) { return kvh * G + i % G; };
    // full_bar[st]: the stage's copies landed (phase k: step st + 2 k); empty_bar[st]: the product
    // threads have finished their reads of it (every thread arrives, after its own reads of the
    // statistics, so that the order of those reads before the next copy is plain).
    __shared__ uint64_t full_bar[2], empty_bar[2];
    if (threadIdx.x == 0) {
        for (int st = 0; st < 2; ++st) mbar_init(&full_bar[st], 1), mbar_init(&empty_bar[st], Tr::kMmaThreads);
        mbar_init_fence();
    }
    __syncthreads();

    if (wg == 2) {
        regs_dec<Tr::kWriterRegs>();
        if (warp == 9) {   // the producer
            if (lane == 0)
                for (int i = 0; i < steps; ++i) {
                    const int st = i & 1, q0 = step_tile(i) * Tr::kRows, h = step_head(i);
                    if (i >= 2) mbar_wait(&empty_bar[st], uint32_t(((i - 2) >> 1) & 1));
                    const int64_t stat = bwd_stat_row(b, h, q0, p);
                    Pol::load_step(maps, sQ(st), sdO(st), lse2_s(st), delta_s(st), p.lse2 + stat, p.delta + stat,
                                   &full_bar[st], b, q0, h);
                }
            return;
        }
        if (warp != 8 || !Tr::kHandOverDq) return;
        // The writer: step i's shares, in turn (key tile 0's stored where kStoresFirst). Its
        // reductions are not awaited before the next steps': step i's buffers go back once read
        // (wait_group.read, after step i + 1's are issued), and step i's turn is handed on once its
        // reductions have completed (after step i + kTurnLag's are issued), so that neither the
        // buffers nor the writer wait out the reductions' round trip to L2 at every step.
        auto order_at = [&](int i) { return p.dq_order + (b * p.Hq + step_head(i)) * n_q + step_tile(i); };
        for (int i = 0; i < handed; ++i) {
            const int j = i & 1;
            float* block = p.dq_accum + ((b * p.Hq + step_head(i)) * n_q + step_tile(i)) * int64_t(64 * DP);
            if (lane == 0) {
                while (Tr::kWriterTurns && load_acquire(order_at(i)) < Tr::kAdders * kt) {
                }
                fence_async_global();
            }
            __syncwarp();
            for (int c = 0; c < Tr::kAdders; ++c) {
                named_sync(dq_full_id(c, j), kHandOver);
                if (lane == 0) {
                    float *dst = block + c * Tr::kPieceFloats, *src = held + (2 * c + j) * Tr::kPieceFloats;
                    if (Tr::kStoresFirst && kt == 0) {
                        bulk_store(dst, src, Tr::kPieceFloats * 4);
                    } else {
                        bulk_reduce_add(dst, src, Tr::kPieceFloats * 4);
                    }
                }
            }
            if (lane == 0) {
                bulk_commit();
                if (i >= Tr::kTurnLag) {   // step i - kTurnLag's reductions complete: its turn goes on
                    bulk_wait<Tr::kTurnLag>();
                    fence_async_global();
                    add_release(order_at(i - Tr::kTurnLag), Tr::kAdders);
                }
                if constexpr (Tr::kFreeLate) {
                    bulk_wait_read<1>();   // step i - 1's buffers read
                } else {
                    bulk_wait_read<0>();   // step i's
                }
            }
            __syncwarp();
            if constexpr (Tr::kFreeLate) {
                if (i >= 1 && i + 1 < handed)   // step i - 1's buffers, for step i + 1
                    for (int c = 0; c < Tr::kAdders; ++c) named_arrive(dq_empty_id(c, (i - 1) & 1), kHandOver);
            } else if (i + 2 < handed) {   // step i's buffers, for step i + 2
                for (int c = 0; c < Tr::kAdders; ++c) named_arrive(dq_empty_id(c, j), kHandOver);
            }
        }
        if (lane == 0 && handed > 0) {
            bulk_wait<0>();
            fence_async_global();
            for (int i = max(handed - Tr::kTurnLag, 0); i < handed; ++i) add_release(order_at(i), Tr::kAdders);
        }
        return;
    }
    regs_inc<Tr::kMmaRegs>();

    const int kw0 = k0 + 64 * wg;   // this warpgroup's first key
    const bool bf16 = kBf16;
    swizzled_load<DP, 128, 256>(sK, static_cast<const uint16_t*>(p.k), b, k0, kvh, p.Hkv, T);
    swizzled_load<DP, 128, 256>(sV, static_cast<const uint16_t*>(p.v), b, k0, kvh, p.Hkv, T);
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_proxy();
    named_sync(1, Tr::kMmaThreads);
    if constexpr (kGqaFusedScanFree) {   // Inf or NaN in K or V (4 tiles of 64 rows from sK)
        const bool bad = tiles_nonfinite<Pol, 4, Tr::kMmaThreads>(sK, bf16);
        if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(p.nonfinite, 2);
    }

    // Step i's dQ: at width 128 both warpgroups, 64 columns each; at width 64 warpgroup i % 2.
    auto dq_here = [&](int i) { return DP == 128 || (i & 1) == wg; };
    const int cb = DP == 128 ? wg : 0;
    const int wt = threadIdx.x % 128;
    float s[8][4], dp[8][4];
    // Pol::kFixedA (width 64): this warpgroup's K and V rows as register A operands of S^T and dP^T,
    // read once, as the dK/dV kernel's (measured neither faster nor slower alone, bench/NOTES.md
    // v103; part of every form measured after it). settle_a after each product that reads them
    // (ptxas 13.0, v101).
    uint32_t ka[Pol::kFixedA ? DP / 16 : 1][4], va[Pol::kFixedA ? DP / 16 : 1][4];
    const uint32_t a_zero = uint32_t(p.dtype) >> 8;   // 0 (Pol::settle_a)
    if constexpr (Pol::kFixedA) {
        Pol::load_a(ka, sK, warp, lane);   // rows 16 warp .. of the CTA's 128 keys: this warp's 16
        Pol::load_a(va, sV, warp, lane);
    }
    auto issue_s = [&](int i) {
        const int st = i & 1;
        mbar_wait(&full_bar[st], uint32_t((i >> 1) & 1));
        if constexpr (Pol::kFixedA) {
            qk_wgmma_rs<kBf16, DP, 64>(s, ka, sQ(st));
        } else {
            qk_wgmma<kBf16, DP, 128, 64>(s, sK, 64 * wg, sQ(st));    // S^T of this warpgroup's keys
        }
        wg_commit();
    };
    auto issue_dp = [&](int i) {
        if constexpr (Pol::kFixedA) {
            qk_wgmma_rs<kBf16, DP, 64>(dp, va, sdO(i & 1));
        } else {
            qk_wgmma<kBf16, DP, 128, 64>(dp, sV, 64 * wg, sdO(i & 1));  // dP^T
        }
        wg_commit();
    };
    float dk[DP / 8][4] = {}, dv[DP / 8][4] = {};
    float dq[8][4];
    // dV(i) and dK(i) have completed: this warp's reads of stage st are done.
    auto release = [&](int st) {
        fence_regs(reinterpret_cast<float(&)[DP / 2]>(dv));
        fence_regs(reinterpret_cast<float(&)[DP / 2]>(dk));
        mbar_arrive(&empty_bar[st]);
    };
    // Step i's share, complete, to the writer through buffer i % 2 of this warpgroup's columns.
    auto hand_dq = [&](int i) {
        const int j = i & 1;
        fence_regs(reinterpret_cast<float(&)[32]>(dq));
        float* buffer = held + (cb * 2 + j) * Tr::kPieceFloats;
        if (i >= 2) named_sync(dq_empty_id(cb, j), kHandOver);
#pragma unroll
        for (int n = 0; n < 8; ++n)
            reinterpret_cast<float4*>(buffer)[128 * n + wt] = make_float4(dq[n][0], dq[n][1], dq[n][2], dq[n][3]);
        fence_async_proxy();
        named_arrive(dq_full_id(cb, j), kHandOver);
    };
    // kLastWrites: step i's share, this block's last, added to the sum of the key tiles before
    // this one (none at kt = 0) once they have added theirs, then written as dQ (times 1 / sqrt(D),
    // the input dtype) from the accumulator's layout: float4 n of thread wt holds columns 8 n +
    // 2 (lane % 4) + {0, 1} of rows 16 (wt / 32) + lane / 4 and 8 below it; rows past T are left.
    auto write_dq = [&](int i) {
        fence_regs(reinterpret_cast<float(&)[32]>(dq));
        const int h = step_head(i), t = step_tile(i) * Tr::kRows + 16 * (wt / 32) + (lane >> 2);
        const int64_t block = (b * p.Hq + h) * n_q + step_tile(i);
        if (kt > 0) {
            if (wt == 0)
                while (load_acquire(p.dq_order + block) < Tr::kAdders * kt) {
                }
            named_sync(warpgroup_bar_id(wg), 128);
            const float4* piece = reinterpret_cast<const float4*>(p.dq_accum + block * (64 * DP) + Tr::kPieceFloats * cb) + wt;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                const float4 x = __ldcg(piece + 128 * n);
                dq[n][0] += x.x, dq[n][1] += x.y, dq[n][2] += x.z, dq[n][3] += x.w;
            }
        }
        uint16_t* out = static_cast<uint16_t*>(p.dq) + ((b * T + t) * p.Hq + h) * DP + 64 * cb + 2 * (lane & 3);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            if (t + 8 * half >= T) continue;
#pragma unroll
            for (int n = 0; n < 8; ++n)
                store_pair(out + 8 * half * int64_t(p.Hq) * DP + 8 * n, dq[n][2 * half] * p.scale, dq[n][2 * half + 1] * p.scale, bf16);
        }
    };
    for (int i = 0; i < steps; ++i) {
        const int st = i & 1, j = i % Tr::kDsBuffers, q0 = step_tile(i) * Tr::kRows;
        issue_s(i);
        issue_dp(i);
        const float* lse2_t = lse2_s(st);
        const float* delta_t = delta_s(st);
        const bool edge = q0 < kw0 + 64 || q0 + Tr::kRows > T || kw0 + 64 > T;
        const int j_base = kw0 + 16 * cw;
        float column[kTile / 8][2];
        read_columns<Pol::kPairedStats>(column, lse2_t, lane);
        wg_wait<1>();   // S^T(i); dP^T(i) still running
        fence_regs(reinterpret_cast<float(&)[32]>(s));
        if constexpr (Pol::kFixedA) Pol::settle_a(ka, a_zero);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = fast_exp2(s[n][e] * p.scale_log2 - column[n][e & 1]);
        if (edge) {
#pragma unroll
            for (int n = 0; n < 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int jk = j_base + frag_row(lane, e), t = q0 + frag_col(lane, n, e);
                    if (t < jk || t >= T || jk >= T) s[n][e] = 0.f;   // P^T
                }
        }
        uint32_t pa[4][4], pa2[4][4];
        pack_p<kBf16>(pa, s);
        pv_wgmma<kBf16, DP, 64>(dv, pa, sdO(st));   // dV += P^T dO
        wg_commit();
        read_columns<Pol::kPairedStats>(column, delta_t, lane);
        wg_wait<1>();   // dP^T(i); dV(i) still running
        fence_regs(reinterpret_cast<float(&)[32]>(dp));
        if constexpr (Pol::kFixedA) Pol::settle_a(va, a_zero);
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - column[n][e & 1]);   // dS^T
        pack_p<kBf16>(pa2, dp);
        auto issue_dk = [&] {
            pv_wgmma<kBf16, DP, 64>(dk, pa2, sQ(st));   // dK += dS^T Q
            wg_commit();
        };
        // kPairedDq: the warpgroups meet after the second step of a pair (or a last step alone);
        // the step whose dQ share this warpgroup computes then is iq = the pair's first + wg.
        const bool meet = !Tr::kPairedDq || (i & 1) == 1 || i + 1 == steps;
        const int iq = Tr::kPairedDq ? (i & ~1) + wg : i;
        const bool mine = meet && (Tr::kPairedDq ? iq <= i : dq_here(i));
        if (!(Tr::kDqFirst && mine)) issue_dk();
        store_ds_t(sdS(j), pa2, wg, cw, lane);   // dS^T into buffer j
        fence_async_proxy();
        if (meet) named_sync(1, Tr::kMmaThreads);   // both warpgroups' dS^T up to i; both finished their earlier dQ
        if (mine) {   // dQ's share: 64 query rows x columns 64 cb .. + 63, over the 128 keys
            const unsigned char* a = reinterpret_cast<const unsigned char*>(sdS(iq % Tr::kDsBuffers));
            const unsigned char* kb = reinterpret_cast<const unsigned char*>(sK) + cb * 128 * 128;
            const uint64_t ad = wg_desc(a, 128 * 128, 1024), kd = wg_desc(kb, 128 * 128, 1024);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 8; ++ks)
                wgmma_ss_n64<kBf16, 1, 1>(reinterpret_cast<float(&)[32]>(dq), wg_desc_at(ad, ks * 16 * 128),
                                          wg_desc_at(kd, ks * 16 * 128), ks > 0);
            wg_commit();
            auto hand_over = [&] {
                if (Tr::kHandOverDq) {
                    if (iq < handed) {
                        hand_dq(iq);
                    } else {
                        write_dq(iq);
                    }
                }
            };
            if constexpr (Tr::kDqFirst) {
                issue_dk();
                wg_wait<1>();   // dV(i) and dQ(iq); dK(i) still running
                hand_over();
                wg_wait<0>();
                release(st);
            } else {
                wg_wait<1>();   // dV(i) and dK(i); dQ(iq) still running
                release(st);
                wg_wait<0>();
                hand_over();
            }
        } else {
            wg_wait<0>();
            release(st);
        }
    }
    wg_wait<0>();   // (nothing runs here; the compiler cannot tell that steps > 0)
    fence_regs(reinterpret_cast<float(&)[DP / 2]>(dv));
    fence_regs(reinterpret_cast<float(&)[DP / 2]>(dk));

    store_key_rows<DP>(dk, dv, p, b, kvh, kw0 + 16 * cw, lane, bf16);
}

}  // namespace
