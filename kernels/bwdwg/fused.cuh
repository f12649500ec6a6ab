// The wgmma unit's backward in five tile products a tile pair, dQ summed in a fixed order.
//  1. Per query row, lse2 and delta only: gqa_bwd_row_stats_kernel where the forward kept lse2
//     (FusedTraits::kRowStats), else the dQ kernel of bwdmma/kernels.cuh with kStats.
//  2. One CTA per (128 keys, batch, kv head), two warpgroups of 64 keys. For every 64-row query
//     tile at or after its keys, the last first, and every head of the group: S^T = K Q^T and
//     dP^T = V dO^T, P^T from lse2, dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q (each
//     warpgroup its keys), then dS^T to shared memory and dQ's share of these keys = dS K (each
//     warpgroup 64 of dQ's columns; at width 64 the first warpgroup alone).
//     The share is added to an fp32 sum in global memory in key-tile order (the sums zeroed
//     first, or key tile 0's share stored: FusedTraits::kFirstStores): a counter per (batch,
//     head, query tile) says how many shares have been added, and a CTA waits for its turn (its key
//     tile's index). CTAs start in key-tile order, so the one waited for has started; every CTA
//     takes the query tiles in the same order, so the waits are short once under way. The sum is
//     kept in blocks of a query tile (64 rows x DP), each warpgroup's 64 columns a 16 KB piece in
//     the order of its threads' accumulators (float4 n of thread w at n * 128 + w), so that a
//     share is one contiguous piece. gqa_bwd_pipe_kernel (FusedTraits::kPipelined, in use) orders
//     the step's products so that the tensor pipe keeps issued work and adds the shares from a
//     writer warp; gqa_bwd_fused_kernel, its serial predecessor, stays for measurement with the
//     forms of FusedTraits::kDqAdd.
//  3. dQ = the sum times 1 / sqrt(D), in the input dtype, rows back in [B, T, Hq, D] order: in
//     the pipelined kernel (FusedTraits::kLastWrites) by the warpgroups of each block's last key
//     tile, which add their share to the sum read back from L2; in the serial kernel by a third
//     kernel.
// Deterministic (in every kDqAdd but kRed): every sum runs in a fixed order.
#ifndef GQA_BWDWG_FUSED_CUH
#define GQA_BWDWG_FUSED_CUH

#include "bwdmma/kernels.cuh"
#include "common/tma.cuh"

namespace {

template <int DP> struct FusedTraits {
    static constexpr int kKeys = 128;       // keys per CTA, 64 per warpgroup
    static constexpr int kRows = 64;        // query rows a step
    static constexpr int kKvHalves = kKeys * DP, kRowHalves = kRows * DP, kDsHalves = kKeys * kRows;
    // How a warpgroup's dQ share of a step reaches the sum:
    //   kTurn: at the end of the step the CTA waits for its turn, then reads, adds and writes its
    //     pieces through L2 and hands the turn on;
    //   kRed: float4 adds from registers (RED), no turn: not deterministic, an instrument;
    //   kWriter: the share to shared memory (two buffers a warpgroup), handed by a named barrier to
    //     a writer warp (the first of a third warpgroup, which gives its registers to the two
    //     others): it waits for the turn, issues a bulk reduction of the piece
    //     (cp.reduce.async.bulk, no registers held), awaits its completion, hands the turn on and
    //     frees the buffer, so the products wait only when it is two steps behind.
    // (The turn one step later, and the bulk reduction issued by the products' own warpgroups, in
    // turn or not, measured slower: bench/NOTES.md v53, v54.)
    enum class DqAdd { kTurn, kRed, kWriter };
    static constexpr DqAdd kDqAdd = DqAdd::kTurn;
    // The pipelined step (gqa_bwd_pipe_kernel, bench/NOTES.md v91, v92): a producer warp loads each
    // step's Q, dO and statistics into a ring of two stages, dS^T has two buffers, dQ(i) is issued
    // while dV(i) still runs (and dK(i), without kDqFirst), and its share goes to the writer warp,
    // which adds it in turn (kWriter's hand-over); step i + 1's S^T and dP^T are issued after that
    // hand-over (issuing them before it serialises the products: v94). At width 64 the warpgroups
    // take the dQ products in turn, a step each.
    static constexpr bool kPipelined = true;
    // The pipelined kernel writes dQ itself (bench/NOTES.md v93, v96): a block's last key tile
    // (query tiles 2 kt and 2 kt + 1, the CTA's last steps) adds its share from the warpgroups'
    // registers to the sum read back from L2 and writes the block as dQ, so no store kernel runs.
    // False: every share goes through the writer and gqa_bwd_dq_store_kernel writes dQ.
    static constexpr bool kLastWrites = kPipelined;
    // The pipelined kernel at width 64 (one warpgroup's dQ product a step): the two warpgroups meet
    // at every second step only, and then each computes the dQ share of one step of the pair
    // (warpgroup 0 the first, 1 the second), so that neither waits at a step's barrier for the
    // other's dQ product and hand-over (bench/NOTES.md v104). dS^T then takes four buffers.
    static constexpr bool kPairedDq = kPipelined && DP == 64;
    // The pipelined kernel's writer hands step i's turn on once step i's reductions have
    // completed, which it awaits after issuing step i + kTurnLag's. 2 and 3 measured slower than 1
    // at width 64 and no faster at 128 (bench/NOTES.md v106).
    static constexpr int kTurnLag = 1;
    // kFreeLate: the writer frees step i's buffers once they have been read, which it awaits after
    // issuing step i + 1's reductions (v106); false: right after issuing step i's (before v106),
    // which keeps the writer waiting for the read but frees the buffers a step sooner (v108).
    static constexpr bool kFreeLate = DP == 128;
    // kDqFirst: a warpgroup that computes a dQ share in step i issues dK(i) behind that dQ product
    // (after the step's barrier), awaits the dQ product alone and hands it over while dK(i) still
    // runs, so that the hand-over and the writer's buffer wait sit under a product rather than
    // between the dQ product and S^T(i + 1) (bench/NOTES.md v110; width 64 v111). A step without a
    // dQ share (width 64, kPairedDq) issues dK(i) before the dS^T stores, as without the trait.
    // False: dK(i) before the barrier, the hand-over after all three products.
    static constexpr bool kDqFirst = true;
    // The pipelined kernel's CTAs in chunks of (batch, kv head) pairs (GqaBwdParams::fused_chunk),
    // key tiles first within a chunk, so that the dQ sums a chunk adds to (G x T x DP floats a
    // pair) stay in L2 while its key tiles add to them: pairs of at most this many bytes of sums a
    // chunk (at least one), at width 64 always, at 128 where the longest CTAs take at most 1 /
    // kChunkBalance128 of an SM's share (gqa_fused_grid_balanced; with fewer pairs the last chunk's
    // long key tiles start late) (bench/NOTES.md v106, v108). An order of pair + key tile, which
    // spreads the long key tiles over the grid, measured slower (v107).
    static constexpr int64_t kChunkSumBytes = DP == 64 ? 24 << 20 : 64 << 20;
    static constexpr int kChunkBalance128 = 6;
    static constexpr int kDsBuffers = kPipelined ? (kPairedDq ? 4 : 2) : 1;
    static_assert(kPipelined || !kGqaFusedScanFree, "the serial kernel returns on the inputs' scan's flag");
    // Instruments of the pipelined kernel, both true in use. kWriterTurns false: the writer adds
    // without waiting for the turn (not deterministic). kHandOverDq false: the dQ shares are
    // dropped (dQ is wrong), which leaves the products' own schedule.
    static constexpr bool kWriterTurns = true, kHandOverDq = true;
    // kFirstStores: key tile 0, every block's first adder, stores its shares (a bulk copy) where
    // the others add theirs, so only the counters are zeroed before the kernel, not the sums
    // (bench/NOTES.md v109). The serial kernel and the writer without turns add to zeroed sums.
    // False in use: compute-sanitizer's initcheck (2025.3) does not count a bulk copy to global
    // memory as a write, so every read of a stored sum is reported as uninitialized.
    static constexpr bool kFirstStores = false;
    static constexpr bool kStoresFirst = kFirstStores && kPipelined && kWriterTurns;
    // kRowStats: where the forward kept lse2, the statistics by gqa_bwd_row_stats_kernel (delta
    // from dO and o, lse2 copied) rather than by the dQ kernel's statistics pass, which also reads
    // q and holds a CTA's tiles in shared memory (bench/NOTES.md v109).
    static constexpr bool kRowStats = true;
    static constexpr bool kWriter = kPipelined || kDqAdd == DqAdd::kWriter;
    static constexpr int kMmaThreads = 256;                          // the two warpgroups of products
    static constexpr int kThreads = kMmaThreads + (kWriter ? 128 : 0);
    static constexpr int kMmaRegs = 240, kWriterRegs = 24;           // kWriter: setmaxnreg
    static_assert(kMmaRegs * kMmaThreads + kWriterRegs * 128 <= 65536, "the register file holds every warpgroup");
    // The launch gives each thread 65536 / kThreads registers, rounded down to 8; the products'
    // increase waits until the writer warpgroup's decrease has freed what it takes, so a writer
    // above 24 (with two warpgroups at 240) hangs the kernel (bench/NOTES.md v96).
    static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
    static_assert(!kWriter || (kLaunchRegs - kWriterRegs) * 128 >= (kMmaRegs - kLaunchRegs) * kMmaThreads,
                  "the writer warpgroup frees the registers the products take");
    static constexpr int kAdders = DP == 128 ? 2 : 1;   // warpgroups with dQ columns (64 each)
    static constexpr int kPieceFloats = 64 * 64;        // one warpgroup's share of a block
    // K, V, two stages of (Q, dO), dS^T, two stages of (lse2, delta), then kWriter's buffers; 1024
    // of alignment slack.
    static constexpr int kBufferBytes = kAdders * 2 * kPieceFloats * 4;
    static constexpr int kSmem = 1024 + 2 * (2 * kKvHalves + 4 * kRowHalves + kDsBuffers * kDsHalves) +
                                 2 * 2 * kRows * 4 + (kWriter ? kBufferBytes : 0);
    static_assert(kSmem <= 227 * 1024, "one CTA's shared memory");
};

__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void add_release(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Orders this thread's generic-proxy accesses to global memory with its bulk (async-proxy) ones.
__device__ __forceinline__ void fence_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// Adds `bytes` of fp32 at src (shared) into dst (global), element by element, in L2.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(bytes)
                 : "memory");
}
// Copies `bytes` at src (shared) to dst (global).
__device__ __forceinline__ void bulk_store(float* dst, const float* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's bulk groups are still running (N = 0: all complete, writes done).
template <int N> __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
// Until at most N of them are still reading their shared-memory sources.
template <int N> __device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// Named barrier `id` of `count` threads: waiting, or arriving only.
__device__ __forceinline__ void named_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
// kWriter's barriers (1 is the two warpgroups' own): warpgroup c's buffer j full, and free again.
__device__ __forceinline__ int dq_full_id(int c, int j) { return 2 + 2 * c + j; }
__device__ __forceinline__ int dq_empty_id(int c, int j) { return 6 + 2 * c + j; }
constexpr int kHandOver = 128 + 32;   // a warpgroup and the writer warp
// Named barrier of warpgroup wg's 128 threads alone (the pipelined kernel's last key tile).
__device__ __forceinline__ int warpgroup_bar_id(int wg) { return 10 + wg; }

// A warp's dS^T into the swizzled [128 keys][64 query rows] tile ds: row = key (its 16 of the
// CTA's 128 from r0 = 64 wg + 16 cw + lane / 4), column = query row, from its packed form (pack_p:
// k-step ks holds columns 16 ks .. + 15 of rows lane / 4 and lane / 4 + 8).
__device__ __forceinline__ void store_ds_t(uint16_t* tile, const uint32_t (&pa)[4][4], int wg, int cw, int lane) {
    unsigned char* ds = reinterpret_cast<unsigned char*>(tile);
    const int r0 = 64 * wg + 16 * cw + (lane >> 2);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const int c0 = 16 * ks + 2 * (lane & 3);
        *reinterpret_cast<uint32_t*>(ds + sw128_offset(r0, c0, 128)) = pa[ks][0];
        *reinterpret_cast<uint32_t*>(ds + sw128_offset(r0 + 8, c0, 128)) = pa[ks][1];
        *reinterpret_cast<uint32_t*>(ds + sw128_offset(r0, c0 + 8, 128)) = pa[ks][2];
        *reinterpret_cast<uint32_t*>(ds + sw128_offset(r0 + 8, c0 + 8, 128)) = pa[ks][3];
    }
}

// A warp's 16 key rows of dK (times 1 / sqrt(D)) and dV from its accumulators, rows from j0; rows
// past T are left.
template <int DP>
__device__ __forceinline__ void store_key_rows(const float (&dk)[DP / 8][4], const float (&dv)[DP / 8][4], const GqaBwdParams& p,
                                               int64_t b, int kvh, int j0, int lane, bool bf16) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int j = j0 + frag_row(lane, 2 * half);
        if (j >= p.T) continue;
        const int64_t row = (b * p.T + j) * p.Hkv + kvh;
        uint16_t* dk_out = static_cast<uint16_t*>(p.dk) + row * DP;
        uint16_t* dv_out = static_cast<uint16_t*>(p.dv) + row * DP;
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
            const int c = frag_col(lane, n, 2 * half);
            store_pair(dk_out + c, dk[n][2 * half] * p.scale, dk[n][2 * half + 1] * p.scale, bf16);
            store_pair(dv_out + c, dv[n][2 * half], dv[n][2 * half + 1], bf16);
        }
    }
}

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

// dQ = the fp32 sum times 1 / sqrt(D), in the input dtype: a thread a float4 of the blocks (two
// columns of two rows, 8 apart), read in order and written back to [B, T, Hq, DP]; rows past T
// are left.
template <bool kBf16, int DP>
__global__ void gqa_bwd_dq_store_kernel(const GqaBwdParams p, int64_t quads) {
    if (*p.nonfinite) return;
    const int n_q = (p.T + 63) / 64;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < quads; i += int64_t(gridDim.x) * blockDim.x) {
        const float4 x = reinterpret_cast<const float4*>(p.dq_accum)[i];
        const int64_t block = i / (16 * DP);
        const int in_block = int(i % (16 * DP)), piece = in_block / 1024, n = in_block % 1024 / 128, w = in_block % 128;
        const int lane = w % 32, row = 16 * (w / 32) + (lane >> 2), col = 64 * piece + 8 * n + 2 * (lane & 3);
        const int qi = int(block % n_q), h = int(block / n_q % p.Hq);
        const int64_t b = block / n_q / p.Hq;
        const int t = qi * 64 + row;
        uint16_t* dq = static_cast<uint16_t*>(p.dq) + ((b * p.T + t) * p.Hq + h) * DP + col;
        if (t < p.T) store_pair(dq, x.x * p.scale, x.y * p.scale, kBf16);
        if (t + 8 < p.T) store_pair(dq + 8 * int64_t(p.Hq) * DP, x.z * p.scale, x.w * p.scale, kBf16);
    }
}

// FusedTraits::kRowStats' statistics, where the forward kept lse2 (GqaBwdParams::lse2_kept): per query row, delta = dO . o
// and the forward's lse2, into [B, Hq, T64] (bwd_stat_row; rows past T zero). One CTA per (64-row
// query tile, batch, head), heads fastest (bwd_cta), so that neighbouring CTAs read neighbouring
// lse2; DP / 8 threads a row, 16 bytes of dO and of o each. A row whose delta or lse2 is not
// finite raises bit 0 of the flag, as the dQ kernel's statistics pass does: Inf or NaN in the
// row's dO or o, an fp32 overflow of their products, or Inf or NaN in its q (which makes every
// score of the row, and so the forward's log-sum-exp of them, Inf or NaN; q itself is not read),
// or scores past fp32's range.
template <bool kBf16, int DP>
__global__ void __launch_bounds__(256) gqa_bwd_row_stats_kernel(const GqaBwdParams p) {
    constexpr int kLanes = DP / 8, kRowsPerPass = 256 / kLanes, kPasses = 64 / kRowsPerPass;
    static_assert(kPasses * kRowsPerPass == 64 && 32 % kLanes == 0, "a tile's rows in whole passes of whole warps");
    const BwdCta cta = bwd_cta(p.B, p.Hq);
    const int sub = int(threadIdx.x) % kLanes;
    auto row_t = [&](int k) { return cta.tile * 64 + k * kRowsPerPass + int(threadIdx.x) / kLanes; };
    uint4 x[kPasses], y[kPasses];
#pragma unroll
    for (int k = 0; k < kPasses; ++k) {   // every pass's reads first
        const int t = row_t(k);
        x[k] = y[k] = make_uint4(0u, 0u, 0u, 0u);
        if (t < p.T) {
            const int64_t row = ((cta.b * p.T + t) * p.Hq + cta.head) * int64_t(DP);
            x[k] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.dout) + row) + sub);
            y[k] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.o) + row) + sub);
        }
    }
    bool bad = false;
#pragma unroll
    for (int k = 0; k < kPasses; ++k) {
        float sum = dot8_16bit(x[k], y[k], 0.f, kBf16);
#pragma unroll
        for (int m = 1; m < kLanes; m *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
        const int t = row_t(k);
        if (sub == 0) {
            const int64_t stat = bwd_stat_row(cta.b, cta.head, t, p);
            const float lse2 = t < p.T ? p.lse2_in[(cta.b * p.T + t) * p.Hq + cta.head] : 0.f;
            bad = bad || (t < p.T && !(isfinite(lse2) && isfinite(sum)));
            p.lse2[stat] = lse2;
            p.delta[stat] = t < p.T ? sum : 0.f;
        }
    }
    flag_nonfinite(p, bad);
}

// The statistics pass and the fused kernel (without kLastWrites then the store kernel), on the same
// stream after the flag is zeroed (or the inputs' scan, without kGqaFusedScanFree: attention.cu);
// the counters (and, unless kStoresFirst, the sums) start from zero.
template <class Pol>
cudaError_t fused_launch(const GqaBwdParams& p_in, cudaStream_t stream, int dev) {
    constexpr bool kBf16 = Pol::kBf16;
    constexpr int DP = Pol::DP;
    using Tr = FusedTraits<DP>;
    if (p_in.dtype != (kBf16 ? kGqaBFloat16 : kGqaFloat16) || p_in.D != DP || p_in.dq_accum == nullptr) return cudaErrorInvalidValue;
    GqaBwdParams p = p_in;
    const int64_t pair_bytes = int64_t(p.group) * ((p.T + Tr::kRows - 1) / Tr::kRows) * Tr::kRows * DP * 4;
    const bool chunked = DP == 64 || gqa_fused_grid_balanced(p, sm_count(dev), Tr::kChunkBalance128);
    const int64_t pairs = int64_t(p.B) * p.Hkv, fit = Tr::kChunkSumBytes / pair_bytes > 1 ? Tr::kChunkSumBytes / pair_bytes : 1;
    p.fused_chunk = chunked ? int(fit < pairs ? fit : pairs) : 0;
    static bool raised_stats[kMaxDevices] = {}, raised_fused[kMaxDevices] = {};
    const int64_t q_tiles = (p.T + kTile - 1) / kTile, key_tiles = (p.T + Tr::kKeys - 1) / Tr::kKeys;
    const int64_t stats_ctas = (q_tiles + Pol::kRowGroups - 1) / Pol::kRowGroups * p.B * p.Hq, fused_ctas = key_tiles * p.B * p.Hkv;
    const int64_t row_stats_ctas = (p.T + 63) / 64 * p.B * p.Hq;
    if (stats_ctas > 0x7fffffff || fused_ctas > 0x7fffffff || row_stats_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
    cudaError_t err = raise_smem_limit(gqa_bwd_dq_kernel<Pol, true>, BwdSmem<Pol>::kDq, dev, raised_stats);
    if (err == cudaSuccess) {
        if constexpr (Tr::kPipelined) {
            err = raise_smem_limit(gqa_bwd_pipe_kernel<Pol>, Tr::kSmem, dev, raised_fused);
        } else {
            err = raise_smem_limit(gqa_bwd_fused_kernel<Pol>, Tr::kSmem, dev, raised_fused);
        }
    }
    typename Pol::Maps maps;
    if (err == cudaSuccess) err = Pol::make_maps(p, &maps);
    if (err == cudaSuccess) {
        const int64_t blocks = int64_t(p.B) * p.Hq * ((p.T + 63) / 64);   // the counters follow the sums
        err = Tr::kStoresFirst ? cudaMemsetAsync(p.dq_order, 0, blocks * sizeof(int), stream)
                               : cudaMemsetAsync(p.dq_accum, 0, gqa_fused_dq_floats(p) * sizeof(float), stream);
    }
    if (err != cudaSuccess) return err;
    if (Tr::kRowStats && p.lse2_kept) {   // (lse2_kept implies lse2_in: GqaBwdParams)
        gqa_bwd_row_stats_kernel<kBf16, DP><<<unsigned(row_stats_ctas), 256, 0, stream>>>(p);
    } else {
        gqa_bwd_dq_kernel<Pol, true><<<unsigned(stats_ctas), kThreads * Pol::kRowGroups, BwdSmem<Pol>::kDq, stream>>>(p, maps);
    }
    if constexpr (Tr::kPipelined) {
        gqa_bwd_pipe_kernel<Pol><<<unsigned(fused_ctas), Tr::kThreads, Tr::kSmem, stream>>>(p, maps);
    } else {
        gqa_bwd_fused_kernel<Pol><<<unsigned(fused_ctas), Tr::kThreads, Tr::kSmem, stream>>>(p, maps);
    }
    if constexpr (!Tr::kLastWrites) {
        const int64_t quads = int64_t(p.B) * p.Hq * ((p.T + 63) / 64) * 16 * DP, store_ctas = (quads + 255) / 256 < 4096 ? (quads + 255) / 256 : 4096;
        gqa_bwd_dq_store_kernel<kBf16, DP><<<unsigned(store_ctas), 256, 0, stream>>>(p, quads);
    }
    return cudaGetLastError();
}

}  // namespace
#endif  // GQA_BWDWG_FUSED_CUH
