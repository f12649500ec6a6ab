// Kernel 1 of the 16-bit and x3 backward (bwdmma/kernels.cuh describes both kernels and their
// products policy): dQ, and lse2 and delta for kernel 2, per query tile. Included by kernels.cuh.

namespace {

// Kernel 1: one CTA per (query tile, batch, head); the tiles with the most keys start first. A
// query tile is Pol::kRowGroups groups of 64 rows, one a warpgroup (kThreads threads), which share
// each key tile's copies.
// kStats: pass 1 and delta only (lse2 and delta for a kernel that computes dQ itself).
template <class Pol, bool kStats = false>
__global__ void __launch_bounds__(kThreads * Pol::kRowGroups, Pol::kDqCtas) gqa_bwd_dq_kernel(const GqaBwdParams p, const __grid_constant__ typename Pol::Maps maps) {
    constexpr bool kBf16 = Pol::kBf16;
    constexpr int DP = Pol::DP, H = Pol::kTileHalves, OUT = Pol::kOut, RG = Pol::kRowGroups;
    const int col0 = OUT == DP ? 0 : int(blockIdx.y) * OUT;   // this CTA's dQ columns (OUT < DP: a grid of DP / OUT)
    extern __shared__ __align__(16) uint16_t smem_raw[];
    uint16_t* smem = Pol::aligned(smem_raw);
    // Q and dO (a tile per group), then two stages of (K, V): pass 1 alternates K between the first
    // stage's two tiles, pass 2 alternates whole stages.
    uint16_t *q_tiles = smem, *do_tiles = smem + RG * H;
    auto k_of = [&](int st) { return smem + (2 * RG + 2 * st) * H; };
    auto v_of = [&](int st) { return smem + (2 * RG + 1 + 2 * st) * H; };

    const BwdCta cta = bwd_cta(p.B, p.Hq);
    const int64_t b = cta.b;
    const int h = cta.head, kv_head = h / p.group, lane = threadIdx.x % 32;
    // This thread's row group (a constant 0 with one group, so that the tiles' addresses and the
    // wgmma descriptors built from them stay uniform: bench/NOTES.md v79), warp in it.
    const int wg = RG == 1 ? 0 : int(threadIdx.x) / kThreads, warp = int(threadIdx.x) % kThreads / 32;
    const bool loader = int(threadIdx.x) < kThreads;   // the first group's threads make the cp.async copies
    const int tiles = (p.T + kTile - 1) / kTile, ctiles = (tiles + RG - 1) / RG;
    const int qt_cta = (ctiles - 1 - cta.tile) * RG, kt_last = min(qt_cta + RG, tiles) - 1;   // the CTA's first query tile, last key tile
    const int qt = qt_cta + wg, q0 = qt * kTile;   // this group's query tile (past the last one: rows past T)
    uint16_t *q_tile = q_tiles + wg * H, *do_tile = do_tiles + wg * H;
    const bool bf16 = kBf16;
    const BwdIo io = Pol::io(p);
    const uint16_t *k_in = io.k, *v_in = io.v;
    // Pol::kTma: pass 2's K and V tiles come by TMA, issued by thread 0, and land on their stage's
    // barrier (phase k: the stage's k-th tile).
    constexpr bool kTmaKv = Pol::kTma && !kStats;
    __shared__ uint64_t landed_bar[2];
    if constexpr (kTmaKv) {
        if (threadIdx.x == 0) Pol::init_landed(landed_bar);
        __syncthreads();
    }
    // Key tile kt of pass 2 into stage st.
    auto load_kv_tile = [&](int kt, int st) {
        if constexpr (kTmaKv) {
            if (threadIdx.x == 0) Pol::load_kv(maps, k_of(st), v_of(st), &landed_bar[st], b, kt * kTile, kv_head);
        } else if (loader) {
            Pol::load(k_of(st), k_in, b, kt * kTile, kv_head, p.Hkv, p.T);
            Pol::load(v_of(st), v_in, b, kt * kTile, kv_head, p.Hkv, p.T);
        }
    };

    if (loader)
        for (int g = 0; g < RG; ++g) {
            Pol::load(q_tiles + g * H, io.q, b, (qt_cta + g) * kTile, h, p.Hq, p.T);
            Pol::load(do_tiles + g * H, io.dout, b, (qt_cta + g) * kTile, h, p.Hq, p.T);
        }
    cp_async_commit();
    // Pass 2's first K and V (stage 1, which pass 1 leaves alone), landed by pass 1's first wait.
    if (!kStats) load_kv_tile(0, 1);
    cp_async_commit();

    // delta of this lane's two rows (every lane of a quad computes the same value).
    float delta[2], lse2[2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        float sum = 0.f;
        if constexpr (Pol::kDeltaGiven) {   // by the policy's pre-pass, in the input's units
            if (t < p.T) sum = ldexpf(p.delta[bwd_stat_row(b, h, t, p)], io.e_delta);
        } else if (t < p.T) {   // the quad's row in 16-byte reads, lane l of the quad chunks l, l + 4, ..
            const int64_t row = ((b * p.T + t) * p.Hq + h) * int64_t(DP);
            const uint4* dout_row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.dout) + row);
            const uint4* o_row = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.o) + row);
            uint4 x[DP / 32], y[DP / 32];
#pragma unroll
            for (int i = 0; i < DP / 32; ++i) x[i] = __ldg(dout_row + (lane & 3) + 4 * i), y[i] = __ldg(o_row + (lane & 3) + 4 * i);
#pragma unroll
            for (int i = 0; i < DP / 32; ++i) sum = dot8_16bit(x[i], y[i], sum, bf16);
        }
        if constexpr (!Pol::kDeltaGiven) {
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        }
        delta[half] = sum;
    }

    // The forward's log-sum-exp of these rows, when it kept a number for every one of them: then
    // pass 1 has nothing to do (its loop runs to -1; a branch around products would serialise them).
    float given[2] = {0.f, 0.f};
    bool kept = p.lse2_in != nullptr;
    if (kept) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
            if (t < p.T) given[half] = p.lse2_in[(b * p.T + t) * p.Hq + h];
            kept = kept && isfinite(given[half]);
        }
    }
    kept = __syncthreads_and(kept);
    const int pass1_last = kept ? -1 : kt_last;

    // Only the group's diagonal tile (kt == qt, which is also the one holding keys past T) and, for
    // an earlier group, the CTA's tiles after it (every key masked) mask.
    auto masked = [&](int kt, int n, int e) {
        const int t = q0 + 16 * warp + frag_row(lane, e), j = kt * kTile + frag_col(lane, n, e);
        return j > t || j >= p.T;
    };

    // Pass 1: the rows' maximum and sum, online over the key tiles. K tile kt lands in stage 0's
    // K (kt even) or V tile (kt odd) while the tile before it is in use.
    auto k_stage = [&](int kt) { return kt & 1 ? v_of(0) : k_of(0); };
    if (!kept && loader) Pol::load(k_stage(0), k_in, b, 0, kv_head, p.Hkv, p.T);   // (pass 2 refills stage 0 at once)
    cp_async_commit();
    for (int kt = 0; kt <= pass1_last; ++kt) {
        if (kt < kt_last && loader) Pol::load(k_stage(kt + 1), k_in, b, (kt + 1) * kTile, kv_head, p.Hkv, p.T);
        cp_async_commit();    // (empty on the last tile)
        cp_async_wait<1>();   // everything but the tile just issued has landed
        Pol::landed();
        __syncthreads();
        float s[1][kTile / 8][4];
        Pol::qk_issue(s, q_tile, k_stage(kt), warp, lane);
        Pol::template wait<0>();
        Pol::settle(s);
        const bool edge = kt >= qt;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e) {
                    s[0][n][e] = edge && masked(kt, n, e) ? -INFINITY : s[0][n][e] * io.scale_log2;
                    tile_max = fmaxf(tile_max, s[0][n][e]);
                }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float m_new = fmaxf(m[half], tile_max);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 2 * half; e < 2 * half + 2; ++e)
                    sum += s[0][n][e] == -INFINITY ? 0.f : fast_exp2(s[0][n][e] - m_new);
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l[half] = (m[half] == -INFINITY ? 0.f : l[half] * fast_exp2(m[half] - m_new)) + sum;
            m[half] = m_new;
        }
        __syncthreads();   // this tile takes tile kt + 2, issued at the top of the next iteration
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) lse2[half] = kept ? given[half] : m[half] + log2f(l[half]);

    // Pass 2: dQ. Key tile kt sits in stage (kt + 1) % 2; the next one loads during this one.
    float dq[1][OUT / 8][4] = {};
    // Pol::kDqFlushSteps: this thread's fp32 rows of dQ (flushed after key tiles kDqFlushSteps - 1,
    // 2 kDqFlushSteps - 1, ..).
    auto row_of = [&](float* rows, int half) -> float* {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        return t < p.T ? rows + ((b * p.T + t) * p.Hq + h) * DP + col0 : nullptr;
    };
    auto dq_row = [&](int half) { return row_of(reinterpret_cast<float*>(p.dq), half); };
    // Pol::kDeltaFix: this thread's part of c (its two rows' sums of dS over its columns), and
    // sum_j P_ij K_j in fp16, flushed with dQ into the fp32 rows io.pk.
    float ds_sum[2] = {0.f, 0.f};
    uint32_t pk[Pol::kDeltaFix ? OUT / 8 : 1][2] = {};
    auto pk_row = [&](int half) { return row_of(io.pk, half); };
    // dQ's products (and P K, committed before them) have completed: their registers may be read.
    auto settle_dq = [&] {
        Pol::settle(dq);
        if constexpr (Pol::kDeltaFix) fence_regs(reinterpret_cast<uint32_t(&)[OUT / 4]>(pk));
    };
    auto load_kv = [&](int kt) {   // key tile kt + 1 into the other stage
        if (kt < kt_last) load_kv_tile(kt + 1, ((kt + 1) & 1) ^ 1);
        cp_async_commit();    // (empty on the last tile)
    };
    // Pol::kFixedA: the group's Q and dO rows as register A operands, read once before the loop
    // and on every path (read inside it at the first key tile only, the registers had no value on
    // the later tiles' path).
    uint32_t qa[Pol::kFixedA ? DP / 16 : 1][4], doa[Pol::kFixedA ? DP / 16 : 1][4];
    const uint32_t a_zero = uint32_t(p.dtype) >> 8;   // 0 (Pol::settle_a)
    if constexpr (Pol::kFixedA) {
        if (!kStats) {
            cp_async_wait<0>();   // Q and dO (and a first K and V by cp.async, which the loop waits for anyway)
            __syncthreads();
            Pol::load_a(qa, q_tile, warp, lane);
            Pol::load_a(doa, do_tile, warp, lane);
        }
    }
    for (int kt = 0; kt <= (kStats ? -1 : kt_last); ++kt) {
        const int st = (kt + 1) & 1;
        if (!Pol::kEarlyIssue && !kTmaKv) load_kv(kt);
        if (!kTmaKv || kBwdFenceEveryStep || kt == 0) {
            cp_async_wait<Pol::kEarlyIssue || kTmaKv ? 0 : 1>();   // key tile kt has landed (kTma: Q and dO)
            Pol::landed();
        }
        // (kTma with Pol::kEarlyIssue: only Q and dO need it, and the tile's stage was freed by the
        // barrier in the middle of the tile before)
        if (!(kTmaKv && Pol::kEarlyIssue) || kt == 0) __syncthreads();
        if constexpr (kTmaKv) Pol::await_step(&landed_bar[st], uint32_t((kt >> 1) & 1));
        float s[1][kTile / 8][4], dp[1][kTile / 8][4];
        if constexpr (Pol::kFixedA) Pol::qk_issue_rs(s, qa, k_of(st));
        else Pol::qk_issue(s, q_tile, k_of(st), warp, lane);
        // kDpLate: dP issued after the last tile's dQ product has completed (S queued behind it
        // keeps the tensor pipe busy), so that dQ's A fragments are dead before dP's accumulators
        // are live: 16 registers fewer at the peak with dO's fragments held too.
        constexpr bool kDpLate = Pol::kFixedA && Pol::kEarlyIssue;
        auto issue_dp = [&] {
            if constexpr (Pol::kFixedA) Pol::qk_issue_rs(dp, doa, v_of(st));
            else Pol::qk_issue(dp, do_tile, v_of(st), warp, lane);
        };
        if constexpr (!kDpLate) issue_dp();
        // kTma: tile kt + 1 goes out under the products (its stage was freed by the barrier that
        // ended tile kt - 1; with Pol::kEarlyIssue by the one below).
        if constexpr (kTmaKv && !Pol::kEarlyIssue) load_kv(kt);
        if (Pol::kEarlyIssue) {
            Pol::template wait<kDpLate ? 1 : 2>();   // the last tile's dQ product: its stage is free
            settle_dq();
            if constexpr (kDpLate) issue_dp();
            __syncthreads();
            load_kv(kt);
        }
        Pol::template wait<1>();   // S; dP still running
        Pol::settle(s);
        if constexpr (Pol::kFixedA) Pol::settle_a(qa, a_zero);
        // P for every element, then the masked ones zeroed on the diagonal tile alone (with the
        // mask in the same expression the compiler tested it, and reloaded scale_log2, for every
        // element of every tile: bench/NOTES.md v63).
        const float scale_log2 = io.scale_log2;
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = fast_exp2(s[0][n][e] * scale_log2 - lse2[e >> 1]);   // P
        if (kt >= qt) {
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (masked(kt, n, e)) s[0][n][e] = 0.f;
        }
        if constexpr (Pol::kDeltaFix) {   // sum_j P_ij K_j += P K (K's hi part), in fp16
            uint32_t pf[kTile / 16][4];
            pack_p<false, kTile / 8>(pf, s[0]);
            Pol::pk_issue(pk, pf, Pol::columns(k_of(st), col0));
        }
        Pol::template wait<Pol::kDeltaFix ? 1 : 0>();   // dP (P K may still run: it is settled with dQ)
        Pol::settle(dp);
        if constexpr (Pol::kFixedA) Pol::settle_a(doa, a_zero);
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[0][n][e] *= dp[0][n][e] - delta[e >> 1];   // dS
                if constexpr (Pol::kDeltaFix) ds_sum[e >> 1] += s[0][n][e];
            }
        uint32_t pa[kTile / 16][4];
        Pol::pv_issue(dq, pa, s, Pol::columns(k_of(st), col0), lane, io.ds_mul);
        if (!Pol::kEarlyIssue) {
            Pol::template wait<0>();
            settle_dq();
            __syncthreads();   // this stage takes tile kt + 2, issued at the top of the next iteration
        }
        if constexpr (Pol::kDqFlushSteps > 0 && !kStats) {
            if ((kt + 1) % Pol::kDqFlushSteps == 0) {
                if constexpr (Pol::kEarlyIssue) Pol::template wait<0>(), settle_dq();   // (still running)
                flush_rows(dq, dq_row, lane, kt + 1 == Pol::kDqFlushSteps);
            }
        }
        if constexpr (Pol::kDeltaFix) {
            if ((kt + 1) % Pol::kPkFlushSteps == 0) {
                if constexpr (Pol::kEarlyIssue) Pol::template wait<0>(), settle_dq();
                flush_half_rows(pk, pk_row, lane, kt + 1 == Pol::kPkFlushSteps);
            }
        }
    }
    Pol::template wait<0>();
    settle_dq();
    if constexpr (Pol::kDqFlushSteps > 0 && !kStats) {
        if (kt_last + 1 >= Pol::kDqFlushSteps) take_back_rows(dq, dq_row, lane);
    }
    if constexpr (Pol::kDeltaFix && !kStats) {   // dS - c_i P_ij in place of dS, in dQ and in delta
        static_assert(Pol::kPkFlushSteps > 0, "sum_j P_ij K_j is flushed into fp32 rows");
        float pk_f[1][OUT / 8][4];
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&pk[n][half]));
                pk_f[0][n][2 * half] = x.x, pk_f[0][n][2 * half + 1] = x.y;
            }
        if (kt_last + 1 >= Pol::kPkFlushSteps) take_back_rows(pk_f, pk_row, lane);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            ds_sum[half] += __shfl_xor_sync(0xffffffffu, ds_sum[half], 1);
            ds_sum[half] += __shfl_xor_sync(0xffffffffu, ds_sum[half], 2);
            delta[half] += ds_sum[half];
        }
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[0][n][e] -= io.ds_mul * ds_sum[e >> 1] * pk_f[0][n][e];
    }
    // The inputs' check: Inf or NaN in this CTA's Q tiles, or in its rows of dO or o, which makes
    // delta not finite (so does an fp32 overflow of finite bf16 products: the row-wise kernels
    // take that call too).
    cp_async_wait<0>();
    __syncthreads();
    flag_nonfinite(p, tiles_nonfinite<Pol, RG, kThreads * RG>(q_tiles, bf16) || !isfinite(delta[0]) || !isfinite(delta[1]));

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = q0 + 16 * warp + frag_row(lane, 2 * half);
        if ((lane & 3) == 0 && col0 == 0 && qt < tiles) {   // every row of the tile, zeros past T
            const int64_t stat = bwd_stat_row(b, h, t, p);
            p.lse2[stat] = t < p.T ? lse2[half] : 0.f;
            p.delta[stat] = t < p.T ? delta[half] : 0.f;
        }
        if (t >= p.T) continue;
        typename Pol::Out* out = static_cast<typename Pol::Out*>(p.dq) + ((b * p.T + t) * p.Hq + h) * DP + col0;
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n)
            if (!kStats)
                Pol::store2(out + frag_col(lane, n, 2 * half), dq[0][n][2 * half] * p.scale, dq[0][n][2 * half + 1] * p.scale, io.e_dq);
    }
}
}  // namespace
