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

}  // namespace

#include "bwdwg/fused_serial.cuh"   // gqa_bwd_fused_kernel: the serial step, kept for measurement
#include "bwdwg/fused_pipe.cuh"     // gqa_bwd_pipe_kernel: the pipelined step, in use

namespace {

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
