// Kernel 2 of the 16-bit and x3 backward (bwdmma/kernels.cuh describes both kernels and their
// products policy): dK and dV per key tile; then the launch of both kernels of a policy's unit.
// Included by kernels.cuh.

namespace {

// Kernel 2: one CTA per (key tile, batch, kv head); the tiles with the most queries start first.
// A key tile is Pol::kKeyGroups groups of 64 keys, one a warpgroup (kThreads threads), which share
// each step's Q, dO, lse2 and delta.
template <class Pol>
__global__ void __launch_bounds__(kThreads * Pol::kKeyGroups) gqa_bwd_dkdv_kernel(const GqaBwdParams p, const __grid_constant__ typename Pol::Maps maps) {
    if (*p.nonfinite) return;   // kernel 1 found Inf or NaN: the row-wise kernels take this call
    constexpr bool kBf16 = Pol::kBf16;
    constexpr int DP = Pol::DP, H = Pol::kTileHalves, OUT = Pol::kOut, KG = Pol::kKeyGroups;
    const int col0 = OUT == DP ? 0 : int(blockIdx.y) * OUT;   // this CTA's dK and dV columns
    extern __shared__ __align__(16) uint16_t smem_raw[];
    uint16_t* smem = Pol::aligned(smem_raw);
    uint16_t *k_tiles = smem, *v_tiles = smem + KG * H;   // a 64-key tile per group
    auto q_tile = [&](int st) { return smem + (2 * KG + 2 * st) * H; };
    auto do_tile = [&](int st) { return smem + (2 * KG + 1 + 2 * st) * H; };
    auto lse2_s = [&](int st) { return reinterpret_cast<float*>(smem + (2 * KG + 4) * H) + st * 2 * kTile; };
    auto delta_s = [&](int st) { return lse2_s(st) + kTile; };

    const BwdCta cta = bwd_cta(p.B, p.Hkv);
    const int64_t b = cta.b;
    const int kv_head = cta.head, lane = threadIdx.x % 32, tiles = (p.T + kTile - 1) / kTile;
    const int wg = KG == 1 ? 0 : int(threadIdx.x) / kThreads, warp = int(threadIdx.x) % kThreads / 32;   // as kernel 1's
    const bool loader = int(threadIdx.x) < kThreads;   // the first group's threads make the cp.async copies
    const int kt = cta.tile, k0 = kt * kTile * KG, kw0 = k0 + kTile * wg;   // the CTA's first key, this group's
    uint16_t *k_tile = k_tiles + wg * H, *v_tile = v_tiles + wg * H;
    const bool bf16 = kBf16;
    const BwdIo io = Pol::io(p);
    // Pol::kTma: a stage's Q, dO, lse2 and delta come by TMA, issued by thread 0, and land on the
    // stage's barrier (phase k: the stage's k-th step).
    __shared__ uint64_t landed_bar[2];
    if constexpr (Pol::kTma) {
        if (threadIdx.x == 0) Pol::init_landed(landed_bar);
        __syncthreads();
    }

    if (loader)
        for (int g = 0; g < KG; ++g) {
            Pol::load(k_tiles + g * H, io.k, b, k0 + g * kTile, kv_head, p.Hkv, p.T);
            Pol::load(v_tiles + g * H, io.v, b, k0 + g * kTile, kv_head, p.Hkv, p.T);
        }
    cp_async_commit();

    // Step i is query tile kt KG + i / G of head kv_head * G + i % G: its Q, dO, lse2 and delta go to
    // stage i % 2 while step i - 1 computes from the other stage. The steps are loaded in order, so
    // the next one's tile and head are counted on (no division a step).
    const int steps = (tiles - kt * KG) * p.group;
    int load_qt = kt * KG, load_g = 0;   // the next step to load: its query tile, and its head in the group
    auto load_next = [&](int st) {
        const int q0 = load_qt * kTile, h = kv_head * p.group + load_g;
        if (++load_g == p.group) load_g = 0, ++load_qt;
        const int64_t stat = bwd_stat_row(b, h, q0, p);   // 64 values, zeros past T
        if constexpr (Pol::kTma) {
            if (threadIdx.x == 0)
                Pol::load_step(maps, q_tile(st), do_tile(st), lse2_s(st), delta_s(st), p.lse2 + stat, p.delta + stat,
                               &landed_bar[st], b, q0, h);
        } else if (loader) {
            Pol::load(q_tile(st), io.q, b, q0, h, p.Hq, p.T);
            Pol::load(do_tile(st), io.dout, b, q0, h, p.Hq, p.T);
            if (threadIdx.x < kTile / 4) {
                cp_async16(lse2_s(st) + 4 * threadIdx.x, p.lse2 + stat + 4 * threadIdx.x, 16);
                cp_async16(delta_s(st) + 4 * threadIdx.x, p.delta + stat + 4 * threadIdx.x, 16);
            }
        }
    };
    load_next(0);
    cp_async_commit();

    float dk[1][OUT / 8][4] = {}, dv[1][OUT / 8][4] = {};
    // Pol::kFlushSteps: this thread's fp32 rows of dK and dV (flushed after steps kFlushSteps - 1,
    // 2 kFlushSteps - 1, ..).
    auto key_row = [&](float* grad, int half) -> float* {
        const int j = kw0 + 16 * warp + frag_row(lane, 2 * half);
        return j < p.T ? grad + ((b * p.T + j) * p.Hkv + kv_head) * DP + col0 : nullptr;
    };
    auto dk_row = [&](int half) { return key_row(reinterpret_cast<float*>(p.dk), half); };
    auto dv_row = [&](int half) { return key_row(reinterpret_cast<float*>(p.dv), half); };
    int step_qt = kt * KG, step_g = 0;   // step i's query tile and head in the group, counted on
    // Pol::kFixedA: the group's K and V rows as register A operands, read once before the loop
    // (as the dQ kernel's Q and dO).
    uint32_t ka[Pol::kFixedA ? DP / 16 : 1][4], va[Pol::kFixedA ? DP / 16 : 1][4];
    const uint32_t a_zero = uint32_t(p.dtype) >> 8;   // 0 (Pol::settle_a)
    if constexpr (Pol::kFixedA) {
        cp_async_wait<Pol::kTma ? 0 : 1>();   // K and V (cp.async: the first step's copies may still run)
        __syncthreads();
        Pol::load_a(ka, k_tile, warp, lane);
        Pol::load_a(va, v_tile, warp, lane);
    }
    for (int i = 0; i < steps; ++i) {
        const int st = i & 1, q0 = step_qt * kTile;
        if (++step_g == p.group) step_g = 0, ++step_qt;
        if (!Pol::kEarlyIssue && !Pol::kTma) {
            if (i + 1 < steps) load_next(st ^ 1);
            cp_async_commit();    // (empty on the last step)
        }
        if (!Pol::kTma || kBwdFenceEveryStep || i == 0) {
            cp_async_wait<Pol::kEarlyIssue ? 0 : 1>();   // step i has landed (kTma: K and V)
            Pol::landed();
        }
        // (kTma with Pol::kEarlyIssue: only K and V need it, and the step's stage was freed by the
        // barrier in the middle of the step before)
        if (!(Pol::kTma && Pol::kEarlyIssue) || i == 0) __syncthreads();
        if constexpr (Pol::kTma) Pol::await_step(&landed_bar[st], uint32_t((i >> 1) & 1));
        const float* lse2_t = lse2_s(st);
        const float* delta_t = delta_s(st);
        float s[1][kTile / 8][4], dp[1][kTile / 8][4];
        if constexpr (Pol::kFixedA) {
            Pol::qk_issue_rs(s, ka, q_tile(st));     // S^T
            Pol::qk_issue_rs(dp, va, do_tile(st));   // dP^T
        } else {
            Pol::qk_issue(s, k_tile, q_tile(st), warp, lane);     // S^T
            Pol::qk_issue(dp, v_tile, do_tile(st), warp, lane);   // dP^T
        }
        // kTma: step i + 1's copies go out under the products (its stage was freed by the barrier
        // that ended step i - 1; with Pol::kEarlyIssue by the one below), so the issuing warp does
        // not hold up this step's barrier.
        if constexpr (Pol::kTma && !Pol::kEarlyIssue) {
            if (i + 1 < steps) load_next(st ^ 1);
        }
        if (Pol::kEarlyIssue) {
            Pol::template wait<2>();   // the last step's dV and dK: its stage is free
            Pol::settle(dv);
            Pol::settle(dk);
            __syncthreads();
            if (i + 1 < steps) load_next(st ^ 1);
            cp_async_commit();    // (empty on the last step)
        }
        // Masks only where a query can precede a key (the group's diagonal tile, and for a later
        // group the tiles before it) or a row or key is past T.
        const bool edge = q0 <= kw0 || q0 + kTile > p.T;
        const int j_base = kw0 + 16 * warp;
        float column[kTile / 8][2] = {};
        auto stat_of = [&](const float* stat, int n, int e) { return kBwdStatsInRegs ? column[n][e & 1] : stat[frag_col(lane, n, e)]; };
        if (kBwdStatsInRegs) read_columns<Pol::kPairedStats>(column, lse2_t, lane);
        Pol::template wait<1>();   // S^T; dP^T still running
        Pol::settle(s);
        if constexpr (Pol::kFixedA) Pol::settle_a(ka, a_zero);
        // P^T for every element, then the masked ones zeroed on edge tiles alone: with the mask in
        // the same expression the compiler branched around each exponential (BSSY, two BRA,
        // BSYNC an element, edge tile or not; bench/NOTES.md v59).
        const float scale_log2 = io.scale_log2;
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = fast_exp2(s[0][n][e] * scale_log2 - stat_of(lse2_t, n, e));
        if (edge) {
#pragma unroll
            for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = j_base + frag_row(lane, e), t = q0 + frag_col(lane, n, e);
                    if (t < j || t >= p.T || j >= p.T) s[0][n][e] = 0.f;
                }
        }
        uint32_t pa[kTile / 16][4], pa2[kTile / 16][4];
        Pol::pv_issue(dv, pa, s, Pol::columns(do_tile(st), col0), lane, io.p_mul);   // dV += P^T dO
        if (kBwdStatsInRegs) read_columns<Pol::kPairedStats>(column, delta_t, lane);
        Pol::template wait<1>();   // dP^T; dV still running
        Pol::settle(dp);
        if constexpr (Pol::kFixedA) Pol::settle_a(va, a_zero);
#pragma unroll
        for (int n = 0; n < kTile / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[0][n][e] = s[0][n][e] * (dp[0][n][e] - stat_of(delta_t, n, e));   // dS^T
        Pol::pv_issue(dk, pa2, dp, Pol::columns(q_tile(st), col0), lane, io.ds_mul);   // dK += dS^T Q
        if (!Pol::kEarlyIssue) {
            Pol::template wait<0>();
            Pol::settle(dv);
            Pol::settle(dk);
            __syncthreads();   // stage st takes step i + 2, issued at the top of the next iteration
        }
        if constexpr (Pol::kFlushSteps > 0) {
            if ((i + 1) % Pol::kFlushSteps == 0) {
                if constexpr (Pol::kEarlyIssue) Pol::template wait<0>(), Pol::settle(dv), Pol::settle(dk);   // (still running)
                flush_rows(dk, dk_row, lane, i + 1 == Pol::kFlushSteps);
                flush_rows(dv, dv_row, lane, i + 1 == Pol::kFlushSteps);
            }
        }
    }
    Pol::template wait<0>();
    Pol::settle(dv);
    Pol::settle(dk);
    if constexpr (Pol::kFlushSteps > 0) {
        if (steps >= Pol::kFlushSteps) take_back_rows(dk, dk_row, lane), take_back_rows(dv, dv_row, lane);
    }
    // The inputs' check: Inf or NaN in this CTA's K and V tiles (consecutive in shared memory).
    cp_async_wait<0>();
    __syncthreads();
    flag_nonfinite(p, tiles_nonfinite<Pol, 2 * KG, kThreads * KG>(k_tiles, bf16));

#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int j = kw0 + 16 * warp + frag_row(lane, 2 * half);
        if (j >= p.T) continue;
        const int64_t row = (b * p.T + j) * p.Hkv + kv_head;
        typename Pol::Out* dk_out = static_cast<typename Pol::Out*>(p.dk) + row * DP + col0;
        typename Pol::Out* dv_out = static_cast<typename Pol::Out*>(p.dv) + row * DP + col0;
#pragma unroll
        for (int n = 0; n < OUT / 8; ++n) {
            const int c = frag_col(lane, n, 2 * half);
            Pol::store2(dk_out + c, dk[0][n][2 * half] * p.scale, dk[0][n][2 * half + 1] * p.scale, io.e_dk);
            Pol::store2(dv_out + c, dv[0][n][2 * half], dv[0][n][2 * half + 1], io.e_dv);
        }
    }
}

// Both kernels of one policy's unit, after p.nonfinite is zeroed (attention.cu) on the same stream.
template <class Pol>
cudaError_t bwd_launch(const GqaBwdParams& p, cudaStream_t stream, int dev) {
    if (p.dtype != Pol::kDtype || p.D != Pol::DP) return cudaErrorInvalidValue;
    static bool raised_dq[kMaxDevices] = {}, raised_dkdv[kMaxDevices] = {};
    constexpr size_t dq_smem = BwdSmem<Pol>::kDq, dkdv_smem = BwdSmem<Pol>::kDkdv;
    static_assert(dq_smem <= 227 * 1024 && dkdv_smem <= 227 * 1024, "each kernel's tiles fit one CTA's shared memory");
    const int64_t tiles = (p.T + kTile - 1) / kTile, key_tiles = (p.T + kTile * Pol::kKeyGroups - 1) / (kTile * Pol::kKeyGroups);
    const int64_t dq_ctas = (tiles + Pol::kRowGroups - 1) / Pol::kRowGroups * p.B * p.Hq, dkdv_ctas = key_tiles * p.B * p.Hkv;
    if (dq_ctas > 0x7fffffff || dkdv_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
    cudaError_t err = raise_smem_limit(gqa_bwd_dq_kernel<Pol>, dq_smem, dev, raised_dq);
    if (err != cudaSuccess) return err;
    err = raise_smem_limit(gqa_bwd_dkdv_kernel<Pol>, dkdv_smem, dev, raised_dkdv);
    if (err != cudaSuccess) return err;
    constexpr unsigned kHalves = Pol::DP / Pol::kOut;   // CTAs a tile, each its output columns
    typename Pol::Maps maps;
    err = Pol::make_maps(p, &maps);
    if (err != cudaSuccess) return err;
    gqa_bwd_dq_kernel<Pol><<<dim3(unsigned(dq_ctas), kHalves), kThreads * Pol::kRowGroups, dq_smem, stream>>>(p, maps);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    gqa_bwd_dkdv_kernel<Pol><<<dim3(unsigned(dkdv_ctas), kHalves), kThreads * Pol::kKeyGroups, dkdv_smem, stream>>>(p, maps);
    return cudaGetLastError();
}

// The unit's entry point, gqa_launch_<family> (gqa_params.h: GqaBwdLauncher), for policy POL.
#define GQA_BWD_ENTRY(family, POL)                                                                    \
    extern "C" int gqa_launch_##family(const GqaBwdParams* p, void* stream) {                         \
        int dev = 0;                                                                                   \
        const cudaError_t err = cudaGetDevice(&dev);                                                   \
        return int(err != cudaSuccess ? err : bwd_launch<POL>(*p, static_cast<cudaStream_t>(stream), dev)); \
    }

}  // namespace
